"""EngineArgs -> VllmConfig (the body of ``EngineArgs.create_engine_config()``): refuse what
this engine cannot honour yet, resolve the model offline, derive the context length, read
the generation-config defaults once, and build each sub-config."""
from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

from llmserve.config import (KV_CACHE_DTYPES, CacheConfig, CompilationMode, KVTransferConfig, ModelConfig,
                             ObservabilityConfig, ParallelConfig, RestartConfig, SchedulerConfig, VllmConfig,
                             resolve_dtype)
from llmserve.engine_defaults import DEFAULT_KV_CACHE_BYTES, UsageContext, default_batching, parse_bytes

if TYPE_CHECKING:
    from llmserve.engine_args import EngineArgs
    from llmserve.model_loader import ResolvedModel

logger = logging.getLogger(__name__)


def _is_default_worker(value: Any) -> bool:
    """"auto", or the class the engine runs anyway (ModelRunner), by name or pickled."""
    if value == "auto":
        return True
    from llmserve.worker.model_runner import ModelRunner

    try:
        return ParallelConfig(worker_cls=value).resolve_worker_cls() is ModelRunner
    except Exception:  # an unloadable class is not the default one
        return False


# field -> (accepted?, what is supported instead). Checked before anything is loaded. The
# message names the field and its value as ``field=value``: the server's CLI spells both as
# the flag typed (``--kv-cache-dtype int4``; entrypoints/openai/cli_args.flag_message).
_SUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "pipeline_parallel_size": (lambda v: v == 1, "supported: 1 (no pipeline parallelism; tensor_parallel_size "
                                                 "and data_parallel_size split the work instead)"),
    "distributed_executor_backend": (lambda v: v in (None, "uni", "mp", "ray"), "supported: None, 'uni', 'mp' or 'ray'"),
    "tokenizer_mode": (lambda v: v in ("auto", "hf"), "supported: 'auto' or 'hf' (the fast Hugging Face tokenizer)"),
    "skip_tokenizer_init": (lambda v: not v, "the engine detokenizes, so it needs the tokenizer; supported: skip_tokenizer_init=False"),
    "kv_cache_dtype": (lambda v: v in KV_CACHE_DTYPES, "supported: 'auto', 'bfloat16', 'float16' or 'float32' "
                                                       "(no fp8 or integer caches)"),
    "cpu_offload_gb": (lambda v: v == 0, "no weight offloading; supported: 0"),
    "long_prefill_token_threshold": (lambda v: v == 0, "the scheduler has no long-prefill cap; supported: 0"),
    "max_num_partial_prefills": (lambda v: v == 1, "the scheduler runs one partial prefill; supported: 1"),
    "max_long_partial_prefills": (lambda v: v == 1, "the scheduler runs one partial prefill; supported: 1"),
    "async_scheduling": (lambda v: not v, "scheduling does not overlap the forward pass; supported: async_scheduling=False"),
    "load_format": (lambda v: v in ("auto", "safetensors", "gguf"), "supported: 'auto', 'safetensors' or 'gguf'"),
    "worker_cls": (_is_default_worker, "the engine runs llmserve.worker.model_runner.ModelRunner; supported: 'auto'"),
}


def check_supported(args: "EngineArgs") -> None:
    """Raise ValueError naming the first field whose value this engine does not support,
    and the values it does."""
    for name, (ok, what) in _SUPPORTED.items():
        value = getattr(args, name)
        if not ok(value):
            shown = "<class>" if isinstance(value, bytes) else repr(value)
            raise ValueError(f"{name}={shown} is not supported by this engine: {what}.")


def _default_kv_cache_bytes(default: int) -> int:
    """$LLMSERVE_CPU_KVCACHE_SPACE (or vLLM's $VLLM_CPU_KVCACHE_SPACE) GiB, else ``default``.
    Raises ValueError naming the variable for a value that is not a positive number."""
    from llmserve import envs

    gib = envs.get("LLMSERVE_CPU_KVCACHE_SPACE")
    if gib is None or gib.strip() in ("", "0"):  # vLLM: 0 or unset means the default
        return default
    try:
        size = int(float(gib) * (1 << 30))
    except ValueError:
        size = 0
    if size <= 0:  # named as set: ours, or vLLM's twin
        var = "LLMSERVE_CPU_KVCACHE_SPACE" if "LLMSERVE_CPU_KVCACHE_SPACE" in os.environ else "VLLM_CPU_KVCACHE_SPACE"
        raise ValueError(f"{var} must be a positive number of GiB, got {gib!r}")
    return size


def _kv_cache_bytes(args: "EngineArgs") -> int:
    """The KV cache size in bytes from whichever of ``kv_cache_memory`` (a size: "8GiB"),
    ``kv_cache_memory_bytes`` (vLLM's name) or $LLMSERVE_CPU_KVCACHE_SPACE was given, else
    the default. Checked here, where the source is known: CacheConfig's own check names its
    field ``kv_cache_memory_bytes``, which the CLI spells as vLLM's flag, so ``--kv-cache-memory
    0`` was told about ``--kv-cache-memory-bytes``, a flag never typed. Raises ValueError
    naming the field given (both given, unparsable, or not positive)."""
    if args.kv_cache_memory is not None and args.kv_cache_memory_bytes is not None:
        raise ValueError("kv_cache_memory and kv_cache_memory_bytes both set; give one")
    for name in ("kv_cache_memory", "kv_cache_memory_bytes"):
        value = getattr(args, name)
        if value is None:
            continue
        try:
            size = parse_bytes(value)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if isinstance(size, bool) or size <= 0:
            raise ValueError(f"{name} must be a positive size, got {value!r}")
        return size
    return _default_kv_cache_bytes(DEFAULT_KV_CACHE_BYTES)


def _torch_is_cpu_build() -> bool:
    """True when the installed torch distribution is a CPU-only build: its version carries
    the ``+cpu`` local label of PyTorch's CPU wheels (e.g. ``2.13.0+cpu``). False when the
    label is absent (a CUDA or other build) or torch's metadata cannot be found."""
    import importlib.metadata

    try:
        return importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


def _device(device: str) -> str:
    """``device`` ("cpu", "cuda" or "auto") resolved to "cpu" or "cuda". Raises ValueError
    (naming ``device``) for any other value."""
    if device == "auto":
        # A CPU build of torch has no CUDA: answered from its version label, without the
        # import (~3 s and ~150 MiB in the API server, which never runs a model; issue 31).
        if sys.modules.get("torch") is None and _torch_is_cpu_build():
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    return device


def _check_format(args: "EngineArgs", resolved: "ResolvedModel") -> None:
    """quantization / load_format must fit the checkpoint found."""
    is_gguf = resolved.gguf_file is not None
    if args.quantization not in (None, "gguf", "compressed-tensors"):
        raise ValueError(f"quantization={args.quantization!r} is not supported by this engine: supported: None "
                         "(GGUF files and compressed-tensors int4/int8 checkpoints are found from the "
                         "checkpoint), 'gguf' or 'compressed-tensors'.")
    if args.quantization == "gguf" and not is_gguf:
        raise ValueError(f"quantization='gguf' but the model {args.model!r} is not a GGUF checkpoint")
    if (args.load_format == "gguf") != is_gguf and args.load_format != "auto":
        kind = "a GGUF file" if is_gguf else "a safetensors directory"
        raise ValueError(f"load_format={args.load_format!r} does not fit the model {args.model!r} ({kind})")


def _quantization(args: "EngineArgs", resolved: "ResolvedModel", hf_config: Any) -> Optional[str]:
    """The checkpoint's quantization method (vLLM's names): "gguf", "compressed-tensors"
    (read from ``quantization_config``) or None. Raises ValueError when ``--quantization``
    names another than the checkpoint's, or for a compressed-tensors scheme not run here."""
    from llmserve.model_loader.compressed_tensors_loader import weight_scheme

    found = "gguf" if resolved.gguf_file else ("compressed-tensors" if weight_scheme(hf_config) else None)
    if args.quantization not in (None, found):
        raise ValueError(f"quantization={args.quantization!r} but the checkpoint {args.model!r} is "
                         f"{found or 'not quantized'}")
    return found


def _max_model_len(args: "EngineArgs", hf_config: Any, device: str) -> int:
    derived = int(getattr(hf_config, "max_position_embeddings", None)
                  or getattr(hf_config, "max_target_positions", None) or 2048)  # Whisper: its decoder
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    if args.disable_sliding_window and window:  # vLLM: the context is capped at the window
        derived = min(derived, int(window))
    if args.max_model_len is None:
        return min(derived, 2048) if device == "cpu" else derived
    if args.max_model_len > derived:
        raise ValueError(f"max_model_len: {args.max_model_len} is larger than the model's maximum "
                         f"context length ({derived})")
    return args.max_model_len


def _generation_defaults(args: "EngineArgs", resolved: "ResolvedModel") -> tuple[dict, tuple[int, ...]]:
    """(default sampling params, generation-config EOS ids) per ``--generation-config``:
    "auto" reads the model's file, "vllm" takes no sampling defaults (but, as vLLM, still
    the model's EOS ids), a directory its own generation_config.json."""
    from llmserve.model_loader import diff_sampling_param, generation_eos_token_ids, read_generation_config
    from llmserve.sampling_params import SamplingParams

    mode = args.generation_config
    if mode in ("auto", "vllm"):
        eos_source = read_generation_config(resolved.path)
        source = eos_source if mode == "auto" else {}
    else:
        if not os.path.isfile(os.path.join(mode, "generation_config.json")):
            raise ValueError(f"generation_config: expected 'auto', 'vllm' or a directory holding a "
                             f"generation_config.json, got {mode!r}")
        source = eos_source = read_generation_config(mode)
    defaults = diff_sampling_param(source, args.override_generation_config)
    try:
        SamplingParams.from_optional(**defaults)
    except ValueError as e:
        raise ValueError(f"generation_config: the default sampling parameters {defaults} are invalid: {e}") from e
    if defaults:
        logger.info("Default sampling parameters from the generation config: %s "
                    "(relaunch with --generation-config vllm to ignore them)", defaults)
    eos_ids = generation_eos_token_ids(eos_source)
    if resolved.gguf_file:  # llama.cpp's end-of-turn ids (issue 30: Phi's <|end|>, Gemma's <end_of_turn>)
        from llmserve.model_loader.gguf_config import gguf_eos_token_ids
        eos_ids = tuple(sorted({*eos_ids, *gguf_eos_token_ids(resolved.model_file)}))
    return defaults, eos_ids


def _tokenizer_path(args: "EngineArgs", resolved: "ResolvedModel") -> str:
    """The model directory, or the --tokenizer given (an HF-cache id or packaged name is
    resolved here, at ``tokenizer_revision``)."""
    if args.tokenizer is None:
        return resolved.path
    if os.path.exists(args.tokenizer):
        return args.tokenizer
    from llmserve.model_loader import resolve_model

    return resolve_model(args.tokenizer, args.tokenizer_revision).model_file


def _model_config(args: "EngineArgs", device: str) -> ModelConfig:
    from llmserve.model_loader import load_hf_config, resolve_model

    dtype = resolve_dtype(args.dtype, device)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={args.dtype!r} is not a dtype this engine runs: supported: 'auto', 'float32', "
                         "'bfloat16', 'float16' (or 'half', 'float')")
    resolved = resolve_model(args.model, args.revision)
    _check_format(args, resolved)
    hf_config = load_hf_config(resolved)
    quantization = _quantization(args, resolved, hf_config)
    defaults, eos_ids = _generation_defaults(args, resolved)
    from llmserve.pooler_config import load_pooler_config, resolve_runner

    runner = resolve_runner(args.runner, args.convert, hf_config)
    pooler = load_pooler_config(resolved.path, hf_config, args.convert) if runner == "pooling" else None
    return ModelConfig(
        model=args.model, tokenizer=_tokenizer_path(args, resolved),
        served_model_name=tuple(args.served_model_name or [args.model]), dtype=dtype,
        max_model_len=_max_model_len(args, hf_config, device), seed=args.seed, hf_config=hf_config,
        model_path=resolved.path, gguf_file=resolved.gguf_file, trust_remote_code=args.trust_remote_code,
        generation_config=args.generation_config, chat_template=args.chat_template, device=device,
        revision=args.revision, tokenizer_revision=args.tokenizer_revision, tokenizer_mode=args.tokenizer_mode,
        quantization=quantization,
        enforce_eager=args.enforce_eager, max_logprobs=args.max_logprobs, batch_invariant=args.batch_invariant,
        enable_sleep_mode=args.enable_sleep_mode, sleep_idle_seconds=args.sleep_idle_seconds,
        disable_sliding_window=args.disable_sliding_window,
        override_generation_config=dict(args.override_generation_config),
        renderer_num_workers=args.renderer_num_workers, diff_sampling_param=defaults,
        extra_eos_token_ids=eos_ids, runner=runner, convert=args.convert, pooler_config=pooler,
        packed_float32=args.dtype == "auto" and dtype == "float32" and device == "cpu")


def _cache_config(args: "EngineArgs", encoder_decoder: bool = False) -> CacheConfig:
    return CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=_kv_cache_bytes(args),
                       # An encoder-decoder's decoder KV depends on the audio, not only on the
                       # tokens, so prefix blocks cannot be shared (vLLM turns it off too).
                       enable_prefix_caching=args.enable_prefix_caching and not encoder_decoder,
                       num_gpu_blocks_override=args.num_gpu_blocks_override, cache_dtype=args.kv_cache_dtype,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       kv_sharing_fast_prefill=args.kv_sharing_fast_prefill)


def _scheduler_config(args: "EngineArgs", device: str, usage_context: "UsageContext",
                      max_model_len: int, pooling: bool = False) -> SchedulerConfig:
    default_mnbt, default_seqs = default_batching(device, usage_context)
    mnbt = args.max_num_batched_tokens
    if mnbt is None and pooling:
        # The server's smaller step protects running streams' inter-token latency; a pooling
        # model has no streams, and 32 one-sentence requests (~2,700 tokens at 8-128 words)
        # split over two steps cost more CPU per sentence than one step (see the pooling
        # gather in engine/core.py): pooling takes the offline budget on the server too.
        mnbt = max(default_batching(device, UsageContext.LLM_CLASS)[0], max_model_len)
    elif mnbt is None:
        mnbt = default_mnbt if args.enable_chunked_prefill and not pooling else max(default_mnbt, max_model_len)
    elif pooling and mnbt < max_model_len:
        # A pooling prompt runs whole in one step (vLLM's rule for pooling models).
        raise ValueError(f"max_num_batched_tokens ({mnbt}) must be >= max_model_len ({max_model_len}) "
                         "for a pooling model: each prompt runs whole in one step.")
    return SchedulerConfig(
        max_num_batched_tokens=mnbt,
        max_num_seqs=args.max_num_seqs if args.max_num_seqs is not None else default_seqs,
        max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
        policy=args.scheduling_policy, long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
        tenant_fair_share=args.tenant_fair_share)


def build_vllm_config(args: "EngineArgs", usage_context: "UsageContext") -> VllmConfig:
    """See ``EngineArgs.create_engine_config``."""
    check_supported(args)
    parallel_config = _parallel_config(args)
    if args.kv_events_config is not None and args.kv_events_config.publishes:  # ports per DP rank
        from llmserve.distributed.kv_events import check_rank_endpoints

        check_rank_endpoints(args.kv_events_config.endpoint, args.kv_events_config.replay_endpoint,
                             parallel_config.data_parallel_size)
    device = _device(args.device)
    model_config = _model_config(args, device)
    if args.tensor_parallel_size > 1:
        from llmserve.models.tensor_parallel import check_tp_size

        check_tp_size(model_config.hf_config, args.tensor_parallel_size)
    mode = args.compilation_config.mode
    if mode not in (None, CompilationMode.NONE):
        logger.warning("compilation_config mode %s: this engine runs eagerly, so it runs as mode 0 "
                       "(NONE), as vLLM does under enforce_eager", int(mode))
    return VllmConfig(
        model_config=model_config, cache_config=_cache_config(args, model_config.is_encoder_decoder),
        scheduler_config=_scheduler_config(args, device, usage_context, model_config.max_model_len,
                                           model_config.runner == "pooling"),
        parallel_config=parallel_config,
        observability_config=_observability_config(args),
        compilation_config=args.compilation_config, kv_transfer_config=_kv_transfer_config(args, model_config),
        structured_outputs_config=args.structured_outputs_config,
        num_threads=args.num_threads, enforce_eager=args.enforce_eager, shutdown_timeout=args.shutdown_timeout,
        restart_config=_restart_config(args, usage_context), lora_config=_lora_config(args, model_config),
        speculative_config=args.speculative_config, kv_events_config=args.kv_events_config)


def _kv_transfer_config(args: "EngineArgs", model_config: ModelConfig) -> Optional[KVTransferConfig]:
    """``kv_transfer_config``, or vLLM's ``--kv-offloading-size`` / ``--kv-offloading-backend
    native`` form of it (an ``OffloadingConnector``). Raises ValueError naming the field: an
    unknown connector (listing the known ones), both forms at once, or an engine the disk
    tier cannot serve (no prefix caching, tensor parallel, pooling or encoder models)."""
    ktc = args.kv_transfer_config
    if args.kv_offloading_size is not None:
        if args.kv_offloading_backend != "native":
            raise ValueError(f"kv_offloading_backend={args.kv_offloading_backend!r} is not supported by this "
                             "engine: supported: 'native'")
        if ktc is not None and ktc.kv_connector is not None:
            raise ValueError("kv_offloading_size and kv_transfer_config.kv_connector cannot both be set")
        ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                               kv_connector_extra_config={"kv_offloading_size": args.kv_offloading_size})
    if ktc is None or ktc.kv_connector is None:
        return ktc
    from llmserve.kv_transfer import KVConnectorFactory

    KVConnectorFactory.get_connector_class(ktc).check_config(ktc)
    why = ("prefix caching off (--no-enable-prefix-caching, enable_prefix_caching=False): "
           "the KV tier extends the prefix cache"
           if not args.enable_prefix_caching
           else "tensor_parallel_size > 1" if args.tensor_parallel_size > 1
           else "a pooling model" if model_config.runner == "pooling"
           else "an encoder model" if model_config.is_encoder_only or model_config.is_encoder_decoder else None)
    if why:
        raise ValueError(f"kv_transfer_config: the {ktc.kv_connector} connector cannot run with {why}")
    return ktc


def _lora_config(args: "EngineArgs", model_config: ModelConfig) -> Optional["LoRAConfig"]:
    """LoRAConfig when ``enable_lora`` (ValueError naming the field otherwise bad)."""
    from llmserve.lora.config import LoRAConfig

    if not args.enable_lora:
        return None
    if model_config.enable_sleep_mode or model_config.sleep_idle_seconds:
        flag = "enable_sleep_mode" if model_config.enable_sleep_mode else "sleep_idle_seconds"
        raise ValueError(f"enable_lora: LoRA adapters cannot be used with {flag} (a sleeping engine would "
                         "lose its loaded adapters); start without one of them")
    model_type = getattr(model_config.hf_config, "model_type", None)
    if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"enable_lora: LoRA adapters run on the Llama family (Llama, Mistral, Qwen2, Qwen3), "
                         f"not {model_type!r}")
    return LoRAConfig(max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
                      max_cpu_loras=args.max_cpu_loras, lora_dtype=args.lora_dtype)


def _observability_config(args: "EngineArgs") -> ObservabilityConfig:
    """Stats, timelines and traces; ``collect_detailed_traces`` is vLLM's comma list."""
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    if endpoint:
        from llmserve.tracing import check_otel_installed

        check_otel_installed(endpoint)  # a clear error before any engine starts
    detailed = getattr(args, "collect_detailed_traces", None) or ()
    detailed = [m.strip() for item in ([detailed] if isinstance(detailed, str) else detailed)
                for m in item.split(",") if m.strip()]
    return ObservabilityConfig(log_stats=not args.disable_log_stats,
                               request_timelines=getattr(args, "request_timelines", True),
                               max_finished_request_timelines=getattr(args, "max_finished_request_timelines", 1000),
                               otlp_traces_endpoint=endpoint,
                               collect_detailed_traces=tuple(detailed) if detailed else None)


def _parallel_config(args: "EngineArgs") -> ParallelConfig:
    """ParallelConfig, with vLLM's data-parallel rules: a ``data_parallel_rank`` means
    external load balancing, whose rank defaults to ``data_parallel_start_rank``; internal
    load balancing runs every rank here (``data_parallel_size_local`` = size)."""
    dp = args.data_parallel_size
    external = args.data_parallel_external_lb or args.data_parallel_rank is not None
    local = args.data_parallel_size_local
    if args.data_parallel_start_rank < 0:
        raise ValueError(f"data_parallel_start_rank must be >= 0, got {args.data_parallel_start_rank}")
    if external and getattr(args, "data_parallel_hybrid_lb", False):
        raise ValueError("--data-parallel-hybrid-lb and --data-parallel-external-lb (or --data-parallel-rank) "
                         "exclude each other")
    if getattr(args, "data_parallel_backend", "mp") not in ("mp", "ray"):
        raise ValueError(f"--data-parallel-backend must be 'mp' or 'ray', got {args.data_parallel_backend!r}")
    if external and getattr(args, "data_parallel_backend", "mp") == "ray":
        raise ValueError("--data-parallel-backend ray places every rank from one API server; with "
                         "--data-parallel-external-lb (or --data-parallel-rank) each server runs its own rank: use mp")
    if external:
        # the rank's source is named: the start rank is the rank when none is given
        name = "data_parallel_rank" if args.data_parallel_rank is not None else "data_parallel_start_rank"
        rank = getattr(args, name)
        if not 0 <= rank < dp:
            raise ValueError(f"{name} must be in [0, data_parallel_size={dp}), got {rank}")
    else:
        rank = None
        from llmserve.engine.multinode import check_multinode_args
        check_multinode_args(args)
    return ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=dp, distributed_executor_backend=args.distributed_executor_backend,
        worker_cls=args.worker_cls, data_parallel_external_lb=external, data_parallel_rank=rank,
        data_parallel_size_local=local if local is not None else dp,
        data_parallel_start_rank=args.data_parallel_start_rank, data_parallel_address=args.data_parallel_address,
        data_parallel_rpc_port=args.data_parallel_rpc_port,
        data_parallel_hybrid_lb=getattr(args, "data_parallel_hybrid_lb", False),
        data_parallel_backend=getattr(args, "data_parallel_backend", "mp"))


def _restart_config(args: "EngineArgs", usage_context: "UsageContext") -> RestartConfig:
    """--restart-engine-on-failure defaults to on for the server, off offline."""
    enabled = args.restart_engine_on_failure
    if enabled is None:
        # Off with data parallel: a dead rank fails the DP group and the server reports
        # unhealthy, as vLLM (restarting one rank under a balancing client is not done).
        enabled = getattr(usage_context, "name", None) == "OPENAI_API_SERVER" and args.data_parallel_size == 1
    elif enabled and args.data_parallel_size > 1:
        raise ValueError("restart_engine_on_failure is not supported with data_parallel_size > 1 "
                         "(a dead rank fails the DP group, as vLLM); leave it unset")
    return RestartConfig(enabled=enabled, stall_timeout=args.engine_stall_timeout,
                         max_restarts=args.max_engine_restarts, window=args.engine_restart_window)
