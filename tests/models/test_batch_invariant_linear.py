"""``llmserve.ops.batch_invariant``: inside ``min_gemm_rows(MIN_INVARIANT_ROWS)`` a row's
linear output is bit-identical whatever the number of rows (1 .. 512), in float32 and
bfloat16, at SmolLM2-135M shapes (issue 18); outside it nothing changes."""
import pytest
import torch
import torch.nn.functional as F

from llmserve.ops.batch_invariant import MIN_INVARIANT_ROWS, linear, min_gemm_rows

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, o, gate_up, down, lm head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_row_result_does_not_depend_on_row_count(dtype, shape):
    g = torch.Generator().manual_seed(0)
    N, K = shape
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
    x = torch.randn(512, K, generator=g).to(dtype)
    with min_gemm_rows(MIN_INVARIANT_ROWS):
        ref = linear(x[:1], w)[0]
        for m in (2, 3, 4, 7, 64, 512):
            assert torch.equal(linear(x[:m], w)[0], ref), m
    # outside the block: plain F.linear
    assert torch.equal(linear(x[:3], w), F.linear(x[:3], w))


def test_padding_keeps_shape_and_bias():
    w, b = torch.randn(8, 4), torch.randn(8)
    x = torch.randn(2, 4)
    with min_gemm_rows(4):
        y = linear(x, w, b)
    assert y.shape == (2, 8)
    torch.testing.assert_close(y, x @ w.t() + b)
