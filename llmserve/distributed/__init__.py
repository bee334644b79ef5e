"""Tensor-parallel plumbing (vLLM's ``vllm.distributed``): the process group of one
engine's workers and the collectives the sharded layers call. ``TPGroup`` and
``init_tp_group`` load on first use: the API server imports ``distributed.kv_events``
(``GET /kv_event_sources``) and must not load torch with them (issue 31)."""
from typing import Any

__all__ = ["TPGroup", "init_tp_group"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from llmserve.distributed import parallel_state
        return getattr(parallel_state, name)
    raise AttributeError(f"module 'llmserve.distributed' has no attribute {name!r}")
