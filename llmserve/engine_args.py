"""EngineArgs: one dataclass schema for ``LLM(**kwargs)`` and the CLI flags (vLLM's
``EngineArgs``). Flags and their help are generated from the fields, so they cannot drift.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union, get_args, get_origin

from llmserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_dtype,
)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# 4 GiB on the CPU, as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE). Pages are only resident
# once blocks are used (see ModelRunner.initialize_kv_cache).
_DEFAULT_KV_CACHE_BYTES = 4 << 30


class UsageContext(enum.Enum):
    """Who builds the engine (vLLM's ``UsageContext``); it picks the scheduling defaults
    (see ``default_batching``)."""

    ENGINE_CONTEXT = "ENGINE_CONTEXT"
    LLM_CLASS = "LLM_CLASS"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"


# (max_num_batched_tokens, max_num_seqs) by device and usage context: vLLM's defaults
# (``EngineArgs.get_batch_defaults``: CPU 4096/256 offline and 2048/128 for the server;
# GPUs with less than 70 GiB 8192/256 offline and 2048/256 for the server). Anything else
# (an engine built directly) gets vLLM's SchedulerConfig defaults, 2048 and 128.
_BATCH_DEFAULTS = {
    ("cpu", UsageContext.LLM_CLASS): (4096, 256),
    ("cpu", UsageContext.OPENAI_API_SERVER): (2048, 128),
    ("cuda", UsageContext.LLM_CLASS): (8192, 256),
    ("cuda", UsageContext.OPENAI_API_SERVER): (2048, 256),
}
_BATCH_FALLBACK = (2048, 128)


def default_batching(device: str, usage_context: "UsageContext") -> tuple[int, int]:
    """Default ``(max_num_batched_tokens, max_num_seqs)`` for ``device`` ("cpu"/"cuda")
    and ``usage_context``: the offline ``LLM`` takes larger steps (throughput), the server
    smaller ones (inter-token latency of running streams), as in vLLM."""
    return _BATCH_DEFAULTS.get((device, usage_context), _BATCH_FALLBACK)


def parse_bytes(value: Union[str, int, None]) -> Optional[int]:
    """Parse a memory size: an int (bytes) or a string like "4GiB", "512MB", "1.5G".

    Raises ValueError on an unparsable string.
    """
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"kv_cache_memory: cannot parse memory size {value!r} (e.g. 4GiB, 512MB, 1073741824)")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit else 1
    power = "KMGT".index(unit) + 1 if unit else 0
    if unit and not binary:
        base = 1000
    return int(num * (base ** power))


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class EngineArgs:
    """Arguments of the engine (vLLM's ``EngineArgs``). Every field is also a CLI flag
    (``--field-name``); ``LLM(**kwargs)`` takes every field."""

    model: str = field(default=DEFAULT_MODEL, metadata=_help("Model: HF directory, .gguf file, HF cache id or packaged model name."))
    tokenizer: Optional[str] = field(default=None, metadata=_help("Tokenizer path (defaults to the model)."))
    served_model_name: Optional[list[str]] = field(default=None, metadata=_help("Model name(s) used in the API (default: the model argument)."))
    dtype: str = field(default="auto", metadata=_help("Weights/activations dtype: auto, float32, bfloat16, float16."))
    max_model_len: Optional[int] = field(default=None, metadata=_help("Context length in tokens (default: the model's, capped at 2048 on CPU)."))
    seed: int = field(default=0, metadata=_help("Random seed for unseeded sampling."))
    block_size: int = field(default=16, metadata=_help("KV cache block size in tokens."))
    kv_cache_memory: Optional[str] = field(default=None, metadata=_help("KV cache size, e.g. 8GiB (default 4GiB on CPU; made resident while the engine is idle)."))
    num_gpu_blocks_override: Optional[int] = field(default=None, metadata=_help("Force the number of KV cache blocks (testing)."))
    enable_prefix_caching: bool = field(default=True, metadata=_help("Reuse KV blocks of shared prompt prefixes."))
    max_num_batched_tokens: Optional[int] = field(default=None, metadata=_help("Token budget per engine step (default on CPU: 4096 for the offline LLM, 2048 for the server, as vLLM)."))
    max_num_seqs: Optional[int] = field(default=None, metadata=_help("Max number of requests per engine step (default on CPU: 256 for the offline LLM, 128 for the server, as vLLM)."))
    enable_chunked_prefill: bool = field(default=True, metadata=_help("Split long prompts across steps."))
    scheduling_policy: str = field(default="fcfs", metadata=_help("fcfs or priority."))
    chat_template: Optional[str] = field(default=None, metadata=_help("Chat template (file path or literal) overriding the model's."))
    generation_config: str = field(default="auto", metadata=_help("'auto' uses the model's generation_config.json defaults; 'vllm' ignores them."))
    trust_remote_code: bool = field(default=False, metadata=_help("Unused (no remote code is run)."))
    num_threads: Optional[int] = field(default=None, metadata=_help("torch CPU threads in the engine (default: all cores)."))
    tensor_parallel_size: int = field(default=1, metadata=_help("Tensor parallel size (1 only)."))
    disable_log_stats: bool = field(default=False, metadata=_help("Do not log per-step stats."))
    enforce_eager: bool = field(default=True, metadata=_help("Accepted for vLLM compatibility."))
    device: str = field(default="auto", metadata=_help("cpu, cuda or auto."))

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]

    # ---- CLI -------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """Add one ``--flag`` per field (bools get ``--flag/--no-flag``)."""
        for f in fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            helptext = f.metadata.get("help", "")
            default = f.default if f.default is not dataclasses.MISSING else None
            tp = f.type if not isinstance(f.type, str) else eval(f.type, globals())  # noqa: S307 (our own annotations)
            origin = get_origin(tp)
            inner = [a for a in get_args(tp) if a is not type(None)]
            shown = helptext if default is None or "(default" in helptext else f"{helptext} (default: {default})"
            if tp is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=shown)
            elif origin is list or (origin is Union and inner and get_origin(inner[0]) is list):
                parser.add_argument(flag, nargs="+", default=default, help=helptext)
            else:
                base = inner[0] if origin is Union and inner else tp
                conv = base if base in (int, float) else str
                parser.add_argument(flag, type=conv, default=default, help=shown)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    # ---- config ------------------------------------------------------------
    def create_engine_config(self, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT) -> EngineConfig:
        """Resolve the model and build the EngineConfig. ``usage_context`` picks the
        defaults of max_num_batched_tokens and max_num_seqs when they are None
        (``default_batching``).

        Raises ValueError for an unknown model, a bad dtype, or a max_model_len larger
        than the model supports.
        """
        from llmserve.model_loader import load_hf_config, resolve_model

        if self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: only 1 is supported")
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = resolve_dtype(self.dtype, device)
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: unknown dtype {self.dtype!r}")
        resolved = resolve_model(self.model)
        hf_config = load_hf_config(resolved)
        derived = int(getattr(hf_config, "max_position_embeddings", 2048) or 2048)
        if self.max_model_len is None:
            max_model_len = min(derived, 2048) if device == "cpu" else derived
        else:
            if self.max_model_len > derived:
                raise ValueError(
                    f"max_model_len: {self.max_model_len} is larger than the model's maximum "
                    f"context length ({derived})")
            max_model_len = self.max_model_len
        names = tuple(self.served_model_name or [self.model])
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer or resolved.path,
            served_model_name=names,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            hf_config=hf_config,
            model_path=resolved.path,
            gguf_file=resolved.gguf_file,
            trust_remote_code=self.trust_remote_code,
            generation_config=self.generation_config,
            chat_template=self.chat_template,
            device=device,
        )
        kv_bytes = parse_bytes(self.kv_cache_memory)
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=kv_bytes if kv_bytes is not None else _DEFAULT_KV_CACHE_BYTES,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
        )
        default_mnbt, default_seqs = default_batching(device, usage_context)
        mnbt = self.max_num_batched_tokens
        if mnbt is None:
            mnbt = default_mnbt if self.enable_chunked_prefill else max(default_mnbt, max_model_len)
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else default_seqs
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=mnbt,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            observability_config=ObservabilityConfig(log_stats=not self.disable_log_stats),
            num_threads=self.num_threads,
        )


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLM (adds request logging)."""

    disable_log_requests: bool = field(default=True, metadata=_help("Do not log each request."))
