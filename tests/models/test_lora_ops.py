"""The batched LoRA deltas (llmserve/ops/lora_ops.py, csrc/lora.cpp) against the per-row
reference: fused slices with their own B over their own columns, ranks below the slot
rank, base rows, float32 and bfloat16, and each row independent of the batch."""
from __future__ import annotations

import pytest
import torch

from llmserve.ops.lora_ops import (LoRAMapping, arm_hooks, column_ranges, get_lora_kernel, lora_add_torch,
                                   lora_delta_reference, segments_of, slot_weights)

RANK = 8
SLICES = [(0, 40), (40, 8), (48, 8)]  # a fused q/k/v: three slices of 56 output columns
LAYOUTS = [
    ([2], [5]),                                   # one adapter, the whole batch (c=1 prompt)
    ([0, -1, 0], [1, 1, 3]),                      # an adapter around a base row: two segments
    ([0, 1, 3, -1, 1, 1], [1, 1, 1, 1, 6, 20]),   # decodes over three adapters + prompts (blocks of 8 rows)
]


def _weights(dtype=torch.float32, slots=4, inp=24, slot_rank=RANK, used_rank=RANK - 2):
    """Stacks in the slot layout; ranks ``used_rank`` < ``slot_rank`` leave zero columns."""
    g = torch.Generator().manual_seed(0)
    n = len(SLICES)
    a = torch.zeros(slots, inp, n * slot_rank)
    b = torch.zeros(slots, slot_rank, sum(s for _, s in SLICES))
    for i in range(n):
        a[:, :, i * slot_rank:i * slot_rank + used_rank] = torch.randn(slots, inp, used_rank, generator=g)
    b[:, :used_rank] = torch.randn(slots, used_rank, b.shape[2], generator=g)
    return a.to(dtype), b.to(dtype)


def _kernel():
    k = get_lora_kernel()
    if k is None:
        pytest.skip("the C++ LoRA kernel cannot be built here (no compiler)")
    return k


def test_column_ranges_follow_slices_and_shards():
    assert column_ranges(SLICES).tolist() == [[0, 40, 0], [40, 48, 1], [48, 56, 2]]
    # a column-parallel shard keeping q's second half and k's and v's second halves
    keep = torch.tensor(list(range(20, 40)) + list(range(44, 48)) + list(range(52, 56)))
    assert column_ranges(SLICES, keep).tolist() == [[0, 20, 0], [20, 24, 1], [24, 28, 2]]


@pytest.mark.parametrize("row_slots,row_lens", LAYOUTS)
@pytest.mark.parametrize("add", ["kernel", "torch"])
def test_float32_deltas_equal_the_reference(row_slots, row_lens, add):
    fn = _kernel() if add == "kernel" else lora_add_torch
    a, b = _weights()
    m = LoRAMapping(segments_of(row_slots, row_lens), sum(row_lens))
    rng = column_ranges(SLICES)
    x = torch.randn(m.num_tokens, a.shape[1])
    y0 = torch.randn(m.num_tokens, b.shape[2])
    y = y0.clone()
    fn(y, x, a, b, m.segs, rng)
    torch.testing.assert_close(y, y0 + lora_delta_reference(x, a, b, m.token_slots(), rng), atol=1e-5, rtol=1e-5)
    base = m.token_slots() < 0
    assert torch.equal(y[base], y0[base])  # base-model rows untouched


def test_bfloat16_weights_and_activations():
    k = _kernel()
    a, b = _weights(torch.bfloat16)
    m = LoRAMapping(segments_of([1, -1, 2, 0], [2, 1, 1, 9]), 13)
    rng = column_ranges(SLICES)
    x = torch.randn(13, a.shape[1]).bfloat16()
    y = torch.zeros(13, b.shape[2], dtype=torch.bfloat16)
    k(y, x, a, b, m.segs, rng)
    ref = lora_delta_reference(x, a, b, m.token_slots(), rng)  # float32 sums over the same bf16 values
    torch.testing.assert_close(y.float(), ref, atol=1e-2, rtol=8e-3)  # one bfloat16 rounding of the sum
    assert not y[2].any()


def test_rows_are_batch_invariant_and_views_accepted():
    """A row's delta is bit-identical alone or in any batch; x may be a row-strided view."""
    k = _kernel()
    a, b = _weights()
    rng = column_ranges(SLICES)
    wide = torch.randn(30, 2 * a.shape[1])
    x = wide[:, :a.shape[1]]  # row stride 48, not contiguous
    m = LoRAMapping(segments_of([0, 1, 3, -1, 1, 1], [1, 1, 1, 1, 6, 20]), 30)
    y = torch.zeros(30, b.shape[2])
    k(y, x, a, b, m.segs, rng)
    for row, slot in [(0, 0), (2, 3), (4, 1), (29, 1)]:
        alone = torch.zeros(1, b.shape[2])
        k(alone, x[row:row + 1].contiguous(), a, b, LoRAMapping([(slot, 0, 1)], 1).segs, rng)
        assert torch.equal(alone[0], y[row])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [8, 40])
@pytest.mark.parametrize("rows_per_slot", [2, 8])
def test_rows_are_batch_invariant_across_the_serial_and_threaded_paths(dtype, rank, rows_per_slot):
    """A row alone (below the kernel's threading threshold: lora.cpp run_serial, one row a
    pass) vs 16 rows over 8 adapters (2 rows each: 8 blocks, whole blocks per thread,
    run_blocks) or over 2 adapters (8 rows each: 2 blocks, the two-phase split over A's
    chunks and the columns) where the runner has threads: the same bits. Rank 40: W = 80,
    more than one 64-column pass over A. K = 600: four A chunks, the last one short.
    float16: x widened to float32 once per chunk, as bfloat16."""
    k = _kernel()
    g = torch.Generator().manual_seed(1)
    slices = [(0, 40), (40, 24)]
    wdt = torch.bfloat16 if dtype == torch.float16 else dtype  # the kernel's weights: float32 or bfloat16
    a = (torch.randn(8, 600, 2 * rank, generator=g) / 25).to(wdt)
    b = (torch.randn(8, rank, 64, generator=g) / 6).to(wdt)
    rng = column_ranges(slices)
    x = torch.randn(16, 600, generator=g).to(dtype)
    y = torch.randn(16, 64, generator=g).to(dtype)
    batch = y.clone()
    n = rows_per_slot
    k(batch, x, a, b, LoRAMapping([(s, n * s, n * s + n) for s in range(16 // n)], 16).segs, rng)
    for row in range(16):
        alone = y[row:row + 1].clone()
        k(alone, x[row:row + 1].contiguous(), a, b, LoRAMapping([(row // n, 0, 1)], 1).segs, rng)
        assert torch.equal(alone[0], batch[row])
    ref = y.float() + lora_delta_reference(x, a, b, torch.arange(16) // n, rng)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batch.float(), ref, atol=tol, rtol=tol)


def test_kernel_rejects_mismatched_shapes():
    k = _kernel()
    a, b = _weights()
    m = LoRAMapping([(0, 0, 4)], 4)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        k(torch.zeros(4, 50), torch.zeros(4, a.shape[1]), a, b, m.segs, column_ranges(SLICES))
    with pytest.raises(RuntimeError, match="segment 0 out of bounds"):
        k(torch.zeros(2, 56), torch.zeros(2, a.shape[1]), a, b, m.segs, column_ranges(SLICES))


def _per_slot_rank_stacks(wdt, ranks, max_rank, inp, slices, g):
    """The same adapters twice: padded to ``max_rank`` (slice i at columns i*max_rank, zeros
    past each slot's rank, read with ranks=None) and at each slot's own rank (slot_weights),
    the slot storage past that rank filled with NaN (any read of it would show)."""
    n, out = len(slices), sum(s for _, s in slices)
    slots = len(ranks)
    pad_a = torch.zeros(slots, inp, n * max_rank)
    pad_b = torch.zeros(slots, max_rank, out)
    own_a = torch.full((slots, inp, n * max_rank), float("nan"), dtype=wdt)
    own_b = torch.full((slots, max_rank, out), float("nan"), dtype=wdt)
    for s, r in enumerate(ranks):
        a = (torch.randn(inp, n * r, generator=g) / 25).to(wdt)
        b = (torch.randn(r, out, generator=g) / 6).to(wdt)
        for i in range(n):
            pad_a[s, :, i * max_rank:i * max_rank + r] = a[:, i * r:(i + 1) * r].float()
        pad_b[s, :r] = b.float()
        va, vb = slot_weights(own_a, own_b, s, r)
        va.copy_(a)
        vb.copy_(b)
    return pad_a.to(wdt), pad_b.to(wdt), own_a, own_b


@pytest.mark.parametrize("dtype,wdt", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                       (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                       (torch.float16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("max_rank", [16, 64])
def test_slots_read_only_their_own_rank_with_the_padded_bits(dtype, wdt, max_rank):
    """Slots of ranks 8, 3, 16, 0, 5, 1, 16, 12 (mixed in one batch) in storage sized for
    ``max_rank``: the kernel reading each slot's own rank gives the bits of the same
    adapters zero-padded to ``max_rank`` (what it read before), for 1..30 rows; the NaN
    past each slot's rank is never read, and rank 0 (a module the adapter does not
    target) leaves its rows untouched. The torch path agrees with the reference."""
    k = _kernel()
    g = torch.Generator().manual_seed(2)
    slices = [(0, 40), (40, 24), (64, 24)]
    ranks = [8, 3, 16, 0, 5, 1, 16, 12]
    pad_a, pad_b, own_a, own_b = _per_slot_rank_stacks(wdt, ranks, max_rank, 600, slices, g)
    rk = torch.tensor(ranks, dtype=torch.int32)
    rng = column_ranges(slices)
    for rows in range(1, 31):
        x = torch.randn(rows, 600, generator=g).to(dtype)
        y0 = torch.randn(rows, 88, generator=g).to(dtype)
        slots = [(3 * t + rows) % len(ranks) for t in range(rows)]  # runs of one row and longer mixes
        m = LoRAMapping(segments_of(sorted(slots), [1] * rows), rows)
        want, got = y0.clone(), y0.clone()
        k(want, x, pad_a, pad_b, m.segs, rng)
        k(got, x, own_a, own_b, m.segs, rng, rk)
        assert torch.equal(got, want), rows
        untouched = torch.tensor([ranks[s] == 0 for s in sorted(slots)])
        assert torch.equal(got[untouched], y0[untouched])
    ref = y0.float() + lora_delta_reference(x, own_a, own_b, m.token_slots(), rng, rk)
    tol = 1e-5 if dtype == torch.float32 and wdt == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    via_torch = y0.float().clone()
    lora_add_torch(via_torch, x.float(), own_a.float(), own_b.float(), m.segs, rng, rk)
    torch.testing.assert_close(via_torch, ref, atol=tol, rtol=tol)


def test_kernel_rejects_bad_ranks():
    k = _kernel()
    a, b = _weights()
    m = LoRAMapping([(0, 0, 4)], 4)
    y, x, rng = torch.zeros(4, 56), torch.zeros(4, a.shape[1]), column_ranges(SLICES)
    with pytest.raises(RuntimeError, match=r"ranks\[1\] = 9 is outside 0..8"):
        k(y, x, a, b, m.segs, rng, torch.tensor([8, 9, 0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="ranks must be a contiguous int32"):
        k(y, x, a, b, m.segs, rng, torch.tensor([8, 8], dtype=torch.int32))


def _bound(a, b, rng, rk):
    from llmserve.ops.lora_ops import bind_lora_kernel

    _kernel()
    return bind_lora_kernel(a, b, rng, rk)


@pytest.mark.parametrize("dtype,wdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                       (torch.float16, torch.float32)])
def test_bound_module_gives_lora_adds_bits(dtype, wdt):
    """The kernel bound to a module's stacks (what the wrapped linears call) gives
    lora_add's bits for 1..24 rows over mixed slots and ranks (the one-thread path at one
    or two rows, the threaded ones above), reads the ranks tensor at each call (a slot
    written in place takes effect), and refuses mismatched shapes and segments."""
    k = _kernel()
    g = torch.Generator().manual_seed(3)
    slices = [(0, 40), (40, 24), (64, 24)]
    ranks = [8, 3, 16, 0, 5, 1, 16, 12]
    _, _, a, b = _per_slot_rank_stacks(wdt, ranks, 16, 600, slices, g)
    rk = torch.tensor(ranks, dtype=torch.int32)
    rng = column_ranges(slices)
    mod = _bound(a, b, rng, rk)
    for rows in list(range(1, 25)):
        x = torch.randn(rows, 600, generator=g).to(dtype)
        y0 = torch.randn(rows, 88, generator=g).to(dtype)
        slots = [(5 * t + rows) % len(ranks) for t in range(rows)]
        m = LoRAMapping(segments_of(sorted(slots), [1] * rows), rows)
        want, got = y0.clone(), y0.clone()
        k(want, x, a, b, m.segs, rng, rk)
        mod.add(got, x, m.segs)
        assert torch.equal(got, want), rows
    x, y0 = torch.randn(1, 600, generator=g).to(dtype), torch.zeros(1, 88, dtype=dtype)
    one = LoRAMapping([(3, 0, 1)], 1).segs  # slot 3 has rank 0: no delta
    y = y0.clone()
    mod.add(y, x, one)
    assert torch.equal(y, y0)
    rk[3] = 4  # a rank-4 adapter written into slot 3 (its storage holds NaN past rank 4 only)
    va, vb = slot_weights(a, b, 3, 4)
    va.copy_(torch.randn(va.shape, generator=g).to(wdt) / 25)
    vb.copy_(torch.randn(vb.shape, generator=g).to(wdt) / 6)
    want = y0.clone()
    k(want, x, a, b, one, rng, rk)
    mod.add(y, x, one)
    assert torch.equal(y, want) and not torch.equal(y, y0)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        mod.add(torch.zeros(1, 50, dtype=dtype), x, one)
    with pytest.raises(RuntimeError, match="segment 0 out of bounds"):
        mod.add(torch.zeros(1, 88, dtype=dtype), x, LoRAMapping([(9, 0, 1)], 1).segs)
    rk[3] = 17
    with pytest.raises(RuntimeError, match=r"ranks\[3\] = 17 is outside 0..16"):
        mod.add(torch.zeros(1, 88, dtype=dtype), x, one)



def _packed(qtype: int, n: int, k: int, seed: int):
    """A packed weight [n, k] of GGUF type ``qtype`` quantized (ggml's rounding, gguf's or
    our K-quant writer) from random normal values."""
    import numpy as np

    from llmserve.benchmarks.kquant_writer import quantize
    from llmserve.ops.kquant import quant_weight_from_gguf

    w = np.random.default_rng(seed).normal(0, 0.05, size=(n, k)).astype(np.float32)
    return quant_weight_from_gguf(torch.from_numpy(quantize(w, qtype)), qtype)


@pytest.mark.parametrize("qtype", [3, 12])  # Q4_1 (the default SmolLM2 file), Q4_K
@pytest.mark.parametrize("dtype,wdt", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                       (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("threads", [2, 1])
def test_deltas_inside_the_packed_gemm_give_the_same_bits(qtype, dtype, wdt, threads):
    """A ``LoRAModule`` armed for a step (``arm``) runs the deltas inside the packed GEMM's
    threads (each thread its share of the shrink, then its own output columns): the result
    is bit for bit the GEMM followed by ``add`` for 1..20 rows of one adapter and of mixed
    slots and ranks, on two threads and on one (the hook's calls then run one after the
    other), again on a second GEMM of the same step; and a hook never armed, or armed for
    other rows, columns or an out_float call, is refused."""
    from llmserve.ops.quant_ops import get_quant_ops

    if get_quant_ops() is None:
        pytest.skip("no AVX512-VNNI: the packed kernels are not built on this CPU")
    g = torch.Generator().manual_seed(5)
    slices = [(0, 256), (256, 64), (320, 64)]
    ranks = [16, 3, 0, 8]
    _, _, a, b = _per_slot_rank_stacks(wdt, ranks, 16, 256, slices, g)
    rk = torch.tensor(ranks, dtype=torch.int32)
    mod = _bound(a, b, column_ranges(slices), rk)
    qw = _packed(qtype, 384, 256, seed=qtype)
    x = torch.randn(3, 256, generator=g).to(dtype)
    with pytest.raises(RuntimeError, match="the hook does not fit this call"):
        qw.linear(x, False, mod.hook_address())  # never armed
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, 21):
            one = LoRAMapping([(rows % 2, 0, rows)], rows)
            mixed = LoRAMapping(segments_of([t % 4 for t in range(rows)], [1] * rows), rows)
            for m in (one, mixed):
                arm_hooks([mod], m)
                for _ in range(2):  # two GEMMs of one step, each with its own x
                    x = torch.randn(rows, 256, generator=g).to(dtype)
                    want = qw.linear(x)
                    mod.add(want, x, m.segs)
                    got = qw.linear(x, False, mod.hook_address())
                    assert torch.equal(got, want), (rows, m.segments)
    finally:
        torch.set_num_threads(before)
    x = torch.randn(3, 256, generator=g).to(dtype)
    arm_hooks([mod], LoRAMapping([(0, 0, 3)], 3))
    with pytest.raises(RuntimeError, match="the hook does not fit this call"):
        qw.linear(x[:2], False, mod.hook_address())
    with pytest.raises(RuntimeError, match="the hook does not fit this call"):
        qw.linear(x, True, mod.hook_address())
    with pytest.raises(RuntimeError, match="the hook does not fit this call"):
        _packed(qtype, 384, 512, seed=qtype).linear(torch.zeros(3, 512, dtype=dtype), False, mod.hook_address())
    with pytest.raises(RuntimeError):
        arm_hooks([mod], LoRAMapping([(0, 0, 5)], 3))  # rows past the step's
    with pytest.raises(RuntimeError, match="the hook does not fit this call"):
        qw.linear(x, False, mod.hook_address())  # a failed arm leaves it unarmed
