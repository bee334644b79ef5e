"""The packed-weight kernels beyond AVX512-VNNI (issue 30): CPUs with AVX2 + FMA + F16C only
(AMD Zen 2/3, Intel client cores) build them too (``csrc/simd16.h``), their int16
partial sums never saturate at the extreme codes, dtype "auto" on a CPU without bfloat16
runs quantized files on them, and oneDNN's bfloat16 packing is skipped where it raises."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from llmserve.ops.quant_ops import PACKED_TYPES, QuantWeight, get_quant_ops, packed_isa

ops = get_quant_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason="packed-weight kernels need AVX512-VNNI or AVX2 and a compiler")

ZEN3 = "fpu sse sse2 avx avx2 fma f16c bmi2 vaes"  # an AVX2 CPU's flags (no AVX-512)


def test_packed_isa_takes_avx512_vnni_or_avx2_fma_f16c():
    assert packed_isa(ZEN3)
    assert packed_isa("avx2 fma f16c avx512f avx512bw avx512_vnni")
    assert not packed_isa("sse4_2 avx fma f16c")  # no AVX2
    assert not packed_isa("avx2 f16c")  # no FMA
    assert not packed_isa("avx2 fma")  # no F16C (the float16 scales)


def _extreme_blocks(qtype: int, n: int, nb: int, code_byte: int) -> torch.Tensor:
    """Blocks whose every code byte is ``code_byte`` (the largest or smallest code, or Q8_0's -128) with
    d (and m) = 0.01: each integer dot product at its bound."""
    bb = PACKED_TYPES[qtype]
    raw = np.full((n, nb, bb), code_byte, dtype=np.uint8)
    raw[:, :, 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    if qtype in (3, 7):  # Q4_1, Q5_1: m too
        raw[:, :, 2:4] = np.array([-0.05], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, nb * bb))


def _pm_one_rows(m: int, k: int) -> torch.Tensor:
    """Rows of +1 and -1 (q_x = +-127, the int8 codes' extremes), alternating."""
    return torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(m)]).unsqueeze(1).expand(m, k).contiguous()


@needs_kernels
# 0x00 for the 4- and 5-bit types: code 0, the unpacked tiles' signed code at its most
# negative (-8, -16) against x' = 255
@pytest.mark.parametrize("qtype,code_byte", [(2, 0xFF), (3, 0xFF), (6, 0xFF), (7, 0xFF), (8, 0x80), (20, 0x00),
                                             (2, 0x00), (3, 0x00), (6, 0x00), (7, 0x00)])
@pytest.mark.parametrize("m", [9, 33])  # 33: AVX2's unpacked tiles, x's codes + 128 unsigned
def test_extreme_codes_do_not_saturate(qtype, code_byte, m):
    # AVX2 sums u8 x s8 pairs in int16 (VPMADDUBSW), several before widening: at these codes
    # a saturating sum would be off by thousands of units, not float32 rounding.
    k, n = 256, 24
    raw = _extreme_blocks(qtype, n, k // 32, code_byte)
    w = ops.quant_dequantize(raw, qtype).double()
    x = _pm_one_rows(m, k)
    qw = QuantWeight.from_gguf(raw, qtype)
    got = ops.quant_linear(x, qw.codes, qw.dm, qw.bits, n).double()
    ref = x.double() @ w.T
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_kernels
@pytest.mark.parametrize("qtype,zero_codes", [(10, None), (11, None), (12, None), (13, None), (14, None),
                                              (13, (16, 176)), (14, (0, 192))])
@pytest.mark.parametrize("m", [9, 33])  # 33: AVX2's unpacked tiles, x's codes + 128 unsigned
def test_extreme_kquant_codes_do_not_saturate(qtype, zero_codes, m):
    # zero_codes: the code bytes of Q5_K (qh, qs) and Q6_K (ql, qh) at 0, the unpacked
    # tiles' most negative signed code (-16, -32) against x' = 255, scales still at their largest
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from llmserve.ops.kquant import KQUANT_TYPES, KQuantWeight
    f16_at = {10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}[qtype]
    bb = KQUANT_TYPES[qtype][1]
    raw = np.full((24, 1, bb), 0xFF, dtype=np.uint8)  # every code (and scale) at its largest
    if zero_codes is not None:
        raw[:, :, zero_codes[0]:zero_codes[1]] = 0
    for at in f16_at:
        raw[:, :, at:at + 2] = np.array([0.001], dtype=np.float16).view(np.uint8)
    raw = raw.reshape(24, bb)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType(qtype))).double()
    qw = KQuantWeight.from_gguf(torch.from_numpy(raw), qtype)
    x = _pm_one_rows(m, 256)
    got = qw.linear(x).double()
    ref = x.double() @ w.T
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_bf16_weights_stay_plain_where_onednn_cannot_pack_them(monkeypatch):
    from llmserve.ops import onednn_linear
    monkeypatch.setattr(onednn_linear, "bf16_supported", lambda: False)
    w = torch.randn(8, 16).bfloat16()
    assert onednn_linear.pack(w) is None and onednn_linear.pack_or_keep(w) is w


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, save_tiny_model_fn):
    path = tmp_path_factory.mktemp("isa_model")
    save_tiny_model_fn("llama", str(path))
    return str(path)


def test_auto_dtype_without_bfloat16_runs_quantized_weights_packed(tiny_dir, monkeypatch):
    import llmserve.config as config
    from llmserve import EngineArgs
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: False)

    def model_config(dtype):
        return EngineArgs(model=tiny_dir, tokenizer="SmolLM2-135M-Instruct", device="cpu", max_model_len=128,
                          dtype=dtype).create_engine_config().model_config
    auto = model_config("auto")
    assert auto.dtype == "float32" and auto.packed_float32
    exact = model_config("float32")  # asked for: the exact dense path, as transformers
    assert exact.dtype == "float32" and not exact.packed_float32
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: True)
    assert not model_config("auto").packed_float32  # bfloat16 packs anyway


AVX2_ONLY = """
import sys, torch
from llmserve.ops.cpu_ops import load_small_extension, build_dir_for
import llmserve.ops.cpu_ops as c
c.build_dir_for = lambda source, prefix: build_dir_for(source, prefix + "_avx2test")
m = load_small_extension("llmserve_quant_ops_avx2test", "quant_gemv.cpp", "quant_ops", "AVX2 variant", "none",
                         ["-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-ffp-contract=off"], ["-fopenmp"],
                         env_switch=None)
assert m is not None
x, codes, dm, bits, n = torch.load(sys.argv[1])
torch.save(m.quant_linear(x, codes, dm, bits, n), sys.argv[2])
"""


@pytest.mark.slow
@needs_kernels
def test_avx2_build_equals_avx512_bit_for_bit(tmp_path):
    """On an AVX512-VNNI CPU, the same source built without AVX-512 (the AVX2 side of
    simd16.h) gives the same outputs bit for bit: the integer sums are exact on both and
    each token's float32 steps are the same (a ~40 s build: `make test-all`)."""
    with open("/proc/cpuinfo") as f:
        if "avx512_vnni" not in f.read():
            pytest.skip("this CPU runs the AVX2 build already (the other tests here)")
    outs = {}
    for qtype in sorted(PACKED_TYPES):
        rng = np.random.default_rng(qtype)
        raw = torch.from_numpy(rng.integers(0, 256, (40, 8 * PACKED_TYPES[qtype]), dtype=np.uint8))
        raw.view(40, 8, -1)[:, :, 1] = 0x2C  # small float16 d (and m)
        if qtype in (3, 7):
            raw.view(40, 8, -1)[:, :, 3] = 0x2C
        qw = QuantWeight.from_gguf(raw, qtype)
        x = torch.randn(21, 256, generator=torch.Generator().manual_seed(qtype))
        torch.save((x, qw.codes, qw.dm, qw.bits, 40), tmp_path / "in.pt")
        subprocess.run([sys.executable, "-c", AVX2_ONLY, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                       check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        outs[qtype] = torch.equal(torch.load(tmp_path / "out.pt"), ops.quant_linear(x, qw.codes, qw.dm, qw.bits, 40))
    assert all(outs.values()), outs


@needs_kernels
def test_8_bit_codes_take_d_only():
    """8-bit tiles hold the symmetric Q8_0 / IQ4_NL codes; AVX2 reads them as signed values, so
    an explicit m beside them (which quant_repack never writes) is refused, not counted twice."""
    raw = _extreme_blocks(8, 16, 2, 0x80)
    qw = QuantWeight.from_gguf(raw, 8)
    dm32 = torch.cat([qw.dm, qw.dm], dim=2).contiguous()
    with pytest.raises(RuntimeError, match="8-bit codes take d only"):
        ops.quant_linear(torch.ones(1, 64), qw.codes, dm32, 8, 16)
