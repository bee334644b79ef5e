"""The tensor-parallel group of one engine's workers (vLLM's ``parallel_state``), over
``torch.distributed``: gloo on the CPU, nccl where CUDA is present.

Unlike vLLM there is no module-level group: ``init_tp_group`` returns a ``TPGroup`` that
the sharded model holds, so two engines in one process (tests) never share state.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class TPGroup:
    """rank / world_size of this worker in its engine's tensor-parallel group, and the
    collectives: ``all_reduce`` (sum, in place) and ``all_gather`` (concatenate along a
    dim; the parts may differ in size along it)."""

    def __init__(self, rank: int, world_size: int, group: Optional["dist.ProcessGroup"] = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, sizes: list[int], dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``; ``sizes[r]``: rank r's size along it."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        x = x.contiguous()
        parts = []
        for s in sizes:
            shape = list(x.shape)
            shape[dim] = s
            parts.append(torch.empty(shape, dtype=x.dtype, device=x.device))
        if len(set(sizes)) == 1:
            dist.all_gather(parts, x, group=self.group)
        else:  # gloo's all_gather needs equal sizes: pad to the largest, then trim
            top = max(sizes)
            pad_shape = list(x.shape)
            pad_shape[dim] = top
            padded = torch.zeros(pad_shape, dtype=x.dtype, device=x.device)
            padded.narrow(dim, 0, x.shape[dim]).copy_(x)
            bufs = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(bufs, padded, group=self.group)
            parts = [b.narrow(dim, 0, s) for b, s in zip(bufs, sizes)]
        return torch.cat(parts, dim=dim)


def init_tp_group(rank: int, world_size: int, init_method: str, device: str = "cpu") -> TPGroup:
    """Join the engine's process group (``init_method``: ``file://...`` or ``tcp://host:port``,
    the same for every rank). Backend: nccl on CUDA, else gloo. Returns the TPGroup."""
    if world_size == 1:
        return TPGroup(0, 1)
    backend = "nccl" if device == "cuda" and torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return TPGroup(rank, world_size, None)


def destroy_tp_group() -> None:
    """Leave the process group (worker shutdown)."""
    if dist.is_initialized():
        dist.destroy_process_group()
