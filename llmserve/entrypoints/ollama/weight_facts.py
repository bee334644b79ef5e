"""The two facts Ollama's ``details`` give of a model's weights: the quantization level
(GGUF file type name, e.g. "Q4_1", "Q4_K_M", "F16"; a safetensors dtype, e.g. "BF16")
and the parameter count in Ollama's words (``format.HumanNumber``: "135M", "134.52M",
"1.2B").

Both come from the weight files served: a GGUF file's ``general.file_type`` and tensor
shapes (the fast header parser of ``gguf_loader``, ~0.1 s for a 98 MB file; cached per
file and modification time), a safetensors file's JSON header (dtypes and shapes, no
tensor data read). When the files cannot be read (``.bin`` checkpoints, a damaged file)
the model config gives them instead (``dtype`` and a count from the layer shapes), so
neither is ever empty.
"""
from __future__ import annotations

import functools
import logging
import os
import struct
from collections import Counter
from typing import Any, NamedTuple, Optional

logger = logging.getLogger(__name__)

# torch dtype names (ModelConfig.dtype, config.json torch_dtype) -> safetensors/Ollama names.
_DTYPE_NAMES = {"float32": "F32", "float": "F32", "float16": "F16", "half": "F16", "bfloat16": "BF16",
                "float64": "F64"}
# A safetensors header is JSON of at most this many bytes (the format's own 100 MB limit).


class WeightFacts(NamedTuple):
    """``level``: Ollama's ``quantization_level`` ("Q4_1", "BF16", ...), "" if unknown;
    ``params``: number of weights (elements of every tensor), 0 if unknown; ``arch``: a
    GGUF file's ``general.architecture`` ("gemma3" where transformers says "gemma3_text",
    "llama" for a Mixtral file), "" for other weights or when unread."""
    level: str
    params: int
    arch: str = ""


def human_number(n: int) -> str:
    """A count as Ollama's ``format.HumanNumber`` writes it: whole billions/millions
    without decimals ("2B", "135M"), else one decimal for billions ("1.2B") and two for
    millions ("134.52M"), thousands rounded ("12K"), smaller counts as they are."""
    if n >= 1_000_000_000:
        x = n / 1_000_000_000
        return f"{x:.0f}B" if x == int(x) else f"{x:.1f}B"
    if n >= 1_000_000:
        x = n / 1_000_000
        return f"{x:.0f}M" if x == int(x) else f"{x:.2f}M"
    if n >= 1_000:
        return f"{n / 1_000:.0f}K"
    return str(n)


def gguf_file_type_name(file_type: Optional[int], tensor_types: Counter) -> str:
    """Ollama's name of a GGUF file type (``general.file_type``, llama.cpp's
    ``LlamaFileType``: 3 -> "Q4_1", 15 -> "Q4_K_M", 1 -> "F16"); without that key, the type
    of most tensors (``tensor_types``: GGML type name -> count)."""
    from gguf import LlamaFileType

    if file_type is not None:
        try:
            name = LlamaFileType(int(file_type)).name
        except ValueError:
            name = ""
        if name and name != "GUESSED":
            return name.removeprefix("ALL_").removeprefix("MOSTLY_")
    return tensor_types.most_common(1)[0][0] if tensor_types else ""


@functools.lru_cache(maxsize=16)
def _gguf_facts(path: str, mtime: float) -> WeightFacts:
    """Facts of one GGUF file (``mtime`` keys the cache to the file's version)."""
    from gguf import GGML_QUANT_SIZES

    from llmserve.model_loader.gguf_loader import read_gguf_tensors

    meta: dict[str, Any] = {"general.file_type": None}
    arch, tensors = read_gguf_tensors(path, meta)
    types: Counter = Counter()
    params = 0
    for t in tensors:
        types[t.tensor_type.name] += 1
        if t.tensor_type in GGML_QUANT_SIZES and t.tensor_type.name not in ("F32", "F16", "BF16", "F64"):
            block, type_size = GGML_QUANT_SIZES[t.tensor_type]
            params += t.data.nbytes * block // type_size  # data holds the raw blocks
        else:
            params += t.data.size
    return WeightFacts(gguf_file_type_name(meta["general.file_type"], types), params, arch or "")


def _safetensors_shapes(path: str) -> list[tuple[str, list[int]]]:
    """``(dtype, shape)`` of each tensor of a safetensors file, from its header only
    (the safetensors library's ``safe_open``; no tensor data is read). Raises
    OSError, or ValueError for a malformed file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            return [(f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()]
    except SafetensorError as e:
        raise ValueError(f"{path}: {e}") from e


@functools.lru_cache(maxsize=16)
def _safetensors_facts(folder: str, mtime: float) -> WeightFacts:
    """Facts of a folder's ``*.safetensors`` files: the dtype of most weights (by element
    count) and the element count of all tensors."""
    by_dtype: Counter = Counter()
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        for dtype, shape in _safetensors_shapes(os.path.join(folder, name)):
            n = 1
            for d in shape:
                n *= int(d)
            by_dtype[str(dtype)] += n
    level = by_dtype.most_common(1)[0][0] if by_dtype else ""
    return WeightFacts(level, sum(by_dtype.values()))


def _count_from_config(hf: Any) -> int:
    """Weights of a decoder from its shapes (embeddings, attention, MLP; norms and biases
    left out, under 0.1% of a model): used only when no weight file can be read."""
    h, layers = getattr(hf, "hidden_size", 0) or 0, getattr(hf, "num_hidden_layers", 0) or 0
    vocab, inter = getattr(hf, "vocab_size", 0) or 0, getattr(hf, "intermediate_size", 0) or 0
    heads = getattr(hf, "num_attention_heads", 0) or 0
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or (h // heads if heads else 0)
    attn = h * head_dim * (2 * heads + 2 * kv_heads)
    embed = vocab * h * (1 if getattr(hf, "tie_word_embeddings", True) else 2)
    return embed + layers * (attn + 3 * h * inter)


def _dtype_name(config: Any) -> str:
    """The served dtype in safetensors/Ollama words ("F32", "BF16"), from the config."""
    dtype = getattr(config.hf_config, "torch_dtype", None) if config.dtype in (None, "auto") else config.dtype
    text = str(dtype or "float32").removeprefix("torch.")
    return _DTYPE_NAMES.get(text, text.upper())


def weight_facts(config: Any, weights_path: str) -> WeightFacts:
    """Quantization level and parameter count of the model served from ``weights_path``
    (a GGUF file or a model folder), each taken from the config when the files do not
    give it. ``config``: the ModelConfig (``quantization``, ``dtype``, ``hf_config``)."""
    facts = WeightFacts("", 0)
    try:
        mtime = os.path.getmtime(weights_path)
        if os.path.isfile(weights_path) and weights_path.endswith(".gguf"):
            facts = _gguf_facts(weights_path, mtime)
        elif os.path.isdir(weights_path):
            facts = _safetensors_facts(weights_path, mtime)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        logger.info("cannot read the weight facts of %s (%s); taking them from the config", weights_path, e)
    level = facts.level
    if config.quantization and not getattr(config, "gguf_file", None):
        level = str(config.quantization).upper()  # packed ints (GPTQ/AWQ) say nothing of the scheme
    return WeightFacts(level or _dtype_name(config), facts.params or _count_from_config(config.hf_config),
                       facts.arch)
