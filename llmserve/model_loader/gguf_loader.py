"""Weights from a GGUF file (llama.cpp's format), dequantized into torch tensors.

Indexes the file's tensors with a small header parser (``gguf.GGUFReader`` as the
fallback; it takes seconds parsing tokenizer metadata we do not need here), dequantizes with ``gguf.quants.dequantize`` (float32), maps
llama.cpp tensor names to HF names and, for the ``llama`` GGUF architecture, undoes the
q/k row permutation ``convert_hf_to_gguf.py`` applies, exactly as transformers'
``LlamaTensorProcessor`` does (the converter permutes no other architecture's rows, the
Qwen ones included), so the weights equal those of
``AutoModelForCausalLM.from_pretrained(path, gguf_file=...)``.
"""
from __future__ import annotations

import logging
import os
import re
import struct
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Optional

import numpy as np

if TYPE_CHECKING:  # imported where tensors are made: the API server reads GGUF metadata
    # (read_gguf_tensors) at start and does not import torch (issue 31)
    import torch

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE (llama.cpp's Mixtral layout): the router, and 3-D [experts, out, in] expert
    # stacks that ``iterate_gguf_weights`` splits into one HF tensor per expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    # Qwen2-MoE's shared expert (llama.cpp's qwen2moe) and its sigmoid gate: convert_hf_to_gguf.py
    # writes it [1, hidden] as HF, llama-quantize's output 1-D [hidden] (see iterate_gguf_weights).
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Per-architecture names (llama.cpp's gguf.constants.MODEL_TENSORS): Gemma's norms around
# attention and the MLP; Phi-3's fused q/k/v and gate/up ("ffn_up" holds both, gate first).
_ARCH_BLOCK_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_ARCH_BLOCK_NAMES["gemma3"] = _ARCH_BLOCK_NAMES["gemma2"]
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm has no offset); transformers'
# Gemma2TensorProcessor subtracts it again, and so does the loader here.
_NORM_PLUS_ONE = ("gemma2", "gemma3")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> Optional[str]:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (names of the
    GGUF ``general.architecture`` ``arch``); None for tensors llmserve does not use (e.g.
    ``rope_freqs.weight``; Phi-3's ``rope_factors_*`` go to the config instead)."""
    m = _BLOCK_RE.match(name)
    if m:
        part = _ARCH_BLOCK_NAMES.get(arch, {}).get(m.group(2)) or _BLOCK_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, suffix = name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return None if hf is None else f"{hf}.{suffix}"


def reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: rows grouped per head as (dim/2, 2) -> (2, dim/2)."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


class GGUFTensorInfo(NamedTuple):
    name: str
    tensor_type: Any      # gguf.GGMLQuantizationType
    data: np.ndarray      # memory-mapped; float arrays or raw quantized bytes, as GGUFReader


# GGUF metadata value types (gguf.GGUFValueType): fixed sizes of the scalar ones.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                   11: "<q", 12: "<d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_PLAIN_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFDamagedError(ValueError):
    """A GGUF file cut short or damaged: its header runs past the end of the file, or a
    tensor's data does. Named at start-up as such (no caller falls back on it)."""


def read_gguf_tensors(path: str, metadata: Optional[dict] = None) -> tuple[str, list[GGUFTensorInfo]]:
    """``(general.architecture, tensors)`` of a little-endian GGUF v2/v3 file
    (:func:`_parse_gguf`). Raises GGUFDamagedError for a file cut short (a partial
    download), ValueError for files this parser does not read."""
    try:
        return _parse_gguf(path, metadata)
    except struct.error as e:
        raise GGUFDamagedError(f"{path} is truncated or damaged: its header ends early ({e}); "
                               "download it again") from None


def _parse_gguf(path: str, metadata: Optional[dict] = None) -> tuple[str, list[GGUFTensorInfo]]:
    """``(general.architecture, tensors)`` of a little-endian GGUF v2/v3 file.

    Parses only what loading needs: it skips the metadata values (the 49k-entry tokenizer
    arrays that make ``gguf.GGUFReader`` take seconds) except ``general.architecture`` and
    ``general.alignment`` (and the keys of ``metadata``, whose values it fills in: scalars,
    strings and arrays of them; keys absent from the file keep their value), then
    memory-maps each tensor with the shape and dtype
    ``GGUFReader`` gives it. Raises ValueError for other files (callers fall back to
    ``GGUFReader``).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    off = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8:at + 8 + n]).decode("utf-8"), at + 8 + n

    def skip(vtype: int, at: int) -> int:
        if vtype in _SCALAR_SIZES:
            return at + _SCALAR_SIZES[vtype]
        if vtype == _STRING:
            return at + 8 + struct.unpack_from("<Q", buf, at)[0]
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if etype in _SCALAR_SIZES:
                return at + count * _SCALAR_SIZES[etype]
            for _ in range(count):
                at = skip(etype, at)
            return at
        raise ValueError(f"unknown GGUF value type {vtype}")

    def value(vtype: int, at: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return string(at)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, at)
            items, at = [], at + 12
            for _ in range(count):
                item, at = value(etype, at)
                items.append(item)
            return items, at
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return struct.unpack_from(_SCALAR_FORMATS[vtype], buf, at)[0], at + _SCALAR_SIZES[vtype]

    arch, alignment = "", 32
    for _ in range(n_kv):
        key, off = string(off)
        (vtype,) = struct.unpack_from("<I", buf, off)
        off += 4
        if key == "general.architecture" and vtype == _STRING:
            arch, off = string(off)
        elif key == "general.alignment" and vtype == _UINT32:
            (alignment,) = struct.unpack_from("<I", buf, off)
            off += 4
        elif metadata is not None and key in metadata:
            metadata[key], off = value(vtype, off)
        else:
            off = skip(vtype, off)
    infos = []
    for _ in range(n_tensors):
        name, off = string(off)
        (n_dims,) = struct.unpack_from("<I", buf, off)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
        ttype, rel = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        infos.append((name, dims, GGMLQuantizationType(ttype), rel))
    data_start = (off + alignment - 1) // alignment * alignment
    tensors = []
    for name, dims, ttype, rel in infos:
        n_elems = int(np.prod(dims))
        np_dims = tuple(reversed(dims))
        dtype = _PLAIN_DTYPES.get(ttype.name)
        begin = data_start + rel
        if dtype is not None:
            n_bytes = n_elems * np.dtype(dtype).itemsize
        else:
            block, type_size = GGML_QUANT_SIZES[ttype]
            n_bytes = n_elems * type_size // block
        if begin + n_bytes > len(mm):
            raise GGUFDamagedError(f"{path} is truncated: tensor {name!r} needs bytes up to {begin + n_bytes:,} "
                                   f"but the file has {len(mm):,}; download it again")
        if dtype is not None:
            data = mm[begin:begin + n_bytes].view(dtype).reshape(np_dims)
        else:
            data = mm[begin:begin + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, ttype))
        tensors.append(GGUFTensorInfo(name, ttype, data))
    return arch, tensors


def _read_with_gguf_reader(path: str) -> tuple[str, list[GGUFTensorInfo]]:
    from llmserve.model_loader.gguf_fast_reader import FastGGUFReader
    reader = FastGGUFReader(path)
    f = reader.fields.get("general.architecture")
    arch = f.contents() if f is not None else ""
    return arch, [GGUFTensorInfo(t.name, t.tensor_type, t.data) for t in reader.tensors]


def _indexed(gguf_path: str, hf_config: Any) -> tuple[str, list, int, int]:
    """The file's architecture, tensors (types checked: ``check_tensor_types``) and the
    config's query / key-value head counts (for the q/k un-permutation)."""
    try:
        arch, tensors = read_gguf_tensors(gguf_path)
    except (ValueError, struct.error) as e:
        logger.info("fast GGUF index failed (%s); using gguf.GGUFReader", e)
        arch, tensors = _read_with_gguf_reader(gguf_path)
    n_head = int(hf_config.num_attention_heads)
    n_kv = int(getattr(hf_config, "num_key_value_heads", None) or n_head)
    check_tensor_types(tensors)
    return arch, tensors, n_head, n_kv


def read_gguf_blocks(gguf_path: str, hf_config: Any, packed: dict) -> None:
    """Fill ``packed`` as :func:`iterate_gguf_weights` does (quantized tensors' blocks by HF
    name), dequantizing nothing: a first start whose packed layers run at every step
    attaches them from these before any dense weight is made (``model_loader._load_gguf``).
    Raises ValueError as :func:`iterate_gguf_weights`."""
    arch, tensors, n_head, n_kv = _indexed(gguf_path, hf_config)
    for t in tensors:
        hf_name = gguf_to_hf_name(t.name, arch)
        if hf_name is not None:
            _keep_packed(packed, hf_name, t, arch, n_head, n_kv)


def _expert_names(hf_name: str, t: GGUFTensorInfo) -> Optional[list[str]]:
    """The per-expert HF names of a 3-d expert stack (``[experts, rows, ...]``, llama.cpp's
    ``ffn_*_exps``), in expert order; None for any other tensor."""
    if t.data.ndim == 3 and ".mlp.experts." in hf_name:
        return [hf_name.replace(".experts.", f".experts.{e}.") for e in range(t.data.shape[0])]
    return None


def _all_skipped(hf_name: str, t: GGUFTensorInfo, skip: frozenset) -> bool:
    """Whether every tensor ``t`` yields (one per expert for a 3-d expert stack) is in ``skip``."""
    if not skip:
        return False
    return all(n in skip for n in _expert_names(hf_name, t) or [hf_name])


def iterate_gguf_weights(gguf_path: str, hf_config: Any, dtype: torch.dtype,
                         packed: Optional[dict] = None,
                         skip: frozenset = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for the GGUF file's tensors, dequantized to ``dtype``.

    hf_config supplies ``num_attention_heads`` / ``num_key_value_heads`` for the q/k
    un-permutation (applied when the GGUF ``general.architecture`` is ``llama``).
    ``packed``: when given, 2-d tensors of a type in ``packed_types`` (ggml type id ->
    block bytes) are also stored there as ``hf_name -> (type id, uint8 [rows, row_bytes])``,
    the file's blocks with the same row un-permutation (for ``llmserve.models.packed``).
    ``skip``: HF names neither dequantized nor yielded (layers already running on their blocks).
    Raises ValueError for a tensor type the gguf package cannot dequantize.
    """
    import torch
    from gguf.quants import dequantize

    arch, tensors, n_head, n_kv = _indexed(gguf_path, hf_config)
    kinds = sorted({t.tensor_type.name for t in tensors})
    # With ``skip`` the packed layers are already on their blocks: say so, or the line read as
    # if the whole model had gone dense (a user trial took it so).
    logger.info("GGUF %s: tensor types %s, %s dequantized to %s", os.path.basename(gguf_path), ", ".join(kinds),
                "the tensors not running on their blocks" if skip else "every tensor", str(dtype).removeprefix("torch."))
    for t in tensors:
        hf_name = gguf_to_hf_name(t.name, arch)
        if hf_name is None:
            logger.debug("skipping GGUF tensor %s", t.name)
            continue
        if _all_skipped(hf_name, t, skip):
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"cannot dequantize GGUF tensor {t.name} of type "
                             f"{t.tensor_type.name}: {e}") from e
        if arch in _NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
            w = w - 1.0
        if arch == "llama":
            if ".attn_q." in t.name:
                w = reverse_permute(w, n_head)
            elif ".attn_k." in t.name:
                w = reverse_permute(w, n_kv)
        if hf_name.endswith(".shared_expert_gate.weight") and w.ndim == 1:  # [hidden] -> HF's [1, hidden]
            w = w.reshape(1, -1)
        if packed is not None:
            _keep_packed(packed, hf_name, t, arch, n_head, n_kv)
        experts = _expert_names(hf_name, t)
        if experts is not None:  # [E, out, in]: one tensor per expert
            for e, name in enumerate(experts):
                yield name, torch.from_numpy(np.array(w[e])).to(dtype)
            continue
        w = np.ascontiguousarray(w)
        if not w.flags.writeable:  # float32 tensors come straight from the read-only memmap
            w = w.copy()
        yield hf_name, torch.from_numpy(w).to(dtype)


def check_tensor_types(tensors: list[GGUFTensorInfo]) -> None:
    """Refuse, before any weight is read, a GGUF file holding a tensor llmserve uses in a
    type it cannot run (neither packed nor dequantizable by ``gguf.quants``, e.g. Q8_K,
    the activations' type): ValueError naming the tensor and type and listing the
    supported types (llama.cpp's ``ggml`` type names)."""
    supported = set(supported_tensor_types())
    for t in tensors:
        if gguf_to_hf_name(t.name) is not None and t.tensor_type.name not in supported:
            packed = ", ".join(packed_tensor_types())
            others = ", ".join(sorted(supported - set(packed_tensor_types())))
            raise ValueError(f"GGUF tensor {t.name} has type {t.tensor_type.name}, which llmserve "
                             f"cannot run; supported: {packed} (packed int8-activation kernels), "
                             f"{others} (dequantized)")


def packed_tensor_types() -> list[str]:
    """GGUF tensor types whose blocks run packed (``llmserve.models.packed``)."""
    from gguf import GGMLQuantizationType

    from llmserve.ops.kquant import KQUANT_TYPES
    from llmserve.ops.quant_ops import PACKED_TYPES
    return [GGMLQuantizationType(t).name for t in sorted({*PACKED_TYPES, *KQUANT_TYPES})]


def supported_tensor_types() -> list[str]:
    """GGUF tensor types llmserve loads: plain floats and integers, and every quantized
    type ``gguf.quants`` dequantizes (the packed ones among them)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits
    return sorted({*_PLAIN_DTYPES, "BF16", *(GGMLQuantizationType(t).name for t in _type_traits)})


def _keep_packed(packed: dict, hf_name: str, t: GGUFTensorInfo, arch: str, n_head: int, n_kv: int) -> None:
    """Store a quantized 2-d tensor's raw blocks (rows un-permuted like the floats), and a
    3-d expert stack's (``[experts, rows, row_bytes]``, llama.cpp's ``ffn_*_exps``) as one
    2-d entry per expert, under the per-expert names the floats are loaded by."""
    import torch

    from llmserve.ops.kquant import KQUANT_TYPES
    from llmserve.ops.quant_ops import PACKED_TYPES

    qtype = int(t.tensor_type)
    if qtype not in PACKED_TYPES and qtype not in KQUANT_TYPES:
        return
    if hf_name.endswith(".shared_expert_gate.weight"):  # one output row: stays a dense GEMV
        return
    experts = _expert_names(hf_name, t)
    if experts is not None:
        for e, name in enumerate(experts):
            packed[name] = (qtype, torch.from_numpy(np.array(t.data[e], dtype=np.uint8, copy=True)))
        return
    if t.data.ndim != 2:
        return
    raw = t.data
    if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
        raw = reverse_permute(raw, n_head if ".attn_q." in t.name else n_kv)
    packed[hf_name] = (qtype, torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)))
