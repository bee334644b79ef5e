"""Engine configuration (vLLM's ``VllmConfig`` and its parts: ``ModelConfig``,
``CacheConfig``, ``SchedulerConfig``, ``ParallelConfig``, ``CompilationConfig``,
``KVTransferConfig``, ``KVEventsConfig``...).

Each config is a frozen dataclass validated in ``__post_init__`` (ValueError naming the
field). Nothing changes a config once built; computed values (the number of KV blocks)
are returned by the code that computes them, not written back. Values derived from the
model's files (the generation-config defaults) are computed once by
``EngineArgs.create_engine_config()`` and passed in.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from llmserve.lora.config import LoRAConfig
from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.structured_output.config import StructuredOutputsConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")


def cpu_has_bf16() -> bool:
    """True when the CPU has native bfloat16 dot products (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> str:
    """Map the user's dtype string to a torch dtype name ("float32", "bfloat16", "float16").

    "auto": bfloat16 on CPUs with AVX512-BF16/AMX, else float32; bfloat16 on CUDA.
    """
    dtype = {"half": "float16", "float": "float32"}.get(dtype, dtype)
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_has_bf16() else "float32"


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")



@dataclass(frozen=True)
class ModelConfig:
    """What model to run and how.

    model: a HF directory, a .gguf file, a local HF-cache id, or a packaged model name.
    dtype: resolved torch dtype name. max_model_len: context limit in tokens (prompt +
    output). hf_config: the transformers config (architectures, sizes).
    generation_config: "auto" (the model's generation_config.json), "vllm" (none of its
    sampling defaults) or a directory holding a generation_config.json.
    override_generation_config: merged over those defaults.
    diff_sampling_param: the resulting default sampling parameters under SamplingParams
    names (computed once at ``create_engine_config()``; read it with
    ``get_diff_sampling_param()``). extra_eos_token_ids: EOS ids of the generation config
    other than the tokenizer's, which also end generation.
    max_logprobs: the most logprobs a request may ask for per position (-1: no limit).
    batch_invariant: pad every step's GEMMs so logits do not depend on the batch
    (``llmserve.ops.batch_invariant``); False pads only steps holding a seeded request.
    renderer_num_workers: threads that render chat templates on the async server path.
    enable_sleep_mode: allow sleep / wake_up (vLLM's). sleep_idle_seconds: sleep after this
    many idle seconds (llama.cpp's --sleep-idle-seconds; None: never).
    packed_float32: quantized weights (GGUF blocks, int4/int8 checkpoints) run on the packed
    int8-activation kernels although ``dtype`` is float32: dtype "auto" on a CPU without
    bfloat16 dot products (AVX2, or AVX512 without BF16), where the dense float32 GEMMs on
    dequantized weights hold the model at 4 bytes a weight (a Q4_K_M file ~5x over) and
    read that much at each decode step. An explicit ``--dtype float32`` keeps the exact
    dense path (the reference for comparisons with transformers).
    """

    model: str
    tokenizer: str
    served_model_name: tuple[str, ...]
    dtype: str
    max_model_len: int
    seed: int
    hf_config: Any
    model_path: str  # resolved local path (dir or .gguf file)
    gguf_file: Optional[str] = None
    trust_remote_code: bool = False
    generation_config: str = "auto"
    chat_template: Optional[str] = None
    runner: str = "generate"
    convert: str = "auto"
    pooler_config: Any = None  # llmserve.pooler_config.PoolerConfig for runner="pooling"
    device: str = "cpu"
    revision: Optional[str] = None
    tokenizer_revision: Optional[str] = None
    tokenizer_mode: str = "auto"
    quantization: Optional[str] = None
    enforce_eager: bool = True
    max_logprobs: int = 20
    batch_invariant: bool = False
    disable_sliding_window: bool = False
    override_generation_config: dict = field(default_factory=dict)
    renderer_num_workers: int = 1
    diff_sampling_param: dict = field(default_factory=dict)
    extra_eos_token_ids: tuple[int, ...] = ()
    enable_sleep_mode: bool = False
    sleep_idle_seconds: Optional[float] = None
    packed_float32: bool = False

    def __post_init__(self) -> None:
        if self.sleep_idle_seconds is not None and not self.sleep_idle_seconds > 0:
            raise ValueError(f"sleep_idle_seconds must be > 0 seconds (or None: never), got {self.sleep_idle_seconds!r}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0, got {self.max_logprobs!r}")
        _positive("renderer_num_workers", self.renderer_num_workers)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The model's default sampling parameters (vLLM's ``get_diff_sampling_param``):
        any of temperature, top_p, top_k, min_p, repetition_penalty and max_tokens (from
        ``max_new_tokens``) that the generation config sets, with
        ``override_generation_config`` applied; ``{}`` with ``generation_config="vllm"`` and
        no overrides. A new dict on each call."""
        return dict(self.diff_sampling_param)

    @property
    def is_encoder_only(self) -> bool:
        """An encoder (BERT): bidirectional attention over the whole prompt, no KV kept."""
        from llmserve.pooler_config import is_encoder_only

        return is_encoder_only(self.hf_config)

    @property
    def is_encoder_decoder(self) -> bool:
        """An encoder-decoder (Whisper): the encoder runs once per request on its encoder
        input (audio features), the decoder generates with the paged KV cache."""
        return bool(getattr(self.hf_config, "is_encoder_decoder", False))

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """What the engine can do with this model (vLLM's ``supported_tasks``):
        ("generate",), ("generate", "transcription") for Whisper, the pooling tasks
        ("encode", "embed"), or for a classification head ("classify", "token_classify")
        plus "score" (cross-encoder pairs) when it has one label, as vLLM."""
        if self.runner != "generate":
            pc = self.pooler_config
            if pc is not None and pc.task == "classify":
                return ("classify", "token_classify") + (("score",) if pc.num_labels == 1 else ())
            return ("encode", "embed")
        return ("generate", "transcription") if self.is_encoder_decoder else ("generate",)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        # Encoder-decoder (Whisper): the KV cache is the decoder's.
        return int(getattr(self.hf_config, "decoder_layers", None) or self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        if self.is_encoder_decoder:
            return int(c.decoder_attention_heads)
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        hd = getattr(c, "head_dim", None)
        if self.is_encoder_decoder:
            return int(c.d_model // c.decoder_attention_heads)
        return int(hd) if hd else int(c.hidden_size // c.num_attention_heads)


# --kv-cache-dtype values (vLLM's names, and float32; vLLM's fp8 variants are refused).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block_size in tokens, kv_cache_memory_bytes (None = default),
    prefix caching on/off. cache_dtype: the KV cache's dtype (vLLM's ``--kv-cache-dtype``):
    "auto", the model's or a 16-bit one under a float32 model (``kv_dtype``).
    gpu_memory_utilization: kept for vLLM compatibility; the cache is sized by
    kv_cache_memory_bytes (as vLLM's CPU backend, which ignores it).
    kv_sharing_fast_prefill: vLLM's flag for models whose layers share KV; none of ours
    do, so it only forbids prompt_logprobs, as in vLLM."""

    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: Optional[int] = None
    cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_sharing_fast_prefill: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.cache_dtype!r} is not supported by this engine: supported: "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))} (no fp8 or integer caches)")

    def kv_dtype(self, model_config: Any) -> str:
        """The KV cache's dtype name ("float32", "bfloat16", "float16") for a model
        (``ModelConfig``: its ``dtype``, ``packed_float32``, ``quantization``).

        "auto": the model's dtype, except quantized weights on the packed kernels under
        float32 activations (``packed_float32``: dtype auto on a CPU without bfloat16),
        whose cache is float16 as llama.cpp's default cache (vLLM's CPU runs are bfloat16,
        cache included): half the bytes a token holds and attention reads, perplexity
        unchanged (SmolLM2 Q4_K_M on GPL-3, 512-token chunks: 19.04 float32, 19.00
        float16). An explicit dtype: the model's, or a narrower one under float32 (the
        kernels widen float16/bfloat16 K/V to float32 exactly; a bfloat16 model's K/V are
        not re-rounded). Raises ValueError naming kv_cache_dtype otherwise."""
        model_dtype = model_config.dtype
        if self.cache_dtype == "auto":
            packed = getattr(model_config, "packed_float32", False) and getattr(model_config, "quantization", None)
            return "float16" if packed else model_dtype
        if self.cache_dtype == model_dtype:
            return model_dtype
        if model_dtype != "float32":
            raise ValueError(f"kv_cache_dtype={self.cache_dtype!r} needs a float32 model (dtype={model_dtype!r}); "
                             f"supported with it: 'auto' or {model_dtype!r}")
        return self.cache_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: max_num_batched_tokens (tokens per step), max_num_seqs
    (requests per step), chunked prefill, policy ("fcfs" or "priority").
    max_num_encoder_input_tokens: encoder positions (Whisper: 1500 per audio) whose
    encoder may run in one step (vLLM's encoder compute budget); a request whose encoder
    alone exceeds it still runs, alone."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    max_num_encoder_input_tokens: int = 3000
    tenant_fair_share: bool = True  # weighted fair queueing between tenants (core/fair_share.py)

    def __post_init__(self) -> None:
        _positive("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        _positive("max_num_partial_prefills", self.max_num_partial_prefills)
        _positive("max_long_partial_prefills", self.max_long_partial_prefills)


_EXECUTOR_BACKENDS = (None, "uni", "mp", "ray", "external_launcher")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split and replicated (vLLM's ``ParallelConfig``).

    worker_cls: "auto", a qualified class name, or a cloudpickled class (bytes), as vLLM;
    ``resolve_worker_cls()`` turns it into the class. distributed_executor_backend: None,
    "uni", "mp", "ray" or "external_launcher".
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None
    worker_cls: Union[str, bytes] = "auto"
    # External load balancing: this front end owns rank data_parallel_rank only.
    data_parallel_external_lb: bool = False
    data_parallel_rank: Optional[int] = None
    data_parallel_size_local: Optional[int] = None  # ranks on this host (they share its cores)
    # Multi-node internal load balancing (vLLM's head / --headless nodes): ranks
    # data_parallel_size_local.. join the head over TCP at address:rpc_port (engine/multinode.py).
    data_parallel_start_rank: int = 0
    data_parallel_address: Optional[str] = None
    data_parallel_rpc_port: Optional[int] = None
    # Hybrid LB: this front end balances ranks data_parallel_start_rank.. +size_local only.
    data_parallel_hybrid_lb: bool = False
    data_parallel_backend: str = "mp"  # "ray": ranks are Ray actors (engine/ray_dp.py)

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)
        if self.data_parallel_size_local is not None:
            _positive("data_parallel_size_local", self.data_parallel_size_local)
        if self.data_parallel_rank is not None and not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size={self.data_parallel_size}), "
                             f"got {self.data_parallel_rank}")
        if self.data_parallel_external_lb and self.data_parallel_rank is None:
            raise ValueError("data_parallel_external_lb needs data_parallel_rank (the rank this server owns)")
        if self.data_parallel_hybrid_lb and self.data_parallel_external_lb:
            raise ValueError("data_parallel_hybrid_lb and data_parallel_external_lb exclude each other")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend must be 'mp' or 'ray', got {self.data_parallel_backend!r}")
        if self.distributed_executor_backend not in _EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {list(_EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")

    @property
    def world_size(self) -> int:
        """Workers of one engine: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def resolve_worker_cls(self) -> Optional[type]:
        """The worker class: None for "auto", else the unpickled or imported class.
        Raises ValueError when a qualified name cannot be imported."""
        if self.worker_cls == "auto":
            return None
        if isinstance(self.worker_cls, bytes):
            import cloudpickle

            return cloudpickle.loads(self.worker_cls)
        import importlib

        module, _, name = self.worker_cls.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"worker_cls: cannot import {self.worker_cls!r}: {e}") from e


class CompilationMode(enum.IntEnum):
    """vLLM's compilation modes (``-O`` levels)."""

    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


@dataclass(frozen=True)
class CompilationConfig:
    """vLLM's ``CompilationConfig`` (the fields a user sets). The engine runs eagerly
    (``enforce_eager``), so ``effective_mode`` is NONE whatever ``mode`` asks for, as vLLM
    does under enforce_eager; EngineArgs logs that once."""

    mode: Optional[CompilationMode] = None
    backend: str = ""
    cudagraph_capture_sizes: Optional[list[int]] = None
    cudagraph_mode: Optional[str] = None

    def __post_init__(self) -> None:
        if self.mode is not None:
            try:
                object.__setattr__(self, "mode", CompilationMode(self.mode))
            except ValueError:
                raise ValueError(f"compilation_config: mode must be one of "
                                 f"{[m.value for m in CompilationMode]}, got {self.mode!r}") from None

    @property
    def effective_mode(self) -> CompilationMode:
        return CompilationMode.NONE


_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's ``KVTransferConfig``: which connector moves KV between this engine and an
    external store or instance (llmserve/kv_transfer: SharedStorageConnector,
    OffloadingConnector, or a registered third-party one), this instance's role and the
    connector's extra config. Validated as vLLM does."""

    kv_connector: Optional[str] = None
    engine_id: Optional[str] = None
    kv_buffer_device: str = "cuda"
    kv_buffer_size: float = 1e9
    kv_role: Optional[str] = None
    kv_rank: Optional[int] = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_connector_module_path: Optional[str] = None
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if self.kv_role is not None and self.kv_role not in _KV_ROLES:
            raise ValueError(f"kv_role must be one of {list(_KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError("kv_role must be set when kv_connector is set "
                             f"(one of {list(_KV_ROLES)})")
        if not isinstance(self.kv_parallel_size, int) or self.kv_parallel_size < 1:
            raise ValueError(f"kv_parallel_size must be an integer >= 1, got {self.kv_parallel_size!r}")
        if not 0 <= int(self.kv_port) <= 65535:
            raise ValueError(f"kv_port must be in [0, 65535], got {self.kv_port}")

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in _KV_ROLES


_KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (``--kv-events-config``): publish the prefix cache's
    block events (BlockStored / BlockRemoved / AllBlocksCleared) in vLLM's wire format,
    for KV-aware routers (llmserve/distributed/kv_events.py).

    enable_kv_cache_events: make the events at all. publisher: "zmq" (a ZMQ PUB socket)
    or "null" (nothing made or sent); None: "zmq" when events are enabled, else "null" (as
    vLLM). endpoint: where the PUB socket binds (a ``*`` or ``::`` host) or connects;
    replay_endpoint: a ROUTER socket answering a start sequence number with the buffered
    batches (None: no replay). With data parallel, rank r uses both endpoints with the
    TCP port + r (vLLM's offset). buffer_steps: batches kept for replay; hwm: the PUB
    socket's send high-water mark (messages); max_queue_size: batches waiting for the
    sending thread before the engine step blocks; topic: the first frame of each message.
    event_layout (llmserve's, not vLLM's): "map" (default) encodes each event as a map
    tagged ``"type"`` with the fields newer vLLM adds (``lora_name``, ``group_idx``): what
    current vLLM sends (its ``KVCacheEvent`` is no longer ``array_like``) and the only
    layout vllm-router's kv_aware policy decodes; "array" as a msgpack array, for
    subscribers written against older vLLM (``array_like`` events). Raises ValueError
    naming the field."""

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_layout: str = "map"

    def __post_init__(self) -> None:
        if self.event_layout not in ("array", "map"):
            raise ValueError(f"kv_events_config.event_layout must be 'array' or 'map', got {self.event_layout!r}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be a bool, got "
                             f"{self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in _KV_EVENT_PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {list(_KV_EVENT_PUBLISHERS)}, "
                             f"got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "://" not in value):
                raise ValueError(f"kv_events_config.{name} must be a ZMQ endpoint like 'tcp://*:5557', "
                                 f"got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        """True when events are made and sent somewhere (enabled, publisher not null)."""
        return self.enable_kv_cache_events and self.publisher != "null"


DETAILED_TRACE_MODULES = ("model", "worker", "all")


@dataclass(frozen=True)
class ObservabilityConfig:
    """Stats, request timelines and traces (vLLM's ``ObservabilityConfig``).

    request_timelines: keep each request's timeline for ``GET /v1/requests`` (needs
    log_stats; engine/request_timeline.py); max_finished_request_timelines: finished
    requests kept (a ring, oldest dropped). otlp_traces_endpoint: OTLP endpoint that
    gets one span per request (llmserve/tracing.py); collect_detailed_traces: modules
    ("model", "worker", "all") whose timings the spans also carry (vLLM's flag)."""

    log_stats: bool = True
    log_requests: bool = False
    request_timelines: bool = True
    max_finished_request_timelines: int = 1000
    otlp_traces_endpoint: Optional[str] = None
    collect_detailed_traces: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        if self.max_finished_request_timelines < 1:
            raise ValueError("max_finished_request_timelines must be >= 1, got "
                             f"{self.max_finished_request_timelines}")
        bad = [m for m in self.collect_detailed_traces or () if m not in DETAILED_TRACE_MODULES]
        if bad:
            raise ValueError(f"collect_detailed_traces: unknown module(s) {bad}; choose from {DETAILED_TRACE_MODULES}")
        if self.collect_detailed_traces and not self.otlp_traces_endpoint:
            raise ValueError("collect_detailed_traces is only used with otlp_traces_endpoint, which is not set")

    @property
    def collect_model_forward_time(self) -> bool:
        return bool({"model", "all"} & set(self.collect_detailed_traces or ()))

    @property
    def collect_model_execute_time(self) -> bool:
        return bool({"worker", "all"} & set(self.collect_detailed_traces or ()))


@dataclass(frozen=True)
class RestartConfig:
    """Self-healing of the engine process (beyond vLLM; issue 17 point 5).

    enabled: restart a dead or stalled EngineCore in place and resume the requests in
    flight (``--restart-engine-on-failure``). stall_timeout: seconds without any engine
    output while requests are in flight after which the engine is deemed stalled and
    killed (0: never). max_restarts: restarts allowed within ``window`` seconds; one more
    failure and the engine is given up as dead (the server exits non-zero). backoff: the
    delay before the second restart within the window, doubled for each later one (the
    first restart is immediate), capped at ``max_backoff`` seconds."""

    enabled: bool = False
    stall_timeout: float = 60.0
    max_restarts: int = 5
    window: float = 300.0
    backoff: float = 1.0
    max_backoff: float = 30.0

    def __post_init__(self) -> None:
        if self.stall_timeout < 0:
            raise ValueError(f"engine_stall_timeout must be >= 0 seconds, got {self.stall_timeout}")
        if self.max_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {self.max_restarts}")
        if self.window <= 0:
            raise ValueError(f"engine_restart_window must be > 0 seconds, got {self.window}")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("the engine restart backoff must be >= 0 seconds")


@dataclass(frozen=True)
class VllmConfig:
    """Everything the engine needs (vLLM's ``VllmConfig``); built by
    ``EngineArgs.create_engine_config()``. shutdown_timeout: seconds the server lets
    in-flight requests finish when it shuts down (``--shutdown-timeout``)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    kv_transfer_config: Optional[KVTransferConfig] = None
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    num_threads: Optional[int] = None
    enforce_eager: bool = True
    shutdown_timeout: float = 0.0
    restart_config: RestartConfig = field(default_factory=RestartConfig)
    lora_config: Optional[LoRAConfig] = None  # set by enable_lora (llmserve/lora)
    speculative_config: Optional[SpeculativeConfig] = None  # n-gram drafts (llmserve/spec_decode)
    kv_events_config: Optional[KVEventsConfig] = None  # --kv-events-config (distributed/kv_events.py)

    def __post_init__(self) -> None:
        self.cache_config.kv_dtype(self.model_config)  # a cache dtype the model can use


# The first name of the config; kept so existing imports keep working.
EngineConfig = VllmConfig


@dataclass(frozen=True)
class AdmissionConfig:
    """Limits of the OpenAI server's admission controller (beyond vLLM).

    max_waiting_requests: requests that may wait (admitted, queued behind a full batch of
      ``max_num_seqs`` or in the engine's own queue; running requests never count);
      -1: no bound (vLLM's behaviour); 0: none may wait (a request is admitted only into
      a free batch slot with nobody queued ahead of it). The server's default
      (``--max-waiting-requests`` unset) is twice ``max_num_seqs``: a full batch ready to
      replace the running one and one more behind it keeps the engine busy, while a
      request's wait stays near two request lifetimes instead of growing without limit.
    engine_stall_timeout: seconds without engine progress, while requests are in flight,
      after which ``/health`` answers 503 (0: never).
    max_queue_delay: seconds a new request that would wait for a batch slot (the admitted
      requests fill ``max_num_seqs``) may be predicted to wait before the engine starts it
      (its place in the queue over the drain rate: ``max_num_seqs`` over the time finished
      requests spent in the batch); past it, 429 ``queue_delay`` (0: no such bound).
      Applies only while ``max_waiting_requests`` is a bound (not -1) and once a request
      has finished: before that (a cold start) nothing predicts the wait, and
      ``max_waiting_requests`` alone bounds the queue, as configured from the first
      request (refusing every request that would wait left a cold burst only the free
      batch slots). The
      server's default (``--max-queue-delay`` unset) is 1 s, about one time-to-first-token
      of an unloaded CPU server: an accepted request then waits at most about as long as
      its prefill, so under overload its TTFT stays within ~2x of an unloaded server's,
      where a count bound alone let it wait a whole request lifetime (issue 17).
    Built by the server from ``--max-waiting-requests`` / ``--engine-stall-timeout``
    (``entrypoints/openai/admission.py``). Raises ValueError naming the field.
    """

    max_waiting_requests: int = -1
    engine_stall_timeout: float = 0.0
    max_queue_delay: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_waiting_requests, int) or self.max_waiting_requests < -1:
            raise ValueError(f"max_waiting_requests must be an integer >= -1 (-1: unbounded), "
                             f"got {self.max_waiting_requests!r}")
        if not (self.engine_stall_timeout >= 0 and math.isfinite(self.engine_stall_timeout)):
            raise ValueError(f"engine_stall_timeout must be a finite number of seconds >= 0, "
                             f"got {self.engine_stall_timeout!r}")
        if not (self.max_queue_delay >= 0 and math.isfinite(self.max_queue_delay)):
            raise ValueError(f"max_queue_delay must be a finite number of seconds >= 0, got {self.max_queue_delay!r}")
