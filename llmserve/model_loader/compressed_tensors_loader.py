"""Weight-only int4 / int8 checkpoints in the compressed-tensors format (vLLM's
``--quantization compressed-tensors``, written by llm-compressor, e.g. its "W4A16"
recipes): each quantized Linear stores ``weight_packed`` (int32, values packed along the
input dimension), ``weight_scale`` (one per output row and group of inputs) and
``weight_shape``; ``config.json`` describes the scheme under ``quantization_config``.

Supported here: symmetric integer weights of 4 or 8 bits, per group (a multiple of 32
inputs) or per channel, no activation quantization. Each layer becomes the GGUF blocks it
equals (Q4_0 for 4 bits: w = d * (nibble - 8); Q8_0 for 8 bits: w = d * int8), with d the
group's scale in float16, so it runs through the same packed kernels as a GGUF file
(:mod:`llmserve.models.packed`), and its dequantized values feed the dense weights. The
packing is the compressed-tensors library's (``pack_to_int32`` writes it); the loader reads
it itself (:func:`unpack_int32`), since that library's import fails in the engine process.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np

if TYPE_CHECKING:  # imported where tensors are made: the API server reads weight_scheme
    # (a dict check) at start and does not import torch (issue 31)
    import torch

logger = logging.getLogger(__name__)

_PARTS = ("weight_packed", "weight_scale", "weight_shape")


def weight_scheme(hf_config: Any) -> Optional[dict]:
    """The checkpoint's weight scheme (``{"num_bits", "group_size" (None: per channel),
    "ignore"}``) when ``quantization_config`` is compressed-tensors, else None. Raises
    ValueError for a compressed-tensors scheme this loader does not run (naming what)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if qc.get("quant_method") != "compressed-tensors":
        return None
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if fmt != "pack-quantized" or len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoint with format={fmt!r} and {len(groups)} config groups is not "
                         "supported (pack-quantized, one group: int4/int8 weight-only)")
    w, act = groups[0].get("weights") or {}, groups[0].get("input_activations")
    bits, strategy, group = w.get("num_bits"), w.get("strategy"), w.get("group_size")
    if (act or w.get("type", "int") != "int" or not w.get("symmetric", True) or bits not in (4, 8)
            or strategy not in ("group", "channel") or (strategy == "group" and (not group or group % 32))):
        raise ValueError("compressed-tensors scheme not supported: weights "
                         f"{ {k: w.get(k) for k in ('num_bits', 'type', 'symmetric', 'strategy', 'group_size')} }, "
                         f"input_activations {act!r} (supported: symmetric int4/int8 weights per channel or per "
                         "group of a multiple of 32, no activation quantization)")
    return {"num_bits": bits, "group_size": group if strategy == "group" else None, "ignore": qc.get("ignore", [])}


def _gguf_blocks(q: torch.Tensor, scale: torch.Tensor, bits: int) -> Optional[np.ndarray]:
    """int8 values ``q [N, K]`` and per-32-block scales ``[N, K/32]`` as GGUF Q4_0 (4 bits)
    or Q8_0 blocks ``uint8 [N, K/32 * bytes]``; None when a scale is not exactly a float16."""
    d16 = scale.float().numpy().astype(np.float16)
    if not np.array_equal(d16.astype(np.float32), scale.float().numpy()):
        return None
    n, k = q.shape
    qb = q.numpy().reshape(n, k // 32, 32)
    d = d16.reshape(n, k // 32, 1).view(np.uint8)
    if bits == 8:
        return np.concatenate([d, qb.view(np.uint8)], axis=2).reshape(n, -1)
    nib = (qb + 8).astype(np.uint8)
    qs = nib[:, :, :16] | (nib[:, :, 16:] << 4)
    return np.concatenate([d, qs], axis=2).reshape(n, -1)


def unpack_int32(packed: torch.Tensor, bits: int, shape: tuple[int, int]) -> torch.Tensor:
    """int8 ``[N, K]`` values from compressed-tensors' ``pack_to_int32`` of ``bits`` (4 or 8)
    along the input dimension: ``packed`` int32 ``[N, ceil(K * bits / 32)]``, value i of a
    row at bit ``i * bits`` of the row's little-endian words, stored plus ``2^(bits-1)``
    (compressed-tensors 0.20's ``unpack_from_int32``, for the widths this loader runs).
    Not that library's function: importing it imports transformers' modeling_utils, which
    raises NameError in the engine process, where transformers was imported with torch
    hidden (torch_hiding.py), so `llmserve serve` of such a checkpoint failed at start."""
    import torch

    n, k = shape
    words = np.ascontiguousarray(packed.numpy().astype("<i4", copy=False))
    data = words.view(np.uint8).reshape(n, -1)
    if bits == 4:
        data = np.stack((data & 0xF, data >> 4), axis=-1).reshape(n, -1)  # low nibble first
    values = data[:, :k].astype(np.int16) - (1 << (bits - 1))
    return torch.from_numpy(values.astype(np.int8))


def _layer(name: str, parts: dict, scheme: dict, dtype: torch.dtype,
           packed: Optional[dict]) -> tuple[str, torch.Tensor]:
    import torch

    shape = torch.Size(int(x) for x in parts["weight_shape"].tolist())
    bits = scheme["num_bits"]
    q = unpack_int32(parts["weight_packed"], bits, (shape[0], shape[1]))  # int8 [N, K]
    n, k = shape
    group = scheme["group_size"] or k
    scale = parts["weight_scale"].reshape(n, -1)
    if scale.shape[1] != k // group:
        raise ValueError(f"{name}: weight_scale {tuple(parts['weight_scale'].shape)} does not fit a group of "
                         f"{group} over {k} inputs")
    per_input = scale.repeat_interleave(group, dim=1)
    dense = (q.to(torch.float32) * per_input.float()).to(dtype)
    if packed is not None and k % 32 == 0:
        blocks = _gguf_blocks(q, scale.repeat_interleave(group // 32, dim=1), bits)  # group: a multiple of 32
        if blocks is not None:
            packed[f"{name}.weight"] = (8 if bits == 8 else 2, torch.from_numpy(np.ascontiguousarray(blocks)))
        else:
            logger.info("%s: scales are not float16 values; this layer keeps dense weights only", name)
    return f"{name}.weight", dense


def iterate_compressed_tensors_weights(weights: Iterator[tuple[str, torch.Tensor]], scheme: dict,
                                       dtype: torch.dtype, packed: Optional[dict] = None
                                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` of a compressed-tensors checkpoint's ``weights`` with every
    quantized Linear dequantized to ``dtype`` under ``<layer>.weight`` (other tensors as
    stored). ``packed``: when given, also filled with each quantized layer's GGUF blocks
    (``hf_name -> (ggml type id, uint8 [rows, row_bytes])``, as ``iterate_gguf_weights``).
    Raises ValueError for a layer whose parts do not fit together."""
    pending: dict[str, dict] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if len(parts) == len(_PARTS):
            yield _layer(prefix, pending.pop(prefix), scheme, dtype, packed)
    if pending:
        raise ValueError(f"compressed-tensors layers with missing parts: {sorted(pending)[:5]}")


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric quantization of ``weight [N, K]`` per group of
    ``group_size`` inputs: scale = max|w| / (2^(bits-1) - 1) rounded to float16 (so the
    packed kernels take it exactly), q = clamp(round(w / scale)) in int8. Returns
    ``(q int8 [N, K], scale float16 [N, K / group_size])``. No calibration (llm-compressor's
    GPTQ/AWQ recipes choose better scales; this is their plain RTN baseline)."""
    n, k = weight.shape
    if bits not in (4, 8) or group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(f"bits must be 4 or 8 and group_size a multiple of 32 dividing the layer's {k} inputs "
                         f"(what the engine runs), got bits={bits}, group_size={group_size}")
    import torch

    w = weight.float().reshape(n, k // group_size, group_size)
    qmax = (1 << (bits - 1)) - 1
    scale = (w.abs().amax(-1) / qmax).clamp_min(1e-8).half()
    q = torch.round(w / scale.float()[..., None]).clamp(-qmax - 1, qmax).to(torch.int8)
    return q.reshape(n, k), scale


def save_rtn_checkpoint(src: str, dst: str, bits: int = 4, group_size: int = 32, save_tokenizer: bool = True) -> None:
    """Write model ``src`` (anything ``llmserve.LLM`` loads: an HF directory or a GGUF
    model) to ``dst`` as a compressed-tensors ``pack-quantized`` checkpoint whose Linear
    layers (not the LM head) are int ``bits`` weights by :func:`quantize_rtn`: config.json
    with ``quantization_config``, model.safetensors and (``save_tokenizer``) the tokenizer.
    For trying the
    weight-only path without llm-compressor: ``python -m
    llmserve.model_loader.compressed_tensors_loader SRC DST [BITS] [GROUP]``."""
    import json
    import os

    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    # Not llmserve.tokenizer: it imports the model loader, which imports this module.
    from llmserve.model_loader.hf_reference import load_hf_model, load_hf_tokenizer

    hf = load_hf_model(src, "float32") if not os.path.isdir(src) else AutoModelForCausalLM.from_pretrained(src)
    state = hf.state_dict()
    quantized = [n for n, t in state.items() if n.endswith(".weight") and t.dim() == 2 and ".layers." in n
                 and "norm" not in n]
    widths = sorted({state[n].shape[1] for n in quantized})
    if bits not in (4, 8) or group_size <= 0 or group_size % 32 or any(k % group_size for k in widths):
        raise ValueError(f"bits must be 4 or 8 and group_size a multiple of 32 dividing every layer's inputs "
                         f"{widths}, got bits={bits}, group_size={group_size}")
    tensors = {}
    for name, t in state.items():
        if name in quantized:
            q, scale = quantize_rtn(t, bits, group_size)
            base = name[:-len(".weight")]
            tensors[f"{base}.weight_packed"] = pack_to_int32(q, bits)
            tensors[f"{base}.weight_scale"] = scale
            tensors[f"{base}.weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    if getattr(hf.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    cfg = hf.config.to_dict()
    cfg["torch_dtype"] = "bfloat16"
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size}}}}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if save_tokenizer:
        load_hf_tokenizer(src).save_pretrained(dst)


def main(argv: list[str]) -> int:
    """``python -m llmserve.model_loader.compressed_tensors_loader SRC DST [BITS] [GROUP]``."""
    usage = "usage: python -m llmserve.model_loader.compressed_tensors_loader SRC DST [BITS 4|8] [GROUP_SIZE]"
    if len(argv) not in (2, 3, 4) or not all(a.isdigit() for a in argv[2:]):
        print(usage)
        return 2
    try:
        save_rtn_checkpoint(argv[0], argv[1], *(int(a) for a in argv[2:]))
    except ValueError as e:
        print(f"error: {e}\n{usage}")
        return 2
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
