"""GGUF-packed small-step linears (issue 16): the C++ kernels against gguf's own
dequantization and a float64 reference on random blocks, and the packed SmolLM2 model
against the dense bfloat16 one and transformers in float32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.ops.quant_ops import PACKED_TYPES, get_quant_ops

ops = get_quant_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="packed-weight kernels need AVX512F and a compiler")

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


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_quant_linear_matches_float_reference(qtype, m):
    n, k = 200, 576
    raw = torch.from_numpy(_blocks(qtype, n, k, seed=10 + qtype))
    w64 = torch.from_numpy(_gguf_dequant(raw.numpy(), qtype)).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ w64.T
    got = ops.quant_linear(x, raw, qtype)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-5)
    xb = x.bfloat16()
    got_b = ops.quant_linear(xb, raw, qtype)
    assert got_b.dtype == torch.bfloat16
    torch.testing.assert_close(got_b.double(), xb.double() @ w64.T, atol=2e-3, rtol=8e-3)
    got_bf = ops.quant_linear(xb, raw, qtype, True)  # bf16 in, float32 out: only sum order differs
    assert got_bf.dtype == torch.float32
    torch.testing.assert_close(got_bf.double(), xb.double() @ w64.T, atol=1e-4, rtol=1e-5)


def test_rows_do_not_depend_on_the_step_size():
    raw = torch.from_numpy(_blocks(3, 64, 256, seed=3))
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    full = ops.quant_linear(x, raw, 3)
    for i in range(7):
        assert torch.equal(ops.quant_linear(x[i:i + 1], raw, 3)[0], full[i])


def test_bad_shapes_raise():
    raw = torch.from_numpy(_blocks(3, 8, 64, seed=0))
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.quant_linear(torch.randn(1, 96), raw, 3)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        ops.quant_linear(torch.randn(1, 64), raw, 12)


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_resolved, smollm2_config, model_config_fn):
    from llmserve.model_loader import get_model
    return get_model(model_config_fn(smollm2_resolved, smollm2_config, "bfloat16"))


def _set_max_rows(model, rows: int) -> None:
    from llmserve.models.llama import Linear
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.qweight is not None:
            mod.packed_max_rows = rows
    qw, qt, _ = model.packed_head
    model.packed_head = (qw, qt, rows)


def test_smollm2_packed_decode_is_closer_to_fp32_than_dense_bf16(
        smollm2_bf16, smollm2_model_fp32, smollm2_tokenizer, step_runner_cls):
    """The Q4_1/Q8_0 file's blocks stay packed; decode steps on them give logits at least as
    close to the float32 model as the bfloat16-dequantized weights do (both use the file's
    values; bf16 rounds them), and the same greedy tokens."""
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
