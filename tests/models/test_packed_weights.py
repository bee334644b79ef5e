"""GGUF-packed small-step linears (issue 16): the C++ kernels against gguf's own
dequantization and a float64 reference on random blocks, and the packed SmolLM2 model
against the dense bfloat16 one and transformers in float32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.ops.quant_ops import PACKED_TYPES, QuantWeight, get_quant_ops

ops = get_quant_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="packed-weight kernels need AVX512-VNNI and a compiler")

NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}


def _blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks: random bytes (every nibble / int8 value) with finite float16 scales."""
    rng = np.random.default_rng(seed)
    bb = PACKED_TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // 32, bb), dtype=np.uint8)
    nscale = 2 if qtype == 3 else 1  # Q4_1 has d and m
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
    """Blocks made by gguf.quants.quantize from real-valued weights decode the same."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    w = np.random.default_rng(1).normal(0, 0.02, size=(24, 128)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType(qtype))
    got = ops.quant_dequantize(torch.from_numpy(np.ascontiguousarray(raw)), qtype)
    assert torch.equal(got, torch.from_numpy(_gguf_dequant(raw, qtype)))
    assert float((got - torch.from_numpy(w)).abs().max()) < 0.01  # and approximate w


def _int8_reference(x: torch.Tensor, w64: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """What the int8 kernel computes, in float64: per 32-block of x, q_x = round(x * 127 /
    max|x|) (half to even), then d * d_x * sum(q * q_x) + m * sum(x) with the weight's
    codes q = (w - m) / d."""
    m_, k = x.shape
    n = w64.shape[0]
    dm = qw.dm.view(torch.float16).double().view(n, k // 32, 2)
    d, off = dm[..., 0], dm[..., 1]
    q = (w64.view(n, k // 32, 32) - off[..., None]) / d[..., None]
    xf = x.float().view(m_, k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)  # float32 steps, as the kernel rounds them
    qx = torch.where(amax > 0, torch.round(xf * 127 / amax), torch.zeros_like(xf)).double()
    xb = xf.double()
    return (torch.einsum("nbk,tbk,nb,tb->tn", q, qx, d, (amax[..., 0] / 127).double())
            + torch.einsum("nb,tb->tn", off, xb.sum(-1)))


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("k", [576, 512, 96])  # a tail group of 2 blocks, none, 3 blocks
def test_quant_linear_matches_references(qtype, m, k):
    n = 200
    raw = torch.from_numpy(_blocks(qtype, n, k, seed=10 + qtype))
    w64 = torch.from_numpy(_gguf_dequant(raw.numpy(), qtype)).double()
    qw = QuantWeight.from_gguf(raw, qtype)
    assert qw.shape == (n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0  # an all-zero block
    exact = ops.quant_linear(x, qw.codes, qw.dm, qw.bits, False)
    assert exact.dtype == torch.float32 and exact.shape == (m, n)
    torch.testing.assert_close(exact.double(), x.double() @ w64.T, atol=1e-4, rtol=1e-5)
    got = ops.quant_linear(x, qw.codes, qw.dm, qw.bits, True)
    torch.testing.assert_close(got.double(), _int8_reference(x, w64, qw), atol=1e-4, rtol=1e-5)
    scale = float((x.double() @ w64.T).abs().max())  # and int8 activations stay close to exact
    assert float((got.double() - x.double() @ w64.T).abs().max()) < 0.03 * scale
    xb = x.bfloat16()
    got_bf = ops.quant_linear(xb, qw.codes, qw.dm, qw.bits, True, True)
    assert got_bf.dtype == torch.float32
    torch.testing.assert_close(got_bf.double(), _int8_reference(xb.float(), w64, qw), atol=1e-4, rtol=1e-5)
    got_b = ops.quant_linear(xb, qw.codes, qw.dm, qw.bits, True)  # the float32 sums rounded once
    assert got_b.dtype == torch.bfloat16 and torch.equal(got_b, got_bf.bfloat16())


@pytest.mark.parametrize("int8", [True, False])
def test_rows_do_not_depend_on_the_step_size(int8):
    qw = QuantWeight.from_gguf(torch.from_numpy(_blocks(3, 64, 288, seed=3)), 3)
    x = torch.randn(7, 288, generator=torch.Generator().manual_seed(0)).bfloat16()
    full = ops.quant_linear(x, qw.codes, qw.dm, 4, int8)
    for i in range(7):
        assert torch.equal(ops.quant_linear(x[i:i + 1], qw.codes, qw.dm, 4, int8)[0], full[i])


def test_bad_shapes_raise():
    raw = torch.from_numpy(_blocks(3, 8, 64, seed=0))
    qw = QuantWeight.from_gguf(raw, 3)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.quant_linear(torch.randn(1, 96), qw.codes, qw.dm, 4)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        ops.quant_linear(torch.randn(1, 64), qw.codes, qw.dm, 5)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        ops.quant_repack(raw, 12)
    with pytest.raises(RuntimeError, match="whole blocks"):
        ops.quant_repack(raw[:, :30].contiguous(), 3)


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_resolved, smollm2_config, model_config_fn):
    from llmserve.model_loader import get_model
    return get_model(model_config_fn(smollm2_resolved, smollm2_config, "bfloat16"))


def _set_max_rows(model, rows: int) -> None:
    from llmserve.models.llama import Linear
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.qweight is not None:
            mod.packed_max_rows = rows
    model.packed_head = (model.packed_head[0], rows)


def test_smollm2_packed_decode_is_closer_to_fp32_than_dense_bf16(
        smollm2_bf16, smollm2_model_fp32, smollm2_tokenizer, step_runner_cls):
    """The Q4_1/Q8_0 file's blocks stay packed; decode steps on them (int8 activations, as
    llama.cpp) give logits at least as close to the float32 model as the
    bfloat16-dequantized weights do (bf16 rounds the weights and every activation), and the
    same greedy tokens."""
    from llmserve.models.llama import Linear
    layers = [m for m in smollm2_bf16.modules() if isinstance(m, Linear)]
    assert all(m.qweight is not None for m in layers) and smollm2_bf16.packed_head is not None
    prompt = smollm2_tokenizer("The quick brown fox jumps over the lazy dog because").input_ids
    seqs = {}
    for name, model, rows in (("fp32", smollm2_model_fp32, None), ("dense", smollm2_bf16, 0),
                              ("packed", smollm2_bf16, 64)):
        if rows is not None:
            _set_max_rows(model, rows)
        runner = step_runner_cls(model, num_blocks=16, block_size=16)
        runner.step([("p", prompt[:-1])])  # prefill (dense in the 0 case, packed else)
        logits = [runner.step([("p", prompt[-1:])])["p"][-1]]
        for _ in range(6):
            logits.append(runner.step([("p", [int(logits[-1].argmax())])])["p"][-1])
        seqs[name] = torch.stack(logits)
    _set_max_rows(smollm2_bf16, 64)
    err_packed = (seqs["packed"] - seqs["fp32"]).abs().mean()
    err_dense = (seqs["dense"] - seqs["fp32"]).abs().mean()
    assert err_packed <= err_dense
    assert torch.equal(seqs["packed"].argmax(-1), seqs["fp32"].argmax(-1))
