"""GGUF K-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) in the packed kernels' layout
(issue 30), run by ``kquant_linear`` in ``csrc/quant_gemv.cpp`` with int8 activations on
AVX512-VNNI, as :class:`llmserve.ops.quant_ops.QuantWeight` runs Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0.

Every K-quant value has one form, per 16-value half of a 32-value block and per 256-value
super-block (ggml's ``block_q*_K``, decoded as ``gguf.quants`` decodes it)::

    w = (d * sc) * (code - z) - dmin * mn        (float32 steps, d / dmin float16)

| type | code bits (tile) | sc per | mn | z |
| --- | --- | --- | --- | --- |
| Q2_K | 2 (4-bit tile) | 16 values, 4-bit | 4-bit | 0 |
| Q3_K | 3 (4-bit tile) | 16, signed 6-bit | 0 | 4 |
| Q4_K | 4 (4-bit tile) | 32, 6-bit | 6-bit | 0 |
| Q5_K | 5 (5-bit tile) | 32, 6-bit | 6-bit | 0 |
| Q6_K | 6 (8-bit tile) | 16, int8 | 0 | 32 |

:func:`unpack_blocks` decodes the file's blocks into that form with numpy (codes, per-half
sc / mn, per-super-block d / dmin); :meth:`KQuantWeight.from_gguf` tiles it for the kernel
in torch (the tile order of ``quant_repack``: 16 rows interleaved per 32-value block).
:func:`dequantize_reference` and :func:`linear_reference` are the pure-torch references
the tests compare the kernels with; ``gguf.quants.dequantize`` is the ground truth.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

QK_K = 256
RG = 16  # rows per group in the kernel's layout
# ggml type id -> (name, bytes per 256-value super-block, code tile bits, code offset z).
KQUANT_TYPES = {10: ("Q2_K", 84, 4, 0), 11: ("Q3_K", 110, 4, 4), 12: ("Q4_K", 144, 4, 0),
                13: ("Q5_K", 176, 5, 0), 14: ("Q6_K", 210, 8, 32)}


class KQuantParts(NamedTuple):
    """A K-quant matrix ``[N, K]`` decoded: ``codes`` uint8 ``[N, K]`` (value ``code - z``),
    ``sc`` / ``mn`` int8 ``[N, K/16]`` (per 16 values), ``d`` / ``dmin`` float16
    ``[N, K/256]``, ``z`` the code offset."""

    codes: np.ndarray
    sc: np.ndarray
    mn: np.ndarray
    d: np.ndarray
    dmin: np.ndarray
    z: int


def _halves(a: np.ndarray) -> np.ndarray:
    """Per-32 values ``[n, 8]`` -> per-16 ``[n, 16]`` (each twice)."""
    return np.repeat(a, 2, axis=-1)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _q4k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from gguf.quants import Q4_K
    return Q4_K.get_scale_min(np.ascontiguousarray(s))


def _nibbles(qs: np.ndarray, groups: int, width: int) -> np.ndarray:
    """``qs [n, groups*width]`` -> ``[n, groups*2*width]``: each group's low nibbles, then high."""
    q = qs.reshape(-1, groups, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(qs.shape[0], -1)


def _unpack_q4k(b: np.ndarray, five: bool) -> tuple:
    n = b.shape[0]
    sc, mn = _q4k_scales(b[:, 4:16])
    if five:
        qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        codes = _nibbles(b[:, 48:], 4, 32) | ((qh & 1).reshape(n, QK_K) << 4)
    else:
        codes = _nibbles(b[:, 16:], 4, 32)
    return codes, _halves(sc), _halves(mn), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _unpack_q6k(b: np.ndarray) -> tuple:
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = ql | ((qh & 3).reshape(n, QK_K) << 4)
    zero = np.zeros((n, 16), np.int8)
    return codes, b[:, 192:208].view(np.int8), zero, _f16(b[:, 208:210]), np.zeros(n, np.float16)


def _unpack_q3k(b: np.ndarray) -> tuple:
    n = b.shape[0]
    s = b[:, 96:108]
    lo = (s[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hi = (s[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 3) << 4)).astype(np.int8) - np.int8(32)
    ql = b[:, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    hm = b[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = (ql & 3).reshape(n, QK_K) | ((hm & 1).reshape(n, QK_K) << 2)  # q = code - 4
    return codes, sc, np.zeros((n, 16), np.int8), _f16(b[:, 108:110]), np.zeros(n, np.float16)


def _unpack_q2k(b: np.ndarray) -> tuple:
    n = b.shape[0]
    q = b[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    s = b[:, :16]
    return ((q & 3).reshape(n, QK_K), (s & 0x0F).astype(np.int8), (s >> 4).astype(np.int8),
            _f16(b[:, 80:82]), _f16(b[:, 82:84]))


_UNPACK = {10: _unpack_q2k, 11: _unpack_q3k, 12: lambda b: _unpack_q4k(b, False),
           13: lambda b: _unpack_q4k(b, True), 14: _unpack_q6k}


def unpack_blocks(raw: np.ndarray, qtype: int) -> KQuantParts:
    """Decode K-quant rows (uint8 ``[N, K/256*block_bytes]``, ggml type ``qtype``) into
    :class:`KQuantParts`. Raises ValueError for another type or a row that is not whole
    super-blocks."""
    if qtype not in KQUANT_TYPES:
        raise ValueError(f"not a K-quant GGML type: {qtype}")
    _, bb, _, z = KQUANT_TYPES[qtype]
    n, row = raw.shape
    if row % bb:
        raise ValueError(f"a row of {row} bytes is not whole {KQUANT_TYPES[qtype][0]} blocks of {bb}")
    nsb = row // bb
    codes, sc, mn, d, dmin = _UNPACK[qtype](np.ascontiguousarray(raw).reshape(n * nsb, bb))
    return KQuantParts(codes.astype(np.uint8).reshape(n, nsb * QK_K), sc.astype(np.int8).reshape(n, nsb * 16),
                       mn.astype(np.int8).reshape(n, nsb * 16), d.reshape(n, nsb), dmin.reshape(n, nsb), z)


def dequantize_reference(p: KQuantParts) -> torch.Tensor:
    """float32 ``[N, K]``: ``(d * sc) * (code - z) - dmin * mn`` in float32 steps (pure
    torch; equals ``gguf.quants.dequantize`` of the blocks bit for bit)."""
    n, k = p.codes.shape
    d = torch.from_numpy(p.d.astype(np.float32)).repeat_interleave(16, 1)
    dmin = torch.from_numpy(p.dmin.astype(np.float32)).repeat_interleave(16, 1)
    scale = (d * torch.from_numpy(p.sc).float()).repeat_interleave(16, 1)
    off = (dmin * torch.from_numpy(p.mn).float()).repeat_interleave(16, 1)
    return scale * (torch.from_numpy(p.codes).float() - p.z) - off


def linear_reference(x: torch.Tensor, p: KQuantParts) -> torch.Tensor:
    """What ``kquant_linear`` computes, in float64 (the tests' reference): each 32-block of
    ``x [M, K]`` rounded to int8 steps (q_x = round(x * 127 / max|x|), d_x = max|x| / 127),
    times the exact weights. Returns float64 ``[M, N]``."""
    m, k = x.shape
    xf = x.float().view(m, k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    qx = torch.where(amax > 0, torch.round(xf * 127 / amax), torch.zeros_like(xf))
    return (qx.double() * (amax / 127).double()).view(m, k) @ dequantize_reference(p).double().T


def _tiles(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[G*16, K]`` -> ``[G, K/32, 256, 320 or 512]`` in ``quant_repack``'s tile order."""
    g, nb = codes.shape[0] // RG, codes.shape[1] // 32
    if bits == 8:  # byte (k/4)*64 + l*4 + k%4
        return codes.view(g, RG, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 512).contiguous()
    if bits == 5:  # the low nibbles' 4-bit tile, then byte l*4 + i holding bit 4 of code 4j + i in bit j
        hi = ((codes.view(g, RG, nb, 8, 4) >> 4) & 1) << torch.arange(8, dtype=torch.uint8).view(1, 1, 1, 8, 1)
        hi = hi.sum(3, dtype=torch.uint8).permute(0, 2, 1, 3).reshape(g, nb, 64)
        return torch.cat([_tiles(codes & 0x0F, 4), hi], 2).contiguous()
    t = codes.view(g, RG, nb, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # [g, nb, half, chunk, row, 4]
    return (t[:, :, 0] | (t[:, :, 1] << 4)).reshape(g, nb, 256).contiguous()


def _pad_rows(a: np.ndarray, rows: int) -> torch.Tensor:
    out = np.zeros((rows,) + a.shape[1:], dtype=a.dtype)
    out[:a.shape[0]] = a
    return torch.from_numpy(out)


@dataclass(frozen=True)
class KQuantWeight:
    """A linear layer's K-quant weight ``[n, K]`` in the kernel's layout (``csrc/quant_gemv.cpp``,
    above ``KPacked``): ``codes`` uint8 ``[ceil(n/16), K/32, 256, 320 or 512]``, ``sc`` int8
    ``[ceil(n/16), K/32, 64]`` (per block the 16 rows' half-block scales, then mins),
    ``dd`` int16 (float16 bits) ``[ceil(n/16), K/256, 32]`` (d, dmin), ``bits`` 4, 5 or 8,
    ``z`` the code offset. Same interface as ``QuantWeight`` (``linear``, ``rows``,
    ``shape``). Source: ggml's ``block_q*_K`` formats and llama.cpp's
    ``ggml_vec_dot_q*_K_q8_K`` numerics (int8 activations, integer sums per sub-block)."""

    codes: torch.Tensor
    sc: torch.Tensor
    dd: torch.Tensor
    bits: int
    z: int
    n: int

    @classmethod
    def from_parts(cls, p: KQuantParts, bits: int) -> "KQuantWeight":
        n, k = p.codes.shape
        g = -(-n // RG)
        codes = _tiles(_pad_rows(p.codes, g * RG), bits)
        sc = torch.cat([_pad_rows(p.sc, g * RG).view(g, RG, k // 32, 2).permute(0, 2, 3, 1),
                        _pad_rows(p.mn, g * RG).view(g, RG, k // 32, 2).permute(0, 2, 3, 1)], 2)
        dd = torch.cat([_pad_rows(p.d.view(np.int16), g * RG).view(g, RG, -1).permute(0, 2, 1),
                        _pad_rows(p.dmin.view(np.int16), g * RG).view(g, RG, -1).permute(0, 2, 1)], 2)
        return cls(codes, sc.reshape(g, k // 32, 64).contiguous(), dd.contiguous(), bits, p.z, n)

    @classmethod
    def from_gguf(cls, blocks: torch.Tensor, qtype: int) -> "KQuantWeight":
        """From the file's blocks (uint8 ``[N, K/256*block_bytes]``, ggml type ``qtype``);
        raises ValueError for another type or a row that is not whole super-blocks."""
        return cls.from_parts(unpack_blocks(blocks.numpy(), qtype), KQUANT_TYPES[qtype][2])

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.codes.shape[1] * 32

    def linear(self, x: torch.Tensor, out_float: bool = False, hook: int = 0) -> torch.Tensor:
        """``x [M, K] @ W.T`` -> ``[M, n]`` in x's dtype (float32 with ``out_float``);
        ``hook`` as ``QuantWeight.linear``'s."""
        from llmserve.ops.quant_ops import get_quant_ops
        return get_quant_ops().kquant_linear(x, self.codes, self.sc, self.dd, self.bits, self.z, self.n, out_float,
                                             hook)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``) of W, float32 ``[T, K]``, exactly gguf's values.
        Raises RuntimeError for an id out of range."""
        from llmserve.ops.quant_ops import get_quant_ops
        return get_quant_ops().kquant_rows(self.codes, self.sc, self.dd, self.bits, self.z, self.n, ids)


def quant_weight_from_gguf(blocks: torch.Tensor, qtype: int):
    """The packed weight of GGUF rows (uint8 ``[N, row_bytes]``) of ggml type ``qtype``:
    :class:`KQuantWeight` for the K-quants, ``QuantWeight`` for Q4_0 / Q4_1 / Q5_0 / Q5_1 /
    Q8_0. Raises ValueError (K-quants) or RuntimeError for a row that is not whole blocks."""
    from llmserve.ops.quant_ops import QuantWeight
    if qtype in KQUANT_TYPES:
        return KQuantWeight.from_gguf(blocks, qtype)
    return QuantWeight.from_gguf(blocks, qtype)


@dataclass(frozen=True)
class ConcatQuantWeight:
    """Packed weights of different GGUF types stacked by rows (a fused ``qkv_proj`` whose
    ``attn_v`` is Q6_K beside Q4_K ``attn_q`` / ``attn_k``, as in Q4_K_M files): each part
    runs its own kernel, all of them in one parallel region writing their own columns of
    one output (``quant_linear_parts``). Same interface as ``QuantWeight``."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def linear(self, x: torch.Tensor, out_float: bool = False) -> torch.Tensor:
        """``x [M, K] @ W.T`` -> ``[M, sum of rows]``: the parts in one parallel region
        (``quant_linear_parts``; each part's columns the same numbers as its own call)."""
        from llmserve.ops.quant_ops import get_quant_ops

        parts = self.kernel_parts if x.dim() == 2 else None
        if parts is None:
            return torch.cat([p.linear(x, out_float) for p in self.parts], dim=-1)
        return get_quant_ops().quant_linear_parts(x, parts, out_float)

    @functools.cached_property
    def kernel_parts(self) -> Optional[list[tuple]]:
        """:func:`packed_parts` of this weight, made once (it ran on every call)."""
        return packed_parts(self)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``), float32 ``[T, K]``, exact. RuntimeError when out of range."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.shape[0]):
            raise RuntimeError(f"rows: id out of range [0, {self.shape[0]})")
        out = torch.empty(ids.shape[0], self.shape[1], dtype=torch.float32)
        start = 0
        for p in self.parts:
            mask = (ids >= start) & (ids < start + p.shape[0])
            if bool(mask.any()):
                out[mask] = p.rows(ids[mask] - start)
            start += p.shape[0]
        return out


def packed_parts(qweight: Any) -> Optional[list[tuple]]:
    """A packed weight as ``quant_linear_parts`` tuples ``(kquant, codes, scales, dd, bits, z,
    n)`` (``csrc/packed_linear.h``), one per GGUF type run of its rows, or None for a weight
    kind the multi-part kernel lacks."""
    from llmserve.ops.quant_ops import QuantWeight

    if isinstance(qweight, ConcatQuantWeight):
        parts = [packed_parts(p) for p in qweight.parts]
        return None if any(p is None for p in parts) else [t for p in parts for t in p]
    if type(qweight) is QuantWeight:
        return [(0, qweight.codes, qweight.dm, torch.empty(0, dtype=torch.int16), qweight.bits, 0, qweight.n)]
    if type(qweight) is KQuantWeight:
        return [(1, qweight.codes, qweight.sc, qweight.dd, qweight.bits, qweight.z, qweight.n)]
    return None
