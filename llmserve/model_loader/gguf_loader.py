"""Weights from a GGUF file (llama.cpp's format), dequantized into torch tensors.

Reads with ``gguf.GGUFReader``, dequantizes with ``gguf.quants.dequantize`` (float32), maps
llama.cpp tensor names to HF names and, for the ``llama`` GGUF architecture, undoes the
q/k row permutation ``convert_hf_to_gguf.py`` applies, exactly as transformers'
``LlamaTensorProcessor`` does, so the weights equal those of
``AutoModelForCausalLM.from_pretrained(path, gguf_file=...)``.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Iterator, Optional

import numpy as np
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
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> Optional[str]:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for
    tensors llmserve does not use (e.g. ``rope_freqs.weight``)."""
    m = _BLOCK_RE.match(name)
    if m:
        part = _BLOCK_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, suffix = name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return None if hf is None else f"{hf}.{suffix}"


def reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: rows grouped per head as (dim/2, 2) -> (2, dim/2)."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def iterate_gguf_weights(gguf_path: str, hf_config: Any,
                         dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for the GGUF file's tensors, dequantized to ``dtype``.

    hf_config supplies ``num_attention_heads`` / ``num_key_value_heads`` for the q/k
    un-permutation (applied when the GGUF ``general.architecture`` is ``llama``).
    Raises ValueError for a tensor type the gguf package cannot dequantize.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    n_head = int(hf_config.num_attention_heads)
    n_kv = int(getattr(hf_config, "num_key_value_heads", None) or n_head)
    for t in reader.tensors:
        hf_name = gguf_to_hf_name(t.name)
        if hf_name is None:
            logger.debug("skipping GGUF tensor %s", t.name)
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"cannot dequantize GGUF tensor {t.name} of type "
                             f"{t.tensor_type.name}: {e}") from e
        if arch == "llama":
            if ".attn_q." in t.name:
                w = reverse_permute(w, n_head)
            elif ".attn_k." in t.name:
                w = reverse_permute(w, n_kv)
        w = np.ascontiguousarray(w)
        if not w.flags.writeable:  # float32 tensors come straight from the read-only memmap
            w = w.copy()
        yield hf_name, torch.from_numpy(w).to(dtype)
