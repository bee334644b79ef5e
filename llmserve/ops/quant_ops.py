"""Linear layers on GGUF-packed weights for small steps (issue 16), C++ in
``csrc/quant_gemv.cpp``, built on first use like :mod:`llmserve.ops.cpu_ops` but as its own
extension (so editing either does not rebuild the other).

At batch 1 a decode step reads every weight once; SmolLM2-135M in bfloat16 is ~270 MB per
step, as Q4_1 blocks ~85 MB. llama.cpp keeps the file's blocks and so reads ~3x fewer
bytes. :class:`QuantWeight` does the same for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL (ggml
type ids 2, 3, 6, 7, 8, 20; the K-quants are :mod:`llmserve.ops.kquant`),
repacked once into codes and float16 scales that reproduce the file's values exactly.
Its kernel quantizes each 32-value block of the activations to int8 and takes the integer
dot products on AVX512-VNNI, as llama.cpp does, or on AVX2 + FMA + F16C (``csrc/simd16.h``);
on other CPUs :func:`get_quant_ops` returns None and the model keeps its dense GEMMs.
``LLMSERVE_PACKED_WEIGHTS=0`` turns the packed path off.
"""
from __future__ import annotations

import functools
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from llmserve import envs
from llmserve.ops.cpu_ops import _cpu_signature, load_small_extension

logger = logging.getLogger(__name__)

_SOURCE = "quant_gemv.cpp"
_NAME = "llmserve_quant_ops"
# ggml type id -> (bytes per 32-weight block); gguf.GGMLQuantizationType values.
PACKED_TYPES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 20: 18}  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL


def packed_isa(cpu_flags: str) -> bool:
    """Whether the packed kernels build for a CPU with these ``/proc/cpuinfo`` flags:
    AVX512-VNNI, or AVX2 with FMA and F16C (``csrc/simd16.h``: AMD Zen 2/3 and
    Intel client cores, where the int8 dot products take two AVX2 ops per VNNI one)."""
    flags = set(cpu_flags.split())
    return "avx512_vnni" in flags or {"avx2", "fma", "f16c"} <= flags


@functools.lru_cache(maxsize=1)
def get_quant_ops() -> Optional[Any]:
    """The compiled module, or None (neither AVX512-VNNI nor AVX2 + FMA + F16C, no compiler,
    ``LLMSERVE_PACKED_WEIGHTS=0``).

    - ``quant_repack(w uint8 [N, K/32*bb], qtype) -> [codes, dm]``: GGUF rows into the
      kernel's layout (:class:`QuantWeight`).
    - ``quant_linear(x [M, K], codes, dm, bits, n, out_float=False) -> [M, n]``: x
      float32 / bfloat16 / float16, quantized per 32-block to int8; float32 sums, the
      result in x's dtype or float32 with ``out_float``.
    - ``quant_rows(codes, dm, bits, n, ids int64 [T]) -> float32 [T, K]``: rows, exact.
    - ``quant_dequantize(w, qtype) -> float32 [N, K]``: the exact gguf dequantization.
    All raise RuntimeError for a shape or type mismatch.
    """
    if envs.get("LLMSERVE_PACKED_WEIGHTS", "1") == "0" or not packed_isa(_cpu_signature()):
        return None
    # The shared loader (as the LoRA and KV tier extensions): the cached .so without
    # cpp_extension's checks, else a build announced as the others are (`make` printed no
    # "Building ..." line for this one). Its own switch is LLMSERVE_PACKED_WEIGHTS, above.
    return load_small_extension(_NAME, _SOURCE, "quant_ops", "packed-weight kernels", "the bfloat16 GEMMs",
                                ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"], ["-fopenmp"],
                                env_switch=None)


@dataclass(frozen=True)
class QuantWeight:
    """A linear layer's GGUF-quantized weight ``[n, K]`` in the kernel's layout
    (``csrc/quant_gemv.cpp``): rows in groups of 16 interleaved per 32-weight block,
    ``codes`` uint8 ``[ceil(n/16), K/32, 256]`` (4-bit types), ``[..., 320]`` (5-bit: Q5_0,
    Q5_1) or ``[..., 512]`` (Q8_0, IQ4_NL), ``dm`` int16 (float16 bits) ``[ceil(n/16), K/32,
    32]`` (16 d then 16 m: Q4_1, Q5_1) or ``[..., 16]`` (d; the symmetric Q4_0, Q5_0, Q8_0 and
    IQ4_NL, whose m = -2^(bits-1) d the kernel derives); ``bits`` 4, 5 or 8. Source:
    llama.cpp's ``ggml_vec_dot_q4_1_q8_1`` numerics (int8 activations per 32-block) and its
    interleaved ``Q4_0_8x8`` repacking idea; vLLM has no CPU GGUF kernel."""

    codes: torch.Tensor
    dm: torch.Tensor
    bits: int
    n: int

    @classmethod
    def from_gguf(cls, blocks: torch.Tensor, qtype: int) -> "QuantWeight":
        """From the file's blocks (uint8 ``[N, K/32*block_bytes]``, ggml type ``qtype``);
        raises RuntimeError for another type or a row that is not whole blocks."""
        codes, dm = get_quant_ops().quant_repack(blocks.contiguous(), qtype)
        return cls(codes, dm, 4 if qtype in (2, 3) else 5 if qtype in (6, 7) else 8, blocks.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.dm.shape[1] * 32

    def linear(self, x: torch.Tensor, out_float: bool = False, hook: int = 0) -> torch.Tensor:
        """``x [M, K] @ W.T`` -> ``[M, n]`` in x's dtype (float32 with ``out_float``).
        ``hook``: the address of a ``LinearHook`` run by each of the GEMM's threads around
        its output columns (``csrc/quant_gemv.cpp``; ``LoRAModule.hook_address()``, armed by
        ``LoRAModule.arm`` for these rows and columns, else RuntimeError), 0 for none."""
        return get_quant_ops().quant_linear(x, self.codes, self.dm, self.bits, self.n, out_float, hook)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``) of W, dequantized exactly: float32 ``[T, K]`` (the
        embedding lookup of a tied head). Raises RuntimeError for an id out of range."""
        return get_quant_ops().quant_rows(self.codes, self.dm, self.bits, self.n, ids)


# packed_switch_point's answer when the packed kernel takes every step: packed layers then
# drop their dense copies (models/packed.py).
ALL_STEPS = 1 << 62
# The packed kernel counts as winning at a size when it takes at most this much longer
# than the GEMM: its 0.93-0.96x at 256+ rows was within a busy machine's noise of 1x, and
# a flip would keep ~270 MiB of dense copies (SmolLM2) for a few % of large-step time.
ALL_STEPS_SLACK = 1.15


def packed_switch_point(k: int, n: int, dtype: torch.dtype) -> int:
    """Steps of up to how many tokens the packed kernel takes on this CPU (``ALL_STEPS``:
    every step). A table first, the timing probe where the table has no entry: CPUs with
    AVX512-VNNI and no AMX take every step (measured on an AMD EPYC: 2x oneDNN's bfloat16
    GEMM speed at 1 row, 0.8-0.96x its time at 16-2048 rows; a timing probe there gave a
    different answer on each start of a busy machine, and with it greedy output that
    changed across restarts and with the batch, since the two kernels round differently);
    with AMX, whose bfloat16 tiles speed oneDNN's large GEMMs up several times, the
    switch point is measured (:func:`probe_max_rows`)."""
    if "amx_bf16" not in _cpu_signature():
        return ALL_STEPS
    return probe_max_rows(k, n, dtype)


def probe_max_rows(k: int, n: int, dtype: torch.dtype, candidates=(1, 16, 256),
                   iters: int = 5, stream_bytes: int = 64 << 20) -> int:
    """The largest step size (rows) in ``candidates`` at which ``quant_linear`` on random
    Q4_1 ``[n, k]`` weights beats the dense GEMM on their ``dtype`` copies (packed for
    oneDNN where the model's are), by the median time ratio of ``iters`` back-to-back pairs
    of passes; within :data:`ALL_STEPS_SLACK` of the GEMM counts as a win. 0: never;
    :data:`ALL_STEPS`: at every size. Measured on the 2-core AMD EPYC (AVX512-VNNI) at
    SmolLM2's MLP shape: the packed kernel beat oneDNN's bfloat16 GEMM at every size, 0.80x
    its time at 32 rows, 0.96x at 512 and 2048; ~0.3 s.

    Each pass runs over enough copies of the weight (dense copies >= ``stream_bytes``, past
    the last-level cache) that weights stream from memory as a model's layers do: with one
    weight that stays in cache, oneDNN's bfloat16 GEMM won at every size, yet a batch-1
    decode step took 9.8 ms on it against 5.9 ms on the packed blocks, which read 3.5x fewer
    bytes. Run once at model load, so the switch point is this machine's. Each pair runs
    both kernels back to back, so a busy machine slows both alike and their ratio holds (the
    fastest of 3 passes each, the rule before, chose 1 row in 1 of 3 probes at load 3.5)."""
    from llmserve.ops import batch_invariant, onednn_linear

    ops = get_quant_ops()
    if ops is None:
        return 0
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (n, k // 32 * 20), dtype=torch.uint8, generator=g)
    w.view(n, k // 32, 20)[:, :, 1] = 0x2C  # small float16 d and m (no inf/nan)
    w.view(n, k // 32, 20)[:, :, 3] = 0x2C
    dense = ops.quant_dequantize(w, 3).to(dtype)
    copies = max(1, -(-stream_bytes // (dense.numel() * dense.element_size())))
    quant = [QuantWeight.from_gguf(w, 3) for _ in range(copies)]
    denses = [onednn_linear.pack_or_keep(dense.clone()) for _ in range(copies)]  # as the model runs them
    best = 0
    for m in candidates:
        x = torch.randn(m, k, generator=g).to(dtype)
        passes = (lambda: [q.linear(x) for q in quant],
                  lambda: [batch_invariant.linear(x, d) for d in denses])
        ratios = []
        for it in range(iters + 1):  # the first pair warms up
            t = []
            for run in passes:
                t0 = time.perf_counter()
                run()
                t.append(time.perf_counter() - t0)
            if it:
                ratios.append(t[0] / t[1])
        if statistics.median(ratios) > ALL_STEPS_SLACK:
            break
        best = m
    return ALL_STEPS if best == candidates[-1] else best

