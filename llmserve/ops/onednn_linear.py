"""Linear layers on weights packed once for oneDNN (the kernel torch's Inductor CPU
backend emits for linears: ``torch.ops.mkldnn._linear_pointwise`` on a weight from
``torch.ops.mkldnn._reorder_linear_weight``).

Why: ``F.linear`` on a CPU tensor goes to MKL's sgemm in float32, which takes a slow
generic path on AMD CPUs such as this one (AVX512, Zen), and reorders a bfloat16 weight
into oneDNN's blocked layout on every call. Measured here (torch 2.13, 2 threads, one
GEMM, ms, F.linear -> packed oneDNN):

=========================  ==============  ===============
shape (rows x in -> out)   float32         bfloat16
=========================  ==============  ===============
1 x 576 -> 49152 (head)    6.6 -> 2.4      2.3 -> 0.72
1 x 576 -> 3072 (MLP)      0.10 -> 0.07    0.16 -> 0.06
32 x 576 -> 3072           1.03 -> 0.27    0.30 -> 0.15
32 x 1536 -> 576           0.37 -> 0.14    0.12 -> 0.08
4096 x 384 -> 1152 (BERT)  17.9 -> 7.5     -
=========================  ==============  ===============

Results stay float32 / bfloat16 GEMMs (max error against float64 1.4e-4 vs MKL's 5.4e-5 on
a 384-term random dot product). Rows: a row's result is the same for every step of >= 4
rows (checked at SmolLM2's and MiniLM's shapes up to 600 rows; bfloat16 also at 1-3 rows),
the property ``batch_invariant`` pads for. ``--enforce-eager`` does not turn this off: it is
not graph capture; ``LLMSERVE_ONEDNN_LINEAR=0`` does (comparisons, debugging).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from llmserve import envs

#: The packing's row hint (oneDNN picks the blocking for this many rows; any row count
#: runs on it). 32 and 512 measured the same at 1-256 rows; 1 was slower from 4 rows up.
HINT_ROWS = 64
_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when this torch has oneDNN's linear ops and ``LLMSERVE_ONEDNN_LINEAR`` != "0"."""
    return (envs.get("LLMSERVE_ONEDNN_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """``weight [out, in]`` (float32/bfloat16, CPU) in oneDNN's packed layout (a tensor
    with ``is_mkldnn``, the same shape and dtype, ~ the same bytes), or None where it does
    not apply (other dtype or device, oneDNN unavailable)."""
    if not available() or weight.device.type != "cpu" or weight.dtype not in _DTYPES or weight.dim() != 2:
        return None
    if weight.dtype == torch.bfloat16 and not bf16_supported():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), HINT_ROWS)


@functools.lru_cache(maxsize=1)
def bf16_supported() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU: it needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT, and raises otherwise (AMD Zen 2/3 with AVX2 only: ``--dtype bfloat16``
    failed at load with "mkldnn_reorder_linear_weight: bf16 path needs ..."); there the
    bfloat16 weights stay plain tensors for ``F.linear``."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


def pack_or_keep(weight: torch.Tensor) -> torch.Tensor:
    """:func:`pack`'s result, or ``weight`` itself where packing does not apply."""
    packed = pack(weight)
    return weight if packed is None else packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., in] @ W.T (+ bias)`` -> ``[..., out]`` in x's dtype, W from :func:`pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_module_weight(module: torch.nn.Module) -> bool:
    """Replace ``module.weight`` (a parameter) by its packed form (a plain attribute, so the
    dense copy is freed). Returns False, changing nothing, where :func:`pack` does not apply."""
    packed = pack(module.weight)
    if packed is None:
        return False
    del module.weight
    module.weight = packed
    return True


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain ``[out, in]`` tensor (a copy when it was packed)."""
    return weight.to_dense() if weight.is_mkldnn else weight


def pack_model(model: torch.nn.Module) -> int:
    """Pack the weight of every module of ``model`` that says its forward runs packed
    weights (``onednn_packable = True``: llama's ``Linear``, BERT's linears), and a tied
    LM head (``model.pack_tied_head()`` where the model has one). Called once
    after the weights are loaded (``model_loader.get_model``). Returns how many were packed."""
    count = 0
    for mod in model.modules():
        if getattr(mod, "onednn_packable", False) and isinstance(getattr(mod, "weight", None), torch.nn.Parameter):
            count += pack_module_weight(mod)
    pack_tied_head = getattr(model, "pack_tied_head", None)
    if pack_tied_head is not None:
        pack_tied_head()
    return count
