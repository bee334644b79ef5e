"""Row-invariant GEMMs for seeded requests (issue 18).

On these CPUs a linear layer's result for one row depends on how many rows the GEMM has:
measured with torch 2.13 (oneDNN / MKL) at SmolLM2 shapes, float32 gives one result at
M=1, another at M=2..3 and a third for every M >= 4 (tested up to 512); bfloat16 differs
between M=1 and M >= 2 for the K=1536 down projection. So a seeded request's logits
changed with the number of tokens in its step (alone vs batched, decode vs prefill
chunk). Running every GEMM as blocks of exactly ``MIN_INVARIANT_ROWS`` rows (the last one
padded) gives every row one class on these CPUs and on AMX ones (see :func:`linear`). The paged C++ attention already treats each query token alone over its
cached context, so with padded GEMMs a row's hidden states no longer depend on the batch.

The runner pads every step (``min_gemm_rows``) while ``ModelConfig.batch_invariant`` is on
(``--batch-invariant``, off by default), so greedy tokens are the same alone, batched,
chunked or after a prefix-cache hit (issue 10.6); with it off, only steps holding a seeded
request are padded (issue 18). It is not free: small steps are padded to 16 rows and long
ones run as several 16-row GEMMs; measured at SmolLM2 GEMM shapes, one thread, a loaded
machine, padding 1 row to 4 (the earlier block size) cost +7..18% GEMM time in bfloat16 and ~2x in float32 (oneDNN's
M=1 GEMV is fast), hence opt-in. ``llmserve bench seed-repro --greedy --ab-rounds K``
measures it end to end. vLLM offers batch invariance only as
an opt-in on some GPUs (``VLLM_BATCH_INVARIANT``). Verified here (torch 2.13, AVX512-BF16):
every row of a 2..1100-row GEMM equals that row padded to 4, in float32 and bfloat16, at all
SmolLM2 shapes. The attention needs nothing: the paged C++ kernel runs each query token
alone over its cached context (the torch fallback, used only when the kernels cannot be
built, is not row-invariant for prompt chunks).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from llmserve.ops import onednn_linear

# Rows of every GEMM inside min_gemm_rows: one AMX tile's height, and past the M < 4 classes of
# AVX512 CPUs without AMX (see linear)
MIN_INVARIANT_ROWS = 16

_min_rows: contextvars.ContextVar[int] = contextvars.ContextVar("llmserve_min_gemm_rows", default=1)


@contextlib.contextmanager
def min_gemm_rows(rows: int) -> Iterator[None]:
    """Within the block, :func:`linear` pads its input to at least ``rows`` rows."""
    token = _min_rows.set(rows)
    try:
        yield
    finally:
        _min_rows.reset(token)


def unpadded() -> bool:
    """True outside :func:`min_gemm_rows` (step-size dependent kernels may run)."""
    return _min_rows.get() == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` ([M, in] x [out, in] -> [M, out]), or oneDNN's linear when ``weight``
    was packed by :mod:`llmserve.ops.onednn_linear` (``weight.is_mkldnn``); inside
    :func:`min_gemm_rows` a 2-D input runs as GEMMs of exactly that many rows (the last
    block padded with zero rows, dropped from the result).

    Why fixed blocks and not just padding small GEMMs: on AMX CPUs (Sapphire Rapids, torch
    2.13) a row's result depends on M in more classes than "M < 4 / M >= 4": measured at
    SmolLM2 shapes, float32 576x1536 gives one result for M = 16..33, another for 63..129
    and the first again from 255; bfloat16 49152x576 one for M <= 32 and 511+, another for
    33..257. Within a GEMM of a fixed M, a row's result did not depend on its position or
    on the other rows (blocks of 4, 8, 16, every shape, both dtypes), so fixed blocks make
    every row invariant on both CPU families."""
    m = _min_rows.get()
    if m <= 1 or x.dim() != 2:
        return _gemm(x, weight, bias)
    rows = x.shape[0]
    if rows % m:
        x = torch.cat([x, x.new_zeros(m - rows % m, x.shape[1])])
    if x.shape[0] == m:
        return _gemm(x, weight, bias)[:rows]
    return torch.cat([_gemm(block, weight, bias) for block in x.split(m)])[:rows]


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if weight.is_mkldnn:
        return onednn_linear.linear(x, weight, bias)
    return F.linear(x, weight, bias)
