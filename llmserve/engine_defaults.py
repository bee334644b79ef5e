"""Defaults that depend on who builds the engine and where it runs: vLLM's
``UsageContext``, the batching defaults it picks, the default KV cache size, and the
memory-size parser of ``--kv-cache-memory``. Both ``EngineArgs`` (``engine_args.py``,
which re-exports these names) and the config builder (``engine_config_builder.py``) read
them, so neither imports the other's module for them.
"""
from __future__ import annotations

import enum
import re
from typing import Optional, Union

# 4 GiB on the CPU, as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE). Pages are only resident
# once blocks are used (see ModelRunner.initialize_kv_cache).
DEFAULT_KV_CACHE_BYTES = 4 << 30


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

    Raises ValueError on an unparsable string; the message names no field (several flags
    take sizes: each caller prefixes its own, e.g. ``kv_cache_memory: ...``).
    """
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse memory size {value!r} (e.g. 4GiB, 512MB, 1073741824)")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit else 1
    power = "KMGT".index(unit) + 1 if unit else 0
    if unit and not binary:
        base = 1000
    return int(num * (base ** power))
