"""Engine configuration (vLLM's ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``...).

Each config is a frozen dataclass validated in ``__post_init__`` (ValueError naming the
field). Nothing changes a config once built; computed values (the number of KV blocks)
are returned by the code that computes them, not written back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

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


@dataclass(frozen=True)
class ModelConfig:
    """What model to run and how.

    model: a HF directory, a .gguf file, a local HF-cache id, or a packaged model name.
    dtype: resolved torch dtype name. max_model_len: context limit in tokens (prompt +
    output). hf_config: the transformers config (architectures, sizes).
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
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        hd = getattr(c, "head_dim", None)
        return int(hd) if hd else int(c.hidden_size // c.num_attention_heads)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block_size in tokens, kv_cache_memory_bytes (None = default),
    prefix caching on/off."""

    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: Optional[int] = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: max_num_batched_tokens (tokens per step), max_num_seqs
    (requests per step), chunked prefill, policy ("fcfs" or "priority")."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1


@dataclass(frozen=True)
class ObservabilityConfig:
    log_stats: bool = True
    log_requests: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; built by ``EngineArgs.create_engine_config()``."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    num_threads: Optional[int] = None
    enforce_eager: bool = True
