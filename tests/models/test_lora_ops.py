"""The batched LoRA kernels (llmserve/ops/lora_ops.py) against the per-row reference."""
from __future__ import annotations

import pytest
import torch

from llmserve.ops.lora_ops import LoRAMapping, add_lora, lora_delta_reference, segments_of


def _stacks(slots=4, inp=24, rank=8, out=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(slots, inp, rank, generator=g).to(dtype), torch.randn(slots, rank, out, generator=g).to(dtype))


@pytest.mark.parametrize("row_slots,row_lens", [
    ([2], [5]),                                  # one adapter, the whole batch (c=1)
    ([0, -1, 0], [1, 1, 3]),                     # an adapter around a base row: two segments
    ([0, 1, 3, -1, 1, 1], [1, 1, 1, 1, 6, 2]),   # decodes over three adapters + a prompt: gathered, padded
    ([3, 2, 1, 0], [2, 2, 2, 2]),                # equal segments: gathered, no padding
])
def test_sgmv_and_bgmv_equal_the_reference(row_slots, row_lens):
    a, b = _stacks()
    segs = segments_of(row_slots, row_lens)
    t = sum(row_lens)
    x = torch.randn(t, a.shape[1])
    for min_bgmv in (1, 99):  # both paths on every layout
        m = LoRAMapping(segs, t, torch.device("cpu"), min_bgmv_segments=min_bgmv)
        y0 = torch.randn(t, b.shape[2])
        got = add_lora(y0.clone(), x, a, b, m, list(a.unbind(0)), list(b.unbind(0)))
        ref = y0 + lora_delta_reference(x, a, b, m.token_slots())
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_float32_adapters_add_into_a_bfloat16_output():
    a, b = _stacks()
    m = LoRAMapping(segments_of([1, -1, 2, 0], [2, 1, 1, 1]), 5, torch.device("cpu"), min_bgmv_segments=2)
    x = torch.randn(5, a.shape[1]).bfloat16()
    y = torch.zeros(5, b.shape[2], dtype=torch.bfloat16)
    add_lora(y, x, a, b, m)
    ref = lora_delta_reference(x.float(), a, b, m.token_slots())
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=1e-2)
    assert y.dtype == torch.bfloat16 and not y[2].any()  # the base row is untouched
