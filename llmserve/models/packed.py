"""GGUF-packed weights for the linear layers (issue 16).

After a GGUF model's weights are loaded (dequantized to the model dtype),
:func:`attach_packed_weights` gives each ``Linear`` whose checkpoint tensors were
Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 or K-quant (Q2_K..Q6_K, issue 30) blocks a packed copy
(fused the way the model fuses them: q/k/v rows into ``qkv_proj``, gate/up into
``gate_up_proj``; parts of different types, as Q4_K_M files mix them, run side by side),
and the LM head the packed embedding when they are tied. ``Linear`` then runs steps of at most ``max_rows`` tokens through
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

import dataclasses
import logging
from typing import Any, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _packed_for(prefix: str, leaf: str, packed: dict) -> Optional[Any]:
    """The packed weight of Linear ``prefix.leaf`` (fusing its parts: one weight when they
    share a type, else a ``ConcatQuantWeight`` of one per type run), or None when a part is
    missing."""
    from llmserve.ops.kquant import ConcatQuantWeight, quant_weight_from_gguf

    parts = _FUSED.get(leaf, (leaf,))
    found = [packed.get(f"{prefix}.{p}.weight" if prefix else f"{p}.weight") for p in parts]
    if any(f is None for f in found):
        return None
    runs: list[list] = []  # consecutive parts of one type share one weight
    for f in found:
        if runs and runs[-1][0] == f[0]:
            runs[-1][1].append(f[1])
        else:
            runs.append([f[0], [f[1]]])
    weights = [quant_weight_from_gguf(torch.cat(raws).contiguous(), qtype) for qtype, raws in runs]
    return weights[0] if len(weights) == 1 else ConcatQuantWeight(tuple(weights))


# The packed weights' tensor fields (QuantWeight: codes, dm; KQuantWeight: codes, sc, dd).
_TENSOR_FIELDS = ("codes", "dm", "sc", "dd")


def _on_huge_pages(weights: list) -> list:
    """The same packed weights (``QuantWeight`` / ``KQuantWeight`` / ``ConcatQuantWeight``)
    with every tensor moved into one buffer on 2 MiB pages (``ops/huge_pages.py``): a
    decode step streams all of them, and on 4 KiB pages each page was a TLB miss.
    Measured (the 210 blk.* weights of llama-quantize's Q4_K_M of SmolLM2, one process, 4
    KiB and 2 MiB copies alternating, medians of 10, 2 threads, load ~3): 32 rows 23.00 ->
    21.95 ms (1.05x), 256 rows 1.00x; the Q4_1 file at 32 rows 1.07x (load ~7). Costs a
    transient second copy while loading (~94 MiB). Values are unchanged (copies)."""
    from llmserve.ops.huge_pages import to_huge_pages

    def fields(w) -> list[tuple[object, str]]:
        if hasattr(w, "parts"):  # ConcatQuantWeight
            return [f for p in w.parts for f in fields(p)]
        return [(w, f) for f in _TENSOR_FIELDS if hasattr(w, f)]

    slots = [f for w in weights for f in fields(w)]
    copies = dict(zip(((id(w), f) for w, f in slots),
                      to_huge_pages([getattr(w, f) for w, f in slots])))

    def rebuilt(w):
        if hasattr(w, "parts"):
            return dataclasses.replace(w, parts=tuple(rebuilt(p) for p in w.parts))
        return dataclasses.replace(w, **{f: copies[(id(w), f)] for f in _TENSOR_FIELDS if hasattr(w, f)})

    return [rebuilt(w) for w in weights]


def packed_max_rows(model: nn.Module) -> int:
    """Steps of up to how many tokens ``model``'s packed blocks take on this CPU
    (``packed_switch_point`` at its MLP's shape; ``ALL_STEPS``: every step), 0 when the
    packed kernels are unavailable."""
    from llmserve.ops.quant_ops import get_quant_ops, packed_switch_point

    if get_quant_ops() is None:
        return 0
    cfg = model.config
    return packed_switch_point(cfg.hidden_size, 2 * cfg.intermediate_size, getattr(model, "dtype", torch.bfloat16))


def _tied_head_runs_blocks(model: nn.Module) -> bool:
    """A tied head whose blocks take every step: ``pack_tied_head`` frees the dense
    embedding then (its rows come from the blocks)."""
    from llmserve.ops.quant_ops import ALL_STEPS

    head = getattr(model, "packed_head", None)
    return (head is not None and head[1] >= ALL_STEPS and getattr(model, "lm_head", 0) is None
            and getattr(model, "tp_lm_head", None) is None and hasattr(model, "pack_tied_head"))


def blocks_only_names(model: nn.Module) -> frozenset:
    """The checkpoint names (HF, as ``iterate_gguf_weights`` yields them) whose dense copies
    ``model`` freed after :func:`attach_packed_weights` (its ``Linear`` layers that run on
    the blocks at every step, fused parts included), plus the tied embedding when its
    head runs on the blocks at every step: what the start-up cache's ``-blocks`` entry
    leaves out (``model_loader._load_gguf``)."""
    from llmserve.models.llama import Linear

    names = set()
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.packed_only and mod.weight.shape[0] == 0:
            prefix, _, leaf = name.rpartition(".")
            names.update(f"{prefix}.{p}.weight" if prefix else f"{p}.weight" for p in _FUSED.get(leaf, (leaf,)))
    if _tied_head_runs_blocks(model):
        names.add("model.embed_tokens.weight")
    return frozenset(names)


def drop_tied_embedding(model: nn.Module) -> None:
    """Free the dense embedding before loading when the tied head's blocks take every step
    (as ``pack_tied_head`` would after loading), so a ``-blocks`` cache entry, which has no
    dense copy of it, loads: ``load_weights`` skips 0-row weights."""
    if _tied_head_runs_blocks(model):
        emb = model.model.embed_tokens
        emb.weight = nn.Parameter(emb.weight.new_empty(0, emb.weight.shape[1]), requires_grad=False)


_HEAD = "@head"  # the tied head's key among the repacked weights (no module has this name)


def repacked_weights(model: nn.Module) -> dict[str, Any]:
    """The packed weights ``model`` runs at every step with no dense copy, by module name
    (``Linear`` layers; the tied head under ``"@head"``): what the start-up cache's
    ``-blocks`` entry stores in the kernels' layout (:func:`weight_tensors`), so a warm
    start skips ``quant_repack``."""
    from llmserve.models.llama import Linear

    out: dict[str, Any] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.packed_only and mod.weight.shape[0] == 0:
            out[name] = mod.qweight
    if _tied_head_runs_blocks(model):
        out[_HEAD] = model.packed_head[0]
    return out


def weight_tensors(weight: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """A packed weight (``QuantWeight`` / ``KQuantWeight`` / ``ConcatQuantWeight``) as a
    JSON description (each part's class and int fields) and its tensors by
    ``"<part>.<field>"``; :func:`weight_from_tensors` inverts it."""
    import json

    parts = weight.parts if hasattr(weight, "parts") else (weight,)
    desc, tensors = [], {}
    for i, part in enumerate(parts):
        ints = {}
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if isinstance(value, torch.Tensor):
                tensors[f"{i}.{f.name}"] = value
            else:
                ints[f.name] = int(value)
        desc.append({"class": type(part).__name__, "ints": ints})
    return json.dumps({"concat": hasattr(weight, "parts"), "parts": desc}), tensors


def weight_from_tensors(desc: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The packed weight :func:`weight_tensors` described (the tensors used as they are,
    not copied). ValueError naming the field for an unknown class or a missing tensor."""
    import json

    from llmserve.ops.kquant import ConcatQuantWeight, KQuantWeight
    from llmserve.ops.quant_ops import QuantWeight

    classes = {"QuantWeight": QuantWeight, "KQuantWeight": KQuantWeight}
    d = json.loads(desc)
    parts = []
    for i, part in enumerate(d["parts"]):
        cls = classes.get(part["class"])
        if cls is None:
            raise ValueError(f"packed weight part {i}: unknown class {part['class']!r}")
        kw = dict(part["ints"])
        for f in dataclasses.fields(cls):
            if f.name not in kw:
                if f"{i}.{f.name}" not in tensors:
                    raise ValueError(f"packed weight part {i}: no tensor {f.name!r}")
                kw[f.name] = tensors[f"{i}.{f.name}"]
        parts.append(cls(**kw))
    return ConcatQuantWeight(tuple(parts)) if d["concat"] else parts[0]


def attach_repacked(model: nn.Module, weights: dict[str, Any], max_rows: int) -> int:
    """As :func:`attach_packed_weights` (``drop_dense``) from weights already in the
    kernels' layout (:func:`repacked_weights` of an earlier start, ``"@head"``: the tied
    head). Returns the number of layers given one; ValueError naming a module that is
    not a ``Linear`` or whose rows differ (then no layer was changed)."""
    from llmserve.models.llama import Linear
    from llmserve.ops.quant_ops import ALL_STEPS

    mods = dict(model.named_modules())
    for name, weight in weights.items():  # check all first: a misfit leaves the model as it was
        mod = mods.get(name)
        if name != _HEAD and (not isinstance(mod, Linear) or weight.shape[0] != mod.weight.shape[0]):
            raise ValueError(f"packed weight {name!r} does not fit the model's layer")
    for name, weight in weights.items():
        if name == _HEAD:
            model.packed_head = (weight, max_rows)
            continue
        mod = mods[name]
        mod.set_packed(weight, max_rows, drop_dense=True)
        if name == "lm_head" and hasattr(model, "packed_head"):
            model.packed_head = (weight, max_rows)
    logger.info("packed weights: %d layers run %s from their GGUF blocks (repacked by an earlier start)",
                len(weights), "every step" if max_rows >= ALL_STEPS else f"steps of <= {max_rows} tokens")
    return len(weights)


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
    from llmserve.ops.kquant import quant_weight_from_gguf
    from llmserve.ops.quant_ops import ALL_STEPS, get_quant_ops, packed_switch_point

    if get_quant_ops() is None or not packed:
        return 0
    dtype = getattr(model, "dtype", torch.bfloat16)
    if max_rows is None:
        cfg = model.config
        max_rows = packed_switch_point(cfg.hidden_size, 2 * cfg.intermediate_size, dtype)
    if max_rows <= 0:
        logger.info("packed weights: the dense GEMM wins at every step size here; not used")
        return 0
    layers: list[tuple[str, Linear, Any]] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear):
            continue
        prefix, _, leaf = name.rpartition(".")
        found = _packed_for(prefix, leaf, packed)
        if found is not None and found.shape[0] == mod.weight.shape[0]:
            layers.append((name, mod, found))
    head = packed.get("lm_head.weight") or packed.get("model.embed_tokens.weight")
    tied = None
    if head is not None and getattr(model, "lm_head", None) is None:
        tied = quant_weight_from_gguf(head[1], head[0])
    moved = _on_huge_pages([w for _, _, w in layers] + ([tied] if tied is not None else []))
    for (name, mod, _), found in zip(layers, moved):
        mod.set_packed(found, max_rows, drop_dense)
        if name == "lm_head" and hasattr(model, "packed_head"):
            # compute_logits reads an untied head's weight, not the Linear: without this
            # a quantized output.weight left [N, 0] logits once its dense copy was dropped
            model.packed_head = (found, max_rows)
    count = len(layers)
    if tied is not None:
        model.packed_head = (moved[-1], max_rows)
        count += 1
    logger.info("packed weights: %d layers run %s from their GGUF blocks", count,
                "every step" if max_rows >= ALL_STEPS else f"steps of <= {max_rows} tokens")
    return count
