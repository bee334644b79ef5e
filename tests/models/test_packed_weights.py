"""GGUF-packed small-step linears (issue 16): the C++ kernels against gguf's own
dequantization and a float64 reference on random blocks, and the packed SmolLM2 model
against the dense bfloat16 one and transformers in float32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.ops.quant_ops import PACKED_TYPES, QuantWeight, get_quant_ops

ops = get_quant_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="packed-weight kernels need AVX512-VNNI or AVX2 and a compiler")

NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 20: "IQ4_NL"}
WITH_MIN = (3, 7)  # Q4_1, Q5_1: d and m; the others d only (m = -8d, -16d, -128d)


def _blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks: random bytes (every nibble / int8 value) with finite float16 scales."""
    rng = np.random.default_rng(seed)
    bb = PACKED_TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // 32, bb), dtype=np.uint8)
    nscale = 2 if qtype in WITH_MIN else 1
    scales = rng.uniform(-0.05, 0.05, size=(n, k // 32, nscale)).astype(np.float16)
    raw[:, :, :2 * nscale] = scales.view(np.uint8).reshape(n, k // 32, 2 * nscale)
    return raw.reshape(n, k // 32 * bb)


def _gguf_dequant(raw: np.ndarray, qtype: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    return dequantize(raw, GGMLQuantizationType(qtype))


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES))
def test_dequantize_equals_gguf(qtype):
    raw = _blocks(qtype, 40, 96, seed=qtype)
    got = ops.quant_dequantize(torch.from_numpy(raw), qtype)
    assert torch.equal(got, torch.from_numpy(_gguf_dequant(raw, qtype)))


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES))
def test_dequantize_of_quantized_floats(qtype):
    """Blocks made by gguf.quants.quantize (IQ4_NL: llmserve's writer) from real-valued
    weights decode the same."""
    from llmserve.benchmarks.kquant_writer import quantize
    w = np.random.default_rng(1).normal(0, 0.02, size=(24, 128)).astype(np.float32)
    raw = quantize(w, qtype)
    got = ops.quant_dequantize(torch.from_numpy(np.ascontiguousarray(raw)), qtype)
    assert torch.equal(got, torch.from_numpy(_gguf_dequant(raw, qtype)))
    assert float((got - torch.from_numpy(w)).abs().max()) < 0.01  # and approximate w


def _d_m(raw: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block d and m (w = d * q + m) of GGUF rows, float64 ``[N, K/32]`` each."""
    n = raw.shape[0]
    blocks = raw.numpy().reshape(n, -1, PACKED_TYPES[qtype])
    d = torch.from_numpy(blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float64))
    if qtype in WITH_MIN:
        m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
    else:
        m = d * {2: -8, 6: -16, 8: -128, 20: -128}[qtype]
    return d, m


def _int8_reference(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """What the kernel computes, in float64: per 32-block of x, q_x = round(x * 127 /
    max|x|) (half to even, in float32 steps), then d * d_x * sum(q * q_x) + m * sum(x)
    with the weight's codes q = (w - m) / d; the offsets against d_x * sum(q_x) (llama.cpp's
    q8_1 sums), so this is the rounded x times the exact weights."""
    m_, k = x.shape
    n = raw.shape[0]
    w64 = torch.from_numpy(_gguf_dequant(raw.numpy(), qtype)).double()
    d, off = _d_m(raw, qtype)
    q = (w64.view(n, k // 32, 32) - off[..., None]) / d[..., None]
    xf = x.float().view(m_, k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    qx = torch.where(amax > 0, torch.round(xf * 127 / amax), torch.zeros_like(xf)).double()
    dx = (amax[..., 0] / 127).double()
    return (torch.einsum("nbk,tbk,nb,tb->tn", q, qx, d, dx)
            + torch.einsum("nb,tb->tn", off, qx.sum(-1) * dx))


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 37])  # 37: AVX2's unpacked tiles (32 tokens and more)
@pytest.mark.parametrize("n", [200, 16, 7])  # a part group of 8 rows, one whole group, one part group
def test_quant_linear_matches_references(qtype, m, n):
    k = 576
    raw = torch.from_numpy(_blocks(qtype, n, k, seed=10 + qtype))
    w64 = torch.from_numpy(_gguf_dequant(raw.numpy(), qtype)).double()
    qw = QuantWeight.from_gguf(raw, qtype)
    assert qw.shape == (n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0  # an all-zero block
    got = ops.quant_linear(x, qw.codes, qw.dm, qw.bits, n)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), _int8_reference(x, raw, qtype), atol=1e-4, rtol=1e-5)
    exact = x.double() @ w64.T  # and int8 activations stay close to exact
    assert float((got.double() - exact).abs().max()) < 0.03 * float(exact.abs().max())
    xb = x.bfloat16()
    got_bf = ops.quant_linear(xb, qw.codes, qw.dm, qw.bits, n, True)
    assert got_bf.dtype == torch.float32
    torch.testing.assert_close(got_bf.double(), _int8_reference(xb.float(), raw, qtype), atol=1e-4, rtol=1e-5)
    got_b = ops.quant_linear(xb, qw.codes, qw.dm, qw.bits, n)  # the float32 sums rounded once
    assert got_b.dtype == torch.bfloat16 and torch.equal(got_b, got_bf.bfloat16())


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES))
@pytest.mark.parametrize("k", [576, 1536])  # 18 blocks: one unpacked chunk; 48: two, summed between
def test_many_tokens_equal_few_tokens_bit_for_bit(qtype, k):
    """From 32 tokens on, AVX2 runs 4- and 5-bit tiles unpacked once per row group with the
    tokens' codes as the unsigned operand; the integer sums and float steps are those of the
    few-token kernel, so 300 tokens at once (chunks of 256 + 44) equal 8 at a time bit for bit."""
    n = 40
    raw = torch.from_numpy(_blocks(qtype, n, k, seed=20 + qtype))
    qw = QuantWeight.from_gguf(raw, qtype)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(k))
    x[3, 64:96] = 0  # an all-zero block
    whole = ops.quant_linear(x, qw.codes, qw.dm, qw.bits, n)
    parts = torch.cat([ops.quant_linear(x[i:i + 8], qw.codes, qw.dm, qw.bits, n) for i in range(0, 300, 8)])
    assert torch.equal(whole, parts)
    xb = x.bfloat16()
    assert torch.equal(ops.quant_linear(xb, qw.codes, qw.dm, qw.bits, n),
                       torch.cat([ops.quant_linear(xb[i:i + 8], qw.codes, qw.dm, qw.bits, n) for i in range(0, 300, 8)]))


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES))
def test_rows_are_the_exact_weights(qtype):
    raw = torch.from_numpy(_blocks(qtype, 40, 96, seed=5))
    qw = QuantWeight.from_gguf(raw, qtype)
    ids = torch.tensor([0, 39, 17, 17, 16, 15])
    want = torch.from_numpy(_gguf_dequant(raw.numpy(), qtype))[ids]
    assert torch.equal(qw.rows(ids), want)
    with pytest.raises(RuntimeError, match="out of range"):
        qw.rows(torch.tensor([40]))


def test_rows_do_not_depend_on_the_step_size():
    qw = QuantWeight.from_gguf(torch.from_numpy(_blocks(3, 64, 288, seed=3)), 3)
    x = torch.randn(7, 288, generator=torch.Generator().manual_seed(0)).bfloat16()
    full = qw.linear(x)
    for i in range(7):
        assert torch.equal(qw.linear(x[i:i + 1])[0], full[i])


def test_switch_point_is_every_step_without_amx():
    """A table entry, not a timing: the same on every start (greedy output must not change
    with a restart or the machine's load)."""
    from llmserve.ops.cpu_ops import _cpu_signature
    from llmserve.ops.quant_ops import ALL_STEPS, packed_switch_point
    if "amx_bf16" in _cpu_signature():
        pytest.skip("AMX CPUs measure the switch point")
    assert {packed_switch_point(576, 3072, torch.bfloat16) for _ in range(3)} == {ALL_STEPS}


def test_probe_answers_a_step_size_or_every_step():
    from llmserve.ops.quant_ops import ALL_STEPS, probe_max_rows
    rows = probe_max_rows(64, 256, torch.bfloat16, candidates=(1, 4), iters=1, stream_bytes=1 << 20)
    assert rows in (0, 1, ALL_STEPS)


def test_bad_shapes_raise():
    raw = torch.from_numpy(_blocks(3, 8, 64, seed=0))
    qw = QuantWeight.from_gguf(raw, 3)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.quant_linear(torch.randn(1, 96), qw.codes, qw.dm, 4, 8)
    with pytest.raises(RuntimeError, match="bits must be 4, 5 or 8"):
        ops.quant_linear(torch.randn(1, 64), qw.codes, qw.dm, 6, 8)
    with pytest.raises(RuntimeError, match="rows"):
        ops.quant_linear(torch.randn(1, 64), qw.codes, qw.dm, 4, 17)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        ops.quant_repack(raw, 12)
    with pytest.raises(RuntimeError, match="whole blocks"):
        ops.quant_repack(raw[:, :30].contiguous(), 3)


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_resolved, smollm2_config, model_config_fn):
    """Packed for every step whatever a busy test machine's probe says (the probe's own
    answer here is every step: see quant_ops.packed_switch_point)."""
    from llmserve.model_loader import get_model
    from llmserve.ops import quant_ops
    mp = pytest.MonkeyPatch()
    mp.setattr(quant_ops, "packed_switch_point", lambda *a, **k: quant_ops.ALL_STEPS)
    try:
        return get_model(model_config_fn(smollm2_resolved, smollm2_config, "bfloat16"))
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def smollm2_bf16_dense(smollm2_resolved, smollm2_config, model_config_fn):
    """The same file without packed weights: dequantized to bfloat16 (oneDNN GEMMs)."""
    from llmserve.model_loader import get_model
    from llmserve.models import packed
    mp = pytest.MonkeyPatch()
    mp.setattr(packed, "attach_packed_weights", lambda *a, **k: 0)
    try:
        return get_model(model_config_fn(smollm2_resolved, smollm2_config, "bfloat16"))
    finally:
        mp.undo()


def test_smollm2_runs_every_step_on_the_blocks_and_holds_no_dense_copy(smollm2_bf16):
    """With the packed kernel taking every step, the linears and the tied head hold the
    file's blocks only."""
    from llmserve.models.llama import Linear
    from llmserve.ops.quant_ops import ALL_STEPS
    layers = [m for m in smollm2_bf16.modules() if isinstance(m, Linear)]
    assert layers and all(m.packed_only and m.weight.numel() == 0 for m in layers)
    assert smollm2_bf16.packed_head[1] == ALL_STEPS and smollm2_bf16.onednn_head is None
    assert smollm2_bf16.embed_from_packed and smollm2_bf16.model.embed_tokens.weight.numel() == 0


def test_smollm2_packed_decode_is_closer_to_fp32_than_dense_bf16(
        smollm2_bf16, smollm2_bf16_dense, smollm2_model_fp32, smollm2_tokenizer, step_runner_cls):
    """The Q4_1/Q8_0 file's blocks stay packed; prefill and decode steps on them (int8
    activations, as llama.cpp) give logits close to the float32 model (at least as close as
    the bfloat16-dequantized weights on CPUs without AMX, see below), and the same greedy
    tokens."""
    prompt = smollm2_tokenizer("The quick brown fox jumps over the lazy dog because").input_ids
    seqs = {}
    for name, model in (("fp32", smollm2_model_fp32), ("dense", smollm2_bf16_dense), ("packed", smollm2_bf16)):
        runner = step_runner_cls(model, num_blocks=16, block_size=16)
        runner.step([("p", prompt[:-1])])
        logits = [runner.step([("p", prompt[-1:])])["p"][-1]]
        for _ in range(6):
            logits.append(runner.step([("p", [int(logits[-1].argmax())])])["p"][-1])
        seqs[name] = torch.stack(logits)
    err_packed = (seqs["packed"] - seqs["fp32"]).abs().mean()
    err_dense = (seqs["dense"] - seqs["fp32"]).abs().mean()
    # On AVX512 CPUs without AMX (Zen 4) bf16 rounding of every activation costs more than
    # the packed path's int8 activations (err_packed <= err_dense held there); oneDNN's AMX
    # bf16 kernels keep float32 accumulators, so on Sapphire Rapids the dense error is far
    # smaller (0.086 vs 0.81, logits' std 5.6) and the bound is the int8 activations' own:
    # within a quarter of the logits' spread, the same greedy tokens.
    assert err_packed <= max(err_dense, 0.25 * seqs["fp32"].std())
    assert torch.equal(seqs["packed"].argmax(-1), seqs["fp32"].argmax(-1))


def test_smollm2_packed_logits_do_not_depend_on_the_step(smollm2_bf16, smollm2_tokenizer, step_runner_cls):
    """A prompt prefilled whole, in chunks, or beside another request gives the same logits
    for its last token (the kernel treats each token alone), without --batch-invariant."""
    prompt = smollm2_tokenizer("Paris is the capital of").input_ids
    whole = step_runner_cls(smollm2_bf16, num_blocks=16, block_size=16).step([("a", prompt)])["a"][-1]
    chunked = step_runner_cls(smollm2_bf16, num_blocks=16, block_size=16)
    chunked.step([("a", prompt[:3])])
    assert torch.equal(chunked.step([("a", prompt[3:])])["a"][-1], whole)
    other = smollm2_tokenizer("An unrelated longer prompt that shares nothing").input_ids
    batched = step_runner_cls(smollm2_bf16, num_blocks=32, block_size=16)
    assert torch.equal(batched.step([("b", other), ("a", prompt)])["a"][-1], whole)


def test_a_fresh_build_is_announced_as_the_other_extensions_are(monkeypatch, tmp_path, caplog):
    # `make` (python -m llmserve.ops) printed "Building ..." for three of the four
    # extensions: this one built through cpp_extension.load directly, silently. It now
    # takes the shared loader; LLMSERVE_CPU_OPS=0 still leaves it on (its switch is
    # LLMSERVE_PACKED_WEIGHTS), as before.
    import torch.utils.cpp_extension as cpp_extension

    import llmserve.ops.quant_ops as quant_ops

    monkeypatch.setenv("HOME", str(tmp_path))  # no cached build: a fresh cache folder
    monkeypatch.setenv("LLMSERVE_CPU_OPS", "0")
    monkeypatch.delenv("LLMSERVE_PACKED_WEIGHTS", raising=False)
    monkeypatch.setattr(quant_ops, "_cpu_signature", lambda: "avx512_vnni")
    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(kw) or "module")
    with caplog.at_level("WARNING", logger="llmserve.ops.cpu_ops"):
        assert quant_ops.get_quant_ops.__wrapped__() == "module"
    assert [kw["name"] for kw in built] == ["llmserve_quant_ops"]
    assert built[0]["build_directory"].startswith(str(tmp_path / ".cache" / "llmserve" / "torch_extensions"))
    assert any(r.getMessage().startswith("Building the packed-weight kernels for this CPU into ")
               for r in caplog.records), caplog.text
