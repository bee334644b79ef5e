"""Packed GGUF weights in one buffer on 2 MiB pages (llmserve/ops/huge_pages.py,
models/packed.py ``_on_huge_pages``)."""
from __future__ import annotations

import pytest
import torch

from llmserve.ops.huge_pages import HUGE_PAGE, huge_page_buffer, to_huge_pages


def test_copies_keep_values_shapes_and_dtypes_in_one_aligned_buffer():
    src = [torch.arange(1000, dtype=torch.uint8).reshape(10, 100), torch.randn(7, 3).to(torch.bfloat16),
           torch.randint(-2**15, 2**15, (5, 33), dtype=torch.int16), torch.randn(3)]
    out = to_huge_pages(src)
    assert len(out) == len(src)
    for a, b in zip(src, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert b.data_ptr() != a.data_ptr() and b.data_ptr() % 64 == 0
    ptrs = [t.data_ptr() for t in out]
    assert ptrs[0] % HUGE_PAGE == 0 and ptrs == sorted(ptrs)
    # one after another: the last ends within the 64-byte padding of the sizes before it
    end = ptrs[-1] + out[-1].numel() * out[-1].element_size()
    assert end - ptrs[0] <= sum(-(-t.numel() * t.element_size() // 64) * 64 for t in src)


def test_copies_outlive_the_caller_and_are_independent():
    a = torch.ones(4, 4)
    (b,) = to_huge_pages([a])
    a.fill_(2.0)
    assert torch.equal(b, torch.ones(4, 4))


def test_empty_list_and_non_cpu_tensor():
    assert to_huge_pages([]) == []
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta"):
        to_huge_pages([torch.ones(2), torch.empty(2, device="meta")])


def test_buffer_is_zeroed_and_huge_page_aligned():
    buf = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert buf.nbytes == 3 * HUGE_PAGE + 5 and buf.ctypes.data % HUGE_PAGE == 0 and not buf.any()


def test_smollm2_packed_weights_share_one_huge_page_buffer(smollm2_resolved, smollm2_config, model_config_fn):
    """Every packed tensor of the loaded GGUF model (linears and the tied head) lies in
    one buffer that starts on a 2 MiB boundary."""
    from llmserve.model_loader import get_model
    from llmserve.models.llama import Linear
    from llmserve.ops import quant_ops
    mp = pytest.MonkeyPatch()
    mp.setattr(quant_ops, "packed_switch_point", lambda *a, **k: quant_ops.ALL_STEPS)
    try:
        model = get_model(model_config_fn(smollm2_resolved, smollm2_config, "bfloat16"))
    finally:
        mp.undo()

    def tensors(w):
        if hasattr(w, "parts"):
            return [t for p in w.parts for t in tensors(p)]
        return [getattr(w, f) for f in ("codes", "dm", "sc", "dd") if hasattr(w, f)]

    ts = [t for m in model.modules() if isinstance(m, Linear) and m.qweight is not None for t in tensors(m.qweight)]
    ts += tensors(model.packed_head[0])
    assert len(ts) > 100
    lo = min(t.data_ptr() for t in ts)
    hi = max(t.data_ptr() + t.numel() * t.element_size() for t in ts)
    total = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in ts)
    assert lo % HUGE_PAGE == 0 and hi - lo <= total
