"""Tensor-parallel plumbing (vLLM's ``vllm.distributed``): the process group of one
engine's workers and the collectives the sharded layers call."""
from llmserve.distributed.parallel_state import TPGroup, init_tp_group

__all__ = ["TPGroup", "init_tp_group"]
