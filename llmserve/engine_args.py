"""EngineArgs: one dataclass schema for ``LLM(**kwargs)`` and the CLI flags (vLLM's
``EngineArgs``). Flags and their help are generated from the fields, so they cannot drift.

Every field has vLLM's name and default. A value this engine cannot honour yet (tensor
parallel, a KV connector...) raises a ValueError naming the field in
``create_engine_config()``; a field that is accepted but has no effect here says so in its
help. The normalisations vLLM's ``LLM`` does (an int ``compilation_config``, a dict
``kv_transfer_config``, a class ``worker_cls``) happen in ``__post_init__``, so Python
callers and the CLI get the same result.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union, get_args, get_origin

from llmserve.spec_decode.config import SpeculativeConfig, make_speculative_config
from llmserve.structured_output.config import (StructuredOutputsConfig, make_structured_outputs_config,
                                               with_reasoning_parser)
from llmserve.config import (AdmissionConfig, CacheConfig, CompilationConfig, CompilationMode, KVEventsConfig,
                             KVTransferConfig,
                             ModelConfig, ObservabilityConfig, ParallelConfig, SchedulerConfig, VllmConfig,
                             resolve_dtype)
# Who builds the engine, its batching defaults and the KV cache size parser live in
# engine_defaults.py (the config builder reads them too); re-exported under these names.
from llmserve.engine_defaults import UsageContext, default_batching, parse_bytes  # noqa: F401
from llmserve.served_names import check_served_name

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


# ---- vLLM's normalisations of LLM kwargs -------------------------------------------------
def make_compilation_config(value: Any) -> CompilationConfig:
    """vLLM's rule: None -> default, an int n -> ``CompilationConfig(mode=CompilationMode(n))``,
    a dict -> ``CompilationConfig(**dict)``, a JSON string (CLI) as a dict or int.
    Raises ValueError naming ``compilation_config``."""
    if isinstance(value, CompilationConfig):
        return value
    if value is None:
        return CompilationConfig()
    if isinstance(value, str):
        value = _json_value("compilation_config", value)
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return CompilationConfig(mode=CompilationMode(value))
        except ValueError as e:
            raise ValueError(f"compilation_config: {e}") from None
    if isinstance(value, dict):
        try:
            return CompilationConfig(**value)
        except TypeError as e:
            raise ValueError(f"compilation_config: {e}") from None
    raise ValueError(f"compilation_config must be an int, a dict or a CompilationConfig, got {value!r}")


def make_kv_transfer_config(value: Any) -> Optional[KVTransferConfig]:
    """A dict (or JSON string) becomes ``KVTransferConfig``; an invalid one is logged and
    raises ``ValueError("Invalid 'kv_transfer_config' provided: ...")``, as vLLM's ``LLM``."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    raw = value
    try:
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise TypeError(f"expected a dict, got {type(value).__name__}")
        return KVTransferConfig(**value)
    except (TypeError, ValueError) as e:
        logger.error("Failed to convert 'kv_transfer_config' dict to KVTransferConfig object. "
                     "Dict: %s. Error: %s", raw, e)
        raise ValueError(f"Invalid 'kv_transfer_config' provided: {e}") from e


def make_kv_events_config(value: Any) -> Optional[KVEventsConfig]:
    """A dict (or JSON string, as ``--kv-events-config``) becomes ``KVEventsConfig``.
    Raises ValueError naming ``kv_events_config`` and the field at fault (bad JSON, not
    an object, an unknown field with the closest known one, a bad value)."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        value = _json_value("kv_events_config", value)
    if not isinstance(value, dict):
        raise ValueError(f"kv_events_config must be a JSON object (dict), got {value!r}")
    known = [f.name for f in fields(KVEventsConfig)]
    for key in value:
        if key not in known:
            raise ValueError(f"kv_events_config: unknown field {key!r}{_closest(key, known)} "
                             f"(vLLM's KVEventsConfig fields: {', '.join(known)})")
    return KVEventsConfig(**value)


def make_worker_cls(value: Any) -> Union[str, bytes]:
    """A class is cloudpickled (vLLM: so a class defined in a script reaches the engine
    process); a qualified name or "auto" stays a string."""
    if isinstance(value, type):
        import cloudpickle

        return cloudpickle.dumps(value)
    if not isinstance(value, (str, bytes)):
        raise ValueError(f"worker_cls must be 'auto', a qualified class name or a class, got {value!r}")
    return value


def _json_value(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not valid JSON: {text!r} ({e})") from None


def _json_dict(name: str):
    def parse(text: str) -> dict:
        value = _json_value(name, text)
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{name}: expected a JSON object, got {text!r}")
        return value
    parse.__name__ = name  # argparse names the converter in its error message
    return parse


def _help(text: str, cli_type: Any = None) -> dict:
    return {"help": text, "cli_type": cli_type} if cli_type else {"help": text}


def _closest(name: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def check_kwargs(owner: str, kwargs: dict, allowed: list[str]) -> None:
    """TypeError naming each unknown keyword and the closest allowed one (difflib)."""
    for key in kwargs:
        if key not in allowed:
            raise TypeError(f"{owner} got an unexpected keyword argument {key!r}{_closest(key, allowed)}")


def _names_closest_field(cls):
    """Wrap a dataclass ``__init__`` so an unknown keyword names the closest field."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        check_kwargs(type(self).__name__, kwargs, [f.name for f in fields(type(self)) if f.init])
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


_UNSUPPORTED = "not supported by this engine"


@_names_closest_field
@dataclass
class EngineArgs:
    """Arguments of the engine (vLLM's ``EngineArgs``). Every field is also a CLI flag
    (``--field-name``); ``LLM(**kwargs)`` takes every field. An unknown keyword raises a
    TypeError naming the closest field."""

    # ---- model
    model: str = field(default=DEFAULT_MODEL, metadata=_help("Model: HF directory, .gguf file, HF cache id or packaged model name."))
    served_model_name: Optional[list[str]] = field(default=None, metadata=_help("Model name(s) used in the API (default: the model argument)."))
    tokenizer: Optional[str] = field(default=None, metadata=_help("Tokenizer path or name (defaults to the model)."))
    tokenizer_mode: str = field(default="auto", metadata=_help("'auto' or 'hf' (the fast HF tokenizer); other vLLM modes are " + _UNSUPPORTED + "."))
    skip_tokenizer_init: bool = field(default=False, metadata=_help("vLLM's token-ids-only mode; " + _UNSUPPORTED + " (False only)."))
    trust_remote_code: bool = field(default=False, metadata=_help("Accepted for vLLM compatibility; no effect (no remote code is run)."))
    revision: Optional[str] = field(default=None, metadata=_help("Model revision (branch, tag or commit) in the local HF cache; not used for local paths."))
    tokenizer_revision: Optional[str] = field(default=None, metadata=_help("Tokenizer revision in the local HF cache; not used for local paths."))
    dtype: str = field(default="auto", metadata=_help("Weights/activations dtype: auto, float32, bfloat16, float16, half, float."))
    seed: int = field(default=0, metadata=_help("Random seed for unseeded sampling."))
    max_model_len: Optional[int] = field(default=None, metadata=_help("Context length in tokens (default: the model's, capped at 2048 on CPU)."))
    quantization: Optional[str] = field(default=None, metadata=_help("Weight quantization: None (the checkpoint's own; GGUF files are dequantized on load) or 'gguf' for a GGUF model; other methods are " + _UNSUPPORTED + "."))
    load_format: str = field(default="auto", metadata=_help("'auto', 'safetensors' or 'gguf'; other vLLM formats are " + _UNSUPPORTED + "."))
    enforce_eager: bool = field(default=True, metadata=_help("Accepted for vLLM compatibility; this engine always runs eagerly (no CUDA graphs)."))
    enable_sleep_mode: bool = field(default=False, metadata=_help("Allow sleep / wake_up (vLLM's sleep mode): LLM.sleep(level), LLM.wake_up(), and with VLLM_SERVER_DEV_MODE=1 the server's POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping. Asleep, the engine frees its weights and KV cache; the next request wakes it."))
    sleep_idle_seconds: Optional[float] = field(default=None, metadata=_help("llama.cpp's --sleep-idle-seconds: the engine process sleeps (level 1) after this many seconds without work; the next request wakes it. None: never."))
    batch_invariant: bool = field(default=False, metadata=_help("Batch-invariant numerics (vLLM's VLLM_BATCH_INVARIANT): every step's GEMMs are padded to at least 4 rows, so a request's logits (and greedy tokens) are bit-identical alone, batched, chunked or after a prefix-cache hit. Costs only steps of 1-3 tokens (low-concurrency decode). Off: only steps holding a seeded request are padded."))
    max_logprobs: int = field(default=20, metadata=_help("Most logprobs a request may ask for per token (-1: no limit)."))
    disable_sliding_window: bool = field(default=False, metadata=_help("Cap max_model_len at the model's sliding window (vLLM's rule)."))
    generation_config: str = field(default="auto", metadata=_help("Default sampling parameters: 'auto' (the model's generation_config.json), 'vllm' (none), or a directory holding a generation_config.json."))
    override_generation_config: Optional[dict] = field(default=None, metadata=_help("JSON dict merged over the generation config, e.g. '{\"temperature\": 0.5}'.", _json_dict("override_generation_config")))
    chat_template: Optional[str] = field(default=None, metadata=_help("Chat template (file path or literal) overriding the model's."))
    runner: str = field(default="auto", metadata=_help("auto, generate or pooling (vLLM's --runner): auto picks from the architecture (an encoder or a *ForSequenceClassification pools, a causal LM generates)."))
    convert: str = field(default="auto", metadata=_help("auto, none, embed or classify (vLLM's --convert): embed runs a causal LM as an embedding model (last-token pooling, normalised); classify runs a *ForSequenceClassification checkpoint's classification head (auto picks it from the architecture)."))
    # ---- cache
    block_size: int = field(default=16, metadata=_help("KV cache block size in tokens."))
    kv_cache_dtype: str = field(default="auto", metadata=_help("KV cache dtype: 'auto' (the model's dtype; float16 for quantized weights run on the packed kernels under float32 activations, dtype auto on CPUs without bfloat16, as llama.cpp's default cache), or 'bfloat16' / 'float16' / 'float32' under a float32 model (16 bits: half the KV bytes); fp8 caches are " + _UNSUPPORTED + "."))
    kv_cache_memory: Optional[str] = field(default=None, metadata=_help("KV cache size, e.g. 8GiB (default 4GiB on CPU; made resident while the engine is idle)."))
    kv_cache_memory_bytes: Optional[int] = field(default=None, metadata=_help("KV cache size in bytes (vLLM's name; same as --kv-cache-memory)."))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help("Accepted for vLLM compatibility; the KV cache is sized by --kv-cache-memory (as vLLM's CPU backend)."))
    cpu_offload_gb: float = field(default=0.0, metadata=_help("Weight offloading to CPU (GiB); " + _UNSUPPORTED + " (0 only)."))
    num_gpu_blocks_override: Optional[int] = field(default=None, metadata=_help("Force the number of KV cache blocks (testing)."))
    enable_prefix_caching: bool = field(default=True, metadata=_help("Reuse KV blocks of shared prompt prefixes."))
    kv_sharing_fast_prefill: bool = field(default=False, metadata=_help("vLLM's KV-sharing prefill shortcut; no model here shares KV, so it only forbids prompt_logprobs (as vLLM)."))
    # ---- scheduler
    max_num_batched_tokens: Optional[int] = field(default=None, metadata=_help("Token budget per engine step (default on CPU: 4096 for the offline LLM, 2048 for the server, as vLLM)."))
    max_num_seqs: Optional[int] = field(default=None, metadata=_help("Max number of requests per engine step (default on CPU: 256 for the offline LLM, 128 for the server, as vLLM)."))
    enable_chunked_prefill: bool = field(default=True, metadata=_help("Split long prompts across steps."))
    long_prefill_token_threshold: int = field(default=0, metadata=_help("Per-step cap on one prompt's prefill tokens; " + _UNSUPPORTED + " (0 only)."))
    max_num_partial_prefills: int = field(default=1, metadata=_help("Concurrent partial prefills; " + _UNSUPPORTED + " (1 only)."))
    max_long_partial_prefills: int = field(default=1, metadata=_help("Concurrent long partial prefills; " + _UNSUPPORTED + " (1 only)."))
    scheduling_policy: str = field(default="fcfs", metadata=_help("fcfs or priority."))
    tenant_fair_share: bool = field(default=True, metadata=_help("Share the engine between tenants (API keys of --api-keys-file) by weighted fair queueing over tokens: a waiting request of the tenant furthest below its share goes first and the one furthest over it is preempted first; within a --scheduling-policy priority class (beyond vLLM). --no-tenant-fair-share: one first-come queue."))
    async_scheduling: bool = field(default=False, metadata=_help("Overlap scheduling with the forward pass; " + _UNSUPPORTED + " (False only)."))
    # ---- parallel
    tensor_parallel_size: int = field(default=1, metadata=_help("Tensor parallel size: worker processes (or Ray actors) that each hold a share of the attention heads, MLP columns and vocabulary (Llama family; at most the number of KV heads)."))
    pipeline_parallel_size: int = field(default=1, metadata=_help("Pipeline parallel size; " + _UNSUPPORTED + " (1 only)."))
    data_parallel_size: int = field(default=1, metadata=_help("Data parallel engines: N EngineCore processes (each with cores / N threads) behind one load-balancing client (server only; offline use examples/offline_inference/data_parallel.py)."))
    data_parallel_rank: Optional[int] = field(default=None, metadata=_help("With external load balancing: the one data-parallel rank this server runs (setting it turns on --data-parallel-external-lb, as vLLM)."))
    data_parallel_start_rank: int = field(default=0, metadata=_help("First data-parallel rank of this host; with --data-parallel-external-lb and no --data-parallel-rank, the rank this server runs."))
    data_parallel_size_local: Optional[int] = field(default=None, metadata=_help("Data-parallel ranks on this host, which share its cores (default: all of --data-parallel-size: one host)."))
    data_parallel_address: Optional[str] = field(default=None, metadata=_help("Multi-node data parallel: the head node's address; with --data-parallel-size-local below --data-parallel-size the head binds its remote ranks' sockets there and --headless nodes join it (one host needs none)."))
    data_parallel_rpc_port: Optional[int] = field(default=None, metadata=_help("Multi-node data parallel: the head's TCP port for joining nodes; remote rank r's engine sockets use ports P+1+2r and P+2+2r on --data-parallel-address."))
    headless: bool = field(default=False, metadata=_help("Run only this node's data-parallel engines (ranks --data-parallel-start-rank.. +--data-parallel-size-local), no API server; they join the head at --data-parallel-address:--data-parallel-rpc-port and stop when it goes away (vLLM's multi-node data parallel)."))
    data_parallel_hybrid_lb: bool = field(default=False, metadata=_help("Hybrid load balancing (vLLM's multi-node mode with an API server on every node): this node's API server balances only its own ranks, --data-parallel-start-rank.. +--data-parallel-size-local, and a load balancer in front spreads requests over the nodes; no node depends on another (dense models need no cross-rank synchronisation here)."))
    data_parallel_backend: str = field(default="mp", metadata=_help("How data-parallel engines are placed: 'mp' (local processes, and --headless nodes) or 'ray' (each rank an actor placed by a Ray placement group on the Ray cluster that ray.init() finds, as vLLM's)."))
    data_parallel_external_lb: bool = field(default=False, metadata=_help("External load balancing: this server runs one data-parallel rank (--data-parallel-rank) through a DPAsyncMPClient; a load balancer in front spreads requests over the servers."))
    distributed_executor_backend: Optional[str] = field(default=None, metadata=_help("None (uni for one worker, mp for several), 'uni' (the model in the engine process), 'mp' (worker processes) or 'ray' (Ray actors in a placement group); 'external_launcher' is " + _UNSUPPORTED + "."))
    worker_cls: str = field(default="auto", metadata=_help("Worker class: 'auto', or a qualified class name or class (cloudpickled); custom workers are " + _UNSUPPORTED + "."))
    # ---- LoRA (llmserve/lora)
    enable_lora: bool = field(default=False, metadata=_help("Serve LoRA adapters over the base model (PEFT directories or GGUF LoRA files; Llama-family models)."))
    max_loras: int = field(default=1, metadata=_help("Most distinct LoRA adapters in one batch (the base model's rows do not count)."))
    max_lora_rank: int = field(default=16, metadata=_help("Largest LoRA rank accepted (one of 1, 8, 16, 32, 64, 128, 256, 320, 512)."))
    max_cpu_loras: Optional[int] = field(default=None, metadata=_help("Most LoRA adapters kept loaded (default: max_loras); the least recently used idle one is unloaded past it and re-read from its path when next used (its files must stay there)."))
    lora_dtype: str = field(default="auto", metadata=_help("LoRA weights' dtype: auto (the model's; bfloat16 for a float16 model on CPU, where the LoRA kernel sums in float32 over float32 or bfloat16 weights), float32, bfloat16 or float16."))
    # ---- compilation, KV transfer
    compilation_config: Optional[CompilationConfig] = field(default=None, metadata=_help("An int (the -O mode) or a JSON dict, as vLLM; the engine runs eagerly, so any mode is logged and runs as mode 0.", str))
    speculative_config: Optional[SpeculativeConfig] = field(default=None, metadata=_help("Speculative decoding as a JSON dict (vLLM's SpeculativeConfig): n-gram drafts from the request's own prompt and output, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'; the draft length adapts per request to the measured acceptance. Draft models are " + _UNSUPPORTED + ".", str))
    kv_transfer_config: Optional[KVTransferConfig] = field(default=None, metadata=_help("KV connector as a JSON dict (vLLM's KVTransferConfig): kv_connector SharedStorageConnector (prompt KV blocks kept on disk under kv_connector_extra_config.shared_storage_path, reused across requests and restarts; restore_on_start, default true, loads the most recent ones into the prefix cache at start: false, or a share of the KV cache) or OffloadingConnector, kv_role kv_both / kv_producer (save only) / kv_consumer (load only); third-party connectors: kv_connector_module_path. Disaggregated prefill is " + _UNSUPPORTED + ".", str))
    kv_offloading_size: Optional[float] = field(default=None, metadata=_help("GiB of KV blocks the offloading tier keeps (vLLM's --kv-offloading-size): with --kv-offloading-backend native, full prompt blocks are kept on local disk ($XDG_CACHE_HOME/llmserve/kv_offload, least recently used evicted past the size) and loaded instead of recomputed, after a restart too (OffloadingConnector)."))
    kv_offloading_backend: str = field(default="native", metadata=_help("KV offloading backend with --kv-offloading-size: native (this engine's disk tier); lmcache is " + _UNSUPPORTED + "."))
    kv_events_config: Optional[KVEventsConfig] = field(default=None, metadata=_help("KV cache events as a JSON dict (vLLM's KVEventsConfig): with '{\"enable_kv_cache_events\": true}' the prefix cache's BlockStored / BlockRemoved / AllBlocksCleared batches go out on a ZMQ PUB socket (endpoint, default tcp://*:5557; topic) in vLLM's msgpack format, and replay_endpoint (e.g. tcp://*:5558) answers a subscriber that missed some (buffer_steps batches kept); data-parallel rank r uses the ports + r. event_layout (llmserve's): 'map' (default: events as tagged maps, as current vLLM sends and vllm-router's kv_aware policy reads) or 'array' (older vLLM's array_like events).", str))
    # ---- structured outputs
    structured_outputs_config: Optional[StructuredOutputsConfig] = field(default=None, metadata=_help("Structured outputs as a JSON dict (vLLM's StructuredOutputsConfig): backend ('auto' or 'xgrammar'), disable_any_whitespace (default true here: no free whitespace in JSON), disable_additional_properties, enable_in_reasoning, max_compile_workers (default 2: threads compiling grammars; a grammar whose spec is 16 KiB or more may not take the last one, so small grammars never wait behind a large one; an aborted request's grammar is not compiled when still queued, and its result is dropped when it was compiling).", str))
    reasoning_parser: str = field(default="", metadata=_help("Reasoning parser name; a structured-output request's grammar applies once its reasoning ends (the parser's is_reasoning_end)."))
    # ---- front end, process
    renderer_num_workers: int = field(default=1, metadata=_help("Threads that render chat templates and tokenize on the server's async path (no effect offline)."))
    shutdown_timeout: int = field(default=0, metadata=_help("Seconds in-flight requests get to finish when the server shuts down, and the engine process gets to exit (vLLM's --shutdown-timeout); 0: the server's --timeout-graceful-shutdown (10 s) and the engine's own 5 s."))
    disable_log_stats: bool = field(default=False, metadata=_help("Do not log per-step stats."))
    request_timelines: bool = field(default=True, metadata=_help("Keep each request's timeline (queued, each prefill chunk, preemptions, first token, finish) for GET /v1/requests and /v1/requests/{id}/timeline (needs stats: off under --disable-log-stats)."))
    max_finished_request_timelines: int = field(default=1000, metadata=_help("Finished requests whose timelines are kept (the oldest are dropped)."))
    otlp_traces_endpoint: Optional[str] = field(default=None, metadata=_help("OpenTelemetry OTLP endpoint (e.g. http://collector:4318/v1/traces, or grpc://host:4317) that gets one span per request with vLLM's gen_ai.* attributes; needs the opentelemetry-sdk and OTLP exporter packages (pip install 'llmserve[otel]'). The protocol is $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc or http/protobuf) or else http/protobuf for a /v1/traces path and grpc (vLLM's default) for any other."))
    collect_detailed_traces: Optional[list[str]] = field(default=None, metadata=_help("Modules (or a comma list) whose timings the spans carry: model (gen_ai.latency.time_in_model_forward), worker (time_in_model_execute), all; only with --otlp-traces-endpoint."))
    restart_engine_on_failure: Optional[bool] = field(default=None, metadata=_help("Restart a dead or stalled engine process in place; requests in flight resume from the tokens already sent (default: on for `llmserve serve`, off for the offline LLM)."))
    engine_stall_timeout: float = field(default=60.0, metadata=_help("Seconds with no engine output while requests are in flight after which the engine counts as stalled: /health answers 503 and, with --restart-engine-on-failure, the engine is killed and restarted (0: never)."))
    max_engine_restarts: int = field(default=5, metadata=_help("Engine restarts allowed within --engine-restart-window seconds; one more failure exits the server non-zero."))
    engine_restart_window: float = field(default=300.0, metadata=_help("Seconds over which --max-engine-restarts counts restarts."))
    num_threads: Optional[int] = field(default=None, metadata=_help("torch CPU threads in the engine (default: all cores)."))
    device: str = field(default="auto", metadata=_help("cpu, cuda or auto."))

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        for name in self.served_model_name or ():
            # the served-name rule (llmserve.served_names): names reach logs and metric labels
            check_served_name(name, "served_model_name")
        self.compilation_config = make_compilation_config(self.compilation_config)
        self.kv_transfer_config = make_kv_transfer_config(self.kv_transfer_config)
        self.speculative_config = make_speculative_config(self.speculative_config)
        self.kv_events_config = make_kv_events_config(self.kv_events_config)
        self.structured_outputs_config = with_reasoning_parser(
            make_structured_outputs_config(self.structured_outputs_config), self.reasoning_parser)
        self.worker_cls = make_worker_cls(self.worker_cls)
        if self.override_generation_config is None:
            self.override_generation_config = {}
        elif not isinstance(self.override_generation_config, dict):
            raise ValueError("override_generation_config must be a dict, got "
                             f"{type(self.override_generation_config).__name__}")
        if not isinstance(self.renderer_num_workers, int) or self.renderer_num_workers < 1:
            raise ValueError(f"renderer_num_workers must be an integer >= 1, got {self.renderer_num_workers!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")

    # ---- CLI -------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """Add one ``--flag`` per field (bools get ``--flag/--no-flag``)."""
        for f in fields(cls):
            if f.name not in skip:
                parser.add_argument("--" + f.name.replace("_", "-"), **_cli_kwargs(f))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    # ---- config ------------------------------------------------------------
    def create_engine_config(self, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT) -> VllmConfig:
        """Resolve the model and build the VllmConfig. ``usage_context`` picks the
        defaults of max_num_batched_tokens and max_num_seqs when they are None
        (``default_batching``). The generation-config defaults are read here, once.

        Raises ValueError for an unknown model, a bad dtype, a max_model_len larger than
        the model supports, or a value this engine cannot honour yet (naming the field).
        """
        from llmserve.engine_config_builder import build_vllm_config

        return build_vllm_config(self, usage_context)


def _cli_kwargs(f: dataclasses.Field) -> dict:
    """argparse keyword arguments of one EngineArgs field."""
    helptext = f.metadata.get("help", "")
    default = f.default if f.default is not dataclasses.MISSING else None
    shown = helptext if default is None or "(default" in helptext else f"{helptext} (default: {default})"
    tp = f.type if not isinstance(f.type, str) else eval(f.type, globals())  # noqa: S307 (our own annotations)
    origin, inner = get_origin(tp), [a for a in get_args(tp) if a is not type(None)]
    if f.metadata.get("cli_type"):
        return {"type": f.metadata["cli_type"], "default": default, "help": shown}
    if tp is bool or (origin is Union and inner == [bool]):
        return {"action": argparse.BooleanOptionalAction, "default": default, "help": shown}
    if origin is list or (origin is Union and inner and get_origin(inner[0]) is list):
        return {"nargs": "+", "default": default, "help": helptext}
    base = inner[0] if origin is Union and inner else tp
    return {"type": base if base in (int, float) else str, "default": default, "help": shown}


def log_non_default_args(args: Union[EngineArgs, argparse.Namespace]) -> dict[str, Any]:
    """Log, once at start, the engine arguments that differ from their defaults (vLLM's
    ``log_non_default_args``). ``args``: EngineArgs, or the server's parsed Namespace
    (only its engine flags are compared). Returns the logged dict."""
    diff: dict[str, Any] = {}
    for f in fields(EngineArgs):
        if not hasattr(args, f.name):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        value = getattr(args, f.name)
        if value != default and not (f.name == "compilation_config" and value == CompilationConfig()) \
                and not (f.name == "structured_outputs_config" and value == StructuredOutputsConfig()) \
                and not (f.name == "override_generation_config" and value == {}):
            diff[f.name] = value
    if diff:
        logger.info("non-default args: %s", diff)
    return diff


@_names_closest_field
@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLM (adds request logging and the server's admission limits)."""

    disable_log_requests: bool = field(default=True, metadata=_help("Do not log each request."))
    # ---- admission control and liveness (the server's; beyond vLLM, see entrypoints/openai/admission.py)
    max_waiting_requests: Optional[int] = field(default=None, metadata=_help("Requests that may wait (queued behind a full batch of --max-num-seqs, or in the engine's queue when longer; running ones never count) before new ones get 429 with Retry-After (default: 2 x max_num_seqs; -1: unbounded, as vLLM)."))
    max_queue_delay: Optional[float] = field(default=None, metadata=_help("Seconds a new request may be predicted to wait in the queue (its place over the measured drain rate) before it gets 429 with Retry-After (default: 1; 0: no bound). Keeps accepted requests' time to first token near an unloaded server's under overload."))
    # engine_stall_timeout (EngineArgs) also bounds /health: 503 after that long without progress.

    def __post_init__(self) -> None:
        super().__post_init__()
        AdmissionConfig(-1 if self.max_waiting_requests is None else self.max_waiting_requests,
                        self.engine_stall_timeout,
                        0.0 if self.max_queue_delay is None else self.max_queue_delay)  # raises ValueError naming the bad field


# ModelConfig, the sub-configs and the old name, re-exported for callers that import them here.
EngineConfig = VllmConfig
__all__ = ["AsyncEngineArgs", "CacheConfig", "EngineArgs", "EngineConfig", "ModelConfig", "ObservabilityConfig",
           "ParallelConfig", "SchedulerConfig", "UsageContext", "VllmConfig", "default_batching",
           "log_non_default_args", "parse_bytes"]
