"""Tensors on 2 MiB (transparent huge) pages, for data every decode step streams through.

The packed GGUF weights (``models/packed.py``) are read whole at every step, ~94 MiB for
SmolLM2's Q4_K_M file, as some 200 tensors of 0.1-30 MiB each that ``quant_repack``
allocates on 4 KiB pages (the kernel gives anonymous memory huge pages only where
``madvise(MADV_HUGEPAGE)`` asks, in the usual ``transparent_hugepage=madvise`` setting,
and most of these tensors are smaller than one huge page anyway). Each 4 KiB page of the
stream then costs a TLB miss, and the packed kernels' software prefetch runs into it.
:func:`to_huge_pages` copies a set of tensors into one 2 MiB-aligned buffer advised for
huge pages, before it is first touched, so it faults in 2 MiB at a time.

Linux only; elsewhere (or when madvise fails) the buffer is ordinary memory and nothing
else changes.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import numpy as np
import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor's start: a cache line (the kernels load 64-byte vectors)
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def libc_madvise():
    """libc's madvise with its argument types set, or None without glibc."""
    try:
        fn = ctypes.CDLL("libc.so.6", use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return fn
    except (OSError, AttributeError):
        return None


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array of ``nbytes`` starting on a 2 MiB boundary, advised
    ``MADV_HUGEPAGE`` before anything touches it (so its pages fault in as huge pages where
    the kernel allows). The array is a view: keep it (or a tensor made from it) alive."""
    raw = np.zeros(nbytes + HUGE_PAGE, dtype=np.uint8)  # calloc: untouched fresh mmap'd memory
    off = (-raw.ctypes.data) % HUGE_PAGE
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    fn = libc_madvise()
    if fn is not None and length:
        fn(raw.ctypes.data + off, min(length, raw.nbytes - off) // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    return raw[off:off + nbytes]


def to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` (any dtypes and shapes; each made contiguous) laid out one
    after another, 64-byte aligned, in one :func:`huge_page_buffer`; the same values,
    shapes and dtypes. The buffer lives as long as any of the copies. An empty list gives
    an empty list. ValueError names the index of a tensor that is not on the CPU."""
    for i, t in enumerate(tensors):
        if t.device.type != "cpu":
            raise ValueError(f"to_huge_pages: tensors[{i}] is on {t.device}, not the CPU")
    offsets: list[int] = []
    total = 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    if not tensors:
        return []
    arena = torch.from_numpy(huge_page_buffer(total))
    out = []
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        dst = arena[off:off + n].view(t.dtype).view(t.shape)
        dst.copy_(t)
        out.append(dst)
    return out


def anon_huge_kib() -> Optional[int]:
    """This process's resident anonymous memory on huge pages (KiB, from
    ``/proc/self/smaps_rollup``), or None where that file is missing."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
