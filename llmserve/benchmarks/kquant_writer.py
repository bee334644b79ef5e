"""A GGUF K-quant writer (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_NL) for the tests and the K-quant
benchmark, so neither needs a llama.cpp build (issue 30).

The rounding is simple per-block min/max, not ggml's iterative ``make_qkx2_quants``
search: the bytes are valid ggml blocks (``gguf.quants.dequantize`` decodes them, the
tests check the round trip), a little less accurate than llama.cpp's. Q4_0 ... Q8_0 come
from ``gguf.quants.quantize``. :func:`q4_k_m_type` picks each tensor's type the way
llama.cpp's ``llama-quantize`` does for ``Q4_K_M`` (simplified: ``attn_v`` and
``ffn_down`` of every other layer in Q6_K, the output in Q6_K, and a row length that is not
whole 256-value super-blocks falls back to Q5_0 / Q5_1 / Q8_0 / IQ4_NL).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import numpy as np

QK_K = 256
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
# llama.cpp's fallback for rows that are not whole super-blocks (llama-quant.cpp).
FALLBACK = {Q2_K: IQ4_NL, Q3_K: IQ4_NL, Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}


def _f16(a: np.ndarray) -> np.ndarray:
    """float values ``[n]`` -> float16 bytes ``[n, 2]``."""
    return a.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def _affine(x: np.ndarray, sub: int, qmax: int, smax: int):
    """Per ``sub``-value sub-block scale and min (value = d*sc*q - dmin*m), both quantized
    to ``smax`` levels against the super-block's float16 d / dmin. x ``[n, 256]``."""
    n = x.shape[0]
    xs = x.reshape(n, -1, sub)
    lo = np.minimum(xs.min(-1), 0)
    scale = (xs.max(-1) - lo) / qmax
    d = (scale.max(-1) / smax).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1) / smax).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_div(scale, d[:, None])), 0, smax).astype(np.uint8)
    m = np.clip(np.round(_div(-lo, dmin[:, None])), 0, smax).astype(np.uint8)
    step = d[:, None] * sc
    q = np.clip(np.round(_div(xs + (dmin[:, None] * m)[..., None], step[..., None])), 0, qmax)
    return q.astype(np.uint8).reshape(n, QK_K), sc, m, d, dmin


def _symmetric(x: np.ndarray, qhalf: int, smax: int):
    """Per 16 values a signed scale (|sc| <= smax) on the float16 d; codes q + qhalf."""
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    idx = np.abs(xs).argmax(-1)[..., None]
    scale = -np.take_along_axis(xs, idx, -1)[..., 0] / qhalf  # the extreme value maps to -qhalf
    d = (np.abs(scale).max(-1) / smax).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_div(scale, d[:, None])), -smax, smax).astype(np.int8)
    step = d[:, None] * sc
    q = np.clip(np.round(_div(xs, step[..., None])), -qhalf, qhalf - 1) + qhalf
    return q.astype(np.uint8).reshape(n, QK_K), sc, d


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> ggml's 12 bytes (``get_scale_k4`` order)."""
    s = np.empty((sc.shape[0], 12), np.uint8)
    s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return s


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes ``[n, 256]`` -> 128 bytes: per 64 codes, codes i and i + 32 in one byte."""
    c = q.reshape(-1, 4, 2, 32) & 0x0F
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """2-bit values ``[n, 256]`` -> 64 bytes: per 128 values, 4 shifts of 32."""
    c = (q.reshape(-1, 2, 4, 32) & 3) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(c, axis=2).reshape(q.shape[0], 64)


def _bits(q: np.ndarray, bit: int) -> np.ndarray:
    """Bit ``bit`` of codes ``[n, 256]`` -> 32 bytes: byte t bit j = code 32j + t."""
    b = ((q.reshape(-1, 8, 32) >> bit) & 1) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return np.bitwise_or.reduce(b, axis=1)


def _q4_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _affine(x, 32, 15, 63)
    return np.concatenate([_f16(d), _f16(dmin), _pack_k_scales(sc, m), _low_nibbles(q)], 1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _affine(x, 32, 31, 63)
    return np.concatenate([_f16(d), _f16(dmin), _pack_k_scales(sc, m), _bits(q, 4), _low_nibbles(q)], 1)


def _q2_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _affine(x, 16, 3, 15)
    return np.concatenate([sc | (m << 4), _crumbs(q), _f16(d), _f16(dmin)], 1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    q, sc, d = _symmetric(x, 32, 127)
    n = q.shape[0]
    c = q.reshape(n, 2, 2, 64)
    ql = ((c[:, :, 0] & 0x0F) | ((c[:, :, 1] & 0x0F) << 4)).reshape(n, 128)
    return np.concatenate([ql, _crumbs(q >> 4), sc.view(np.uint8), _f16(d)], 1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    q, sc, d = _symmetric(x, 4, 31)
    s6 = (sc.astype(np.int16) + 32).astype(np.uint8)  # stored sc + 32, 6 bits
    s = np.empty((q.shape[0], 12), np.uint8)
    s[:, :8] = (s6[:, :8] & 0x0F) | ((s6[:, 8:] & 0x0F) << 4)
    hi = (s6 >> 4).reshape(-1, 4, 4) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    s[:, 8:] = np.bitwise_or.reduce(hi, axis=1)
    return np.concatenate([_bits(q, 2), _crumbs(q), s, _f16(d)], 1)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    """32-value blocks: d = extreme / -127 (ggml's choice), each value the nearest level."""
    idx = np.abs(x).argmax(-1)[:, None]
    d = (np.take_along_axis(x, idx, -1)[:, 0] / -127).astype(np.float16)
    lv = d.astype(np.float32)[:, None, None] * IQ4_NL_LEVELS
    q = np.abs(lv - x[..., None]).argmin(-1).astype(np.uint8)
    return np.concatenate([_f16(d), q[:, :16] | (q[:, 16:] << 4)], 1)


_QUANTIZE: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k, IQ4_NL: _iq4_nl}


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    """float ``[N, K]`` -> ggml blocks uint8 ``[N, K/block*block_bytes]`` of ``qtype`` (a
    ggml type id). K-quants need K a multiple of 256, the others of 32; raises ValueError
    otherwise."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    if qtype not in _QUANTIZE:
        return gguf_quantize(w, GGMLQuantizationType(qtype))
    block = 32 if qtype == IQ4_NL else QK_K
    if k % block:
        raise ValueError(f"rows of {k} values are not whole {block}-value blocks")
    blocks = _QUANTIZE[qtype](w.reshape(-1, block))
    return blocks.reshape(n, -1)


def q4_k_m_type(gguf_name: str, row: int, n_layers: int) -> Optional[int]:
    """The type ``llama-quantize Q4_K_M`` (simplified) gives tensor ``gguf_name`` with rows
    of ``row`` values, or None to keep it float (norms, biases)."""
    if not gguf_name.endswith(".weight") or "norm" in gguf_name:
        return None
    if gguf_name.startswith("token_embd"):
        return Q8_0
    want = Q4_K
    if gguf_name.startswith("output."):
        want = Q6_K
    elif ".attn_v." in gguf_name or ".ffn_down." in gguf_name:
        layer = int(gguf_name.split(".")[1])
        want = Q6_K if layer % 2 == 0 or layer >= n_layers - 1 else Q4_K
    elif ".ffn_up." in gguf_name:
        want = Q5_K if int(gguf_name.split(".")[1]) % 2 else Q4_K
    return want if row % QK_K == 0 else FALLBACK[want]


def write_gguf(path: str, tensors: Iterable[tuple[str, np.ndarray]], pick: Callable[[str, int], Optional[int]],
               arch: str = "llama", fields: Callable[[object], None] = lambda w: None) -> dict[str, str]:
    """Write ``(gguf_name, float array)`` pairs to a GGUF file at ``path``, each 2-d weight
    in the type ``pick(name, row_length)`` chooses (None: float32). ``fields(writer)`` adds
    metadata (architecture hyper-parameters, tokenizer). Returns name -> type name."""
    import gguf
    w = gguf.GGUFWriter(path, arch)
    fields(w)
    kinds = {}
    for name, a in tensors:
        qtype = pick(name, a.shape[-1]) if a.ndim == 2 else None
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
            kinds[name] = "F32"
        else:
            w.add_tensor(name, quantize(a, qtype), raw_dtype=gguf.GGMLQuantizationType(qtype))
            kinds[name] = gguf.GGMLQuantizationType(qtype).name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kinds
