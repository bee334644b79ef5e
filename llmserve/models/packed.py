"""GGUF-packed weights for the linear layers (issue 16).

After a GGUF model's weights are loaded (dequantized to the model dtype),
:func:`attach_packed_weights` gives each ``Linear`` whose checkpoint tensors were
Q4_0 / Q4_1 / Q8_0 blocks a packed copy (fused the way the model fuses them: q/k/v rows
into ``qkv_proj``, gate/up into ``gate_up_proj``), and the LM head the packed embedding
when they are tied. ``Linear`` then runs steps of at most ``max_rows`` tokens through
``QuantWeight.linear`` (:mod:`llmserve.ops.quant_ops`, int8 activations on VNNI, as
llama.cpp does); ``max_rows`` is this CPU's (``packed_switch_point``: a table entry, or a
start-up probe on CPUs the table does not cover). Where the packed kernel takes every step (here), packed
layers run every step and their dense copies are freed: the model holds its weights as
the file's blocks only (SmolLM2: ~94 MiB instead of ~420). Where it does not, steps
inside ``batch_invariant.min_gemm_rows`` (seeded requests, ``--batch-invariant``) keep the
dense GEMMs (their rows must not depend on the step size; the packed kernel's rows do not
either, but the switch between the two would).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _packed_for(prefix: str, leaf: str, packed: dict) -> Optional[tuple[int, torch.Tensor]]:
    """The packed weight of Linear ``prefix.leaf`` (fusing its parts), or None when a part
    is missing or the parts differ in type."""
    parts = _FUSED.get(leaf, (leaf,))
    found = [packed.get(f"{prefix}.{p}.weight" if prefix else f"{p}.weight") for p in parts]
    if any(f is None for f in found) or len({f[0] for f in found}) != 1:
        return None
    qtype = found[0][0]
    w = found[0][1] if len(found) == 1 else torch.cat([f[1] for f in found])
    return qtype, w.contiguous()


def attach_packed_weights(model: nn.Module, packed: dict, max_rows: Optional[int] = None,
                          drop_dense: bool = True) -> int:
    """Give the model's ``Linear`` layers their packed weights from ``packed``
    (``hf_name -> (ggml type id, uint8 [rows, row_bytes])``, see ``iterate_gguf_weights``).

    ``max_rows``: steps of at most this many tokens use them; None: this CPU's answer
    (``packed_switch_point`` at the MLP's shape); when that is ``ALL_STEPS`` and ``drop_dense``
    (False for tensor-parallel workers, which shard the dense weights next), the dense
    weights of packed layers are freed. Returns the number of layers given a packed
    weight (0 when the kernels are unavailable or the probe finds no win)."""
    from llmserve.models.llama import Linear
    from llmserve.ops.quant_ops import ALL_STEPS, QuantWeight, get_quant_ops, packed_switch_point

    if get_quant_ops() is None or not packed:
        return 0
    dtype = getattr(model, "dtype", torch.bfloat16)
    if max_rows is None:
        cfg = model.config
        max_rows = packed_switch_point(cfg.hidden_size, 2 * cfg.intermediate_size, dtype)
    if max_rows <= 0:
        logger.info("packed weights: the dense GEMM wins at every step size here; not used")
        return 0
    count = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear):
            continue
        prefix, _, leaf = name.rpartition(".")
        found = _packed_for(prefix, leaf, packed)
        if found is not None and found[1].shape[0] == mod.weight.shape[0]:
            mod.set_packed(QuantWeight.from_gguf(found[1], found[0]), max_rows, drop_dense)
            count += 1
    head = packed.get("lm_head.weight") or packed.get("model.embed_tokens.weight")
    if head is not None and getattr(model, "lm_head", None) is None:
        model.packed_head = (QuantWeight.from_gguf(head[1], head[0]), max_rows)
        count += 1
    logger.info("packed weights: %d layers run %s from their 4/8-bit blocks", count,
                "every step" if max_rows >= ALL_STEPS else f"steps of <= {max_rows} tokens")
    return count
