"""Paged attention ops against a dense reference: cache writes, the torch decode path, the
C++ decode kernel, chunked prefill masks and sliding windows."""
from __future__ import annotations

import math
import random

import pytest
import torch

from llmserve.attention import PagedAttention, build_attn_metadata, get_kv_cache_shape
from llmserve.attention.backend import decode_attention_torch
from llmserve.ops.cpu_ops import get_cpu_ops, get_decode_kernel

NH, NKV, HD, BS, NB = 6, 2, 16, 4, 64


def dense_attention(q, k, v, window=None, softcap=None):
    """q [q, nh, hd] are the last q positions of k/v [s, nkv, hd]; plain softmax(QK^T)V
    (scores soft-capped as ``softcap * tanh(s / softcap)`` when given)."""
    ql, s = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1).float()
    v = v.repeat_interleave(g, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(s - ql, s).unsqueeze(1)
    kpos = torch.arange(s).unsqueeze(0)
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def random_batch(query_lens, seq_lens, dtype, seed=0):
    """Fill a paged cache with each request's earlier context; return the pieces."""
    g = torch.Generator().manual_seed(seed)
    free = list(range(NB))
    random.Random(seed).shuffle(free)
    kv = torch.zeros(get_kv_cache_shape(NB, BS, NKV, HD), dtype=dtype)
    blocks, full_k, full_v = [], [], []
    for ql, sl in zip(query_lens, seq_lens):
        owned = [free.pop() for _ in range((sl + BS - 1) // BS)]
        blocks.append(owned)
        k = torch.randn(sl, NKV, HD, generator=g).to(dtype)
        v = torch.randn(sl, NKV, HD, generator=g).to(dtype)
        for p in range(sl - ql):  # earlier context is already cached
            kv[0, owned[p // BS], p % BS] = k[p]
            kv[1, owned[p // BS], p % BS] = v[p]
        full_k.append(k)
        full_v.append(v)
    md = build_attn_metadata(query_lens, seq_lens, blocks, BS)
    q = torch.randn(sum(query_lens), NH, HD, generator=g).to(dtype)
    new_k = torch.cat([k[sl - ql:] for k, ql, sl in zip(full_k, query_lens, seq_lens)])
    new_v = torch.cat([v[sl - ql:] for v, ql, sl in zip(full_v, query_lens, seq_lens)])
    return kv, md, q, new_k, new_v, full_k, full_v


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_mixed_batch_matches_dense(window, use_kernel):
    # decodes; whole prompts of lengths 7, 7 and 7 (one batched SDPA call) and 6; chunks
    # with earlier context (5 of 13, 3 of 30)
    qlens, slens = [1, 1, 1, 7, 5, 7, 6, 7, 3], [9, 1, 22, 7, 13, 7, 6, 7, 30]
    kv, md, q, k, v, fk, fv = random_batch(qlens, slens, torch.float32)
    attn = PagedAttention(NH, HD, NKV, HD ** -0.5, sliding_window=window, use_kernel=use_kernel)
    out = attn(q.reshape(len(q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), kv, md)
    out = out.view(-1, NH, HD)
    starts = md.query_starts()
    for i, (ql, sl) in enumerate(zip(qlens, slens)):
        ref = dense_attention(q[starts[i]:starts[i + 1]], fk[i], fv[i], window)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], ref, atol=1e-5, rtol=1e-5)
    # the step's K/V landed in the cache at slot_mapping
    flat_k = kv[0].view(-1, NKV, HD)
    assert torch.equal(flat_k[md.slot_mapping], k)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_float32_over_a_narrow_cache_matches_dense_on_its_values(cache_dtype, use_kernel):
    """--kv-cache-dtype float16/bfloat16 under a float32 model: the step's K/V are stored
    rounded, and attention is the float32 attention over the cache's values. The kernel
    reads every token's context from the cache (1e-5 of dense on the rounded K/V); the torch
    path computes whole prompts from the step's own unrounded K/V (16-bit rounding apart)."""
    qlens, slens = [1, 1, 7, 5, 6, 3], [9, 22, 7, 13, 6, 30]
    kv, md, q, k, v, fk, fv = random_batch(qlens, slens, torch.float32, seed=5)
    kv = kv.to(cache_dtype)
    attn = PagedAttention(NH, HD, NKV, HD ** -0.5, use_kernel=use_kernel)
    out = attn(q.reshape(len(q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), kv, md).view(-1, NH, HD)
    assert out.dtype == torch.float32
    assert torch.equal(kv[0].view(-1, NKV, HD)[md.slot_mapping], k.to(cache_dtype))
    tol = 1e-5 if use_kernel else 2e-2
    starts = md.query_starts()
    for i in range(len(qlens)):
        ref = dense_attention(q[starts[i]:starts[i + 1]], fk[i].to(cache_dtype), fv[i].to(cache_dtype))
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_kernel_matches_torch_path(dtype, window):
    op = get_decode_kernel()
    if op is None:
        pytest.fail("the C++ decode kernel did not build on this machine (gcc/ninja present?)")
    n = 9
    slens = [1, 3, 4, 5, 17, 33, 64, 2, 40]
    kv, md, q, *_ = random_batch([1] * n, slens, dtype, seed=3)
    # fill the positions decoded this step too, so cache content is complete
    kv.normal_()
    ref = decode_attention_torch(q, kv, md.block_tables, md.seq_lens, max(slens), HD ** -0.5, window)
    out = torch.empty_like(q)
    op(out, q, kv, md.block_tables, md.seq_lens, n, HD ** -0.5, window or 0, 0.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_build_attn_metadata_layout():
    md = build_attn_metadata([1, 3], [6, 3], [[7, 2], [5]], 4)
    assert md.num_decodes == 1 and md.num_actual_tokens == 4
    # request 0's token at position 5 -> block 2, offset 1; request 1 positions 0..2 in block 5
    assert md.slot_mapping.tolist() == [2 * 4 + 1, 20, 21, 22]
    assert md.query_start_loc.tolist() == [0, 1, 4]
    assert md.block_tables.tolist() == [[7, 2], [5, 0]]
    with pytest.raises(ValueError, match="blocks cannot hold"):
        build_attn_metadata([2], [9], [[1, 2]], 4)
    # a one-token chunk after a prefill is a prefill, not a decode
    assert build_attn_metadata([1, 3, 1], [4, 3, 4], [[1], [2], [3]], 4).num_decodes == 1


def test_kernel_build_failure_falls_back_to_none(monkeypatch, caplog):
    import torch.utils.cpp_extension as ext

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(ext, "load", broken)
    from llmserve.ops import cpu_ops
    monkeypatch.setattr(cpu_ops, "import_built", lambda build_dir, name: None)  # as on a machine with no build yet
    with caplog.at_level("WARNING"):
        assert get_cpu_ops.__wrapped__() is None
    assert "torch path" in caplog.text and "no compiler here" in caplog.text


@pytest.mark.parametrize("window", [None, 37])
def test_bf16_kernel_prompts_and_chunks_match_dense(window):
    """The C++ kernel's bf16 fast path (head_dim 64, 16-key chunks) runs prompt tokens too:
    each as one query over its causal context in the paged cache."""
    global NH, NKV, HD, BS, NB
    old = NH, NKV, HD, BS, NB
    NH, NKV, HD, BS, NB = 9, 3, 64, 16, 64  # SmolLM2's attention shape, 16-token blocks
    try:
        qlens, slens = [1, 1, 40, 17, 128, 9], [70, 5, 40, 100, 128, 33]
        kv, md, q, k, v, fk, fv = random_batch(qlens, slens, torch.bfloat16, seed=5)
        attn = PagedAttention(NH, HD, NKV, HD ** -0.5, sliding_window=window)
        out = attn(q.reshape(len(q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), kv, md)
        out = out.view(-1, NH, HD).float()
        starts = md.query_starts()
        for i in range(len(qlens)):
            ref = dense_attention(q[starts[i]:starts[i + 1]], fk[i], fv[i], window)
            torch.testing.assert_close(out[starts[i]:starts[i + 1]], ref, atol=2e-2, rtol=2e-2)
    finally:
        NH, NKV, HD, BS, NB = old


def test_bf16_chunked_prompt_is_bitwise_equal_to_whole_prompt():
    """A prompt run whole, or as two chunks where the second reads the first's K/V from the
    cache (chunked prefill, prefix-cache hits), gives bit-identical attention outputs."""
    if get_decode_kernel() is None:
        pytest.fail("the C++ kernel did not build on this machine")
    nh, nkv, hd, bs, L, cut = 9, 3, 64, 16, 75, 32
    g = torch.Generator().manual_seed(11)
    q = torch.randn(L, nh * hd, generator=g).to(torch.bfloat16)
    k = torch.randn(L, nkv * hd, generator=g).to(torch.bfloat16)
    v = torch.randn(L, nkv * hd, generator=g).to(torch.bfloat16)
    attn = PagedAttention(nh, hd, nkv, hd ** -0.5)
    blocks = [3, 0, 7, 5, 1]
    kv = torch.zeros(get_kv_cache_shape(8, bs, nkv, hd), dtype=torch.bfloat16)
    whole = attn(q, k, v, kv, build_attn_metadata([L], [L], [blocks], bs))
    kv2 = torch.zeros_like(kv)
    first = attn(q[:cut], k[:cut], v[:cut], kv2, build_attn_metadata([cut], [cut], [blocks], bs))
    second = attn(q[cut:], k[cut:], v[cut:], kv2, build_attn_metadata([L - cut], [L], [blocks], bs))
    assert torch.equal(torch.cat([first, second]), whole)


@pytest.mark.parametrize("nkv,hd,nh,bs,ctx,cap", [(3, 64, 9, 16, 0, 0.0), (2, 128, 8, 16, 37, 0.0),
                                                  (3, 64, 9, 16, 5, 30.0), (1, 64, 4, 8, 0, 0.0)])
def test_bf16_prompt_tiles_and_balanced_rows_give_each_tokens_own_bits(nkv, hd, nh, bs, ctx, cap):
    """Consecutive prompt tokens of a request run as tiles that read each K/V chunk once, and
    steps past 64 rows are split by claims from the end: each token's output is bit for bit
    what the kernel gives it alone (one query, one row). Two prompts side by side, the
    second after ctx cached tokens, 200+ rows in all."""
    ops = get_cpu_ops()
    if ops is None or get_decode_kernel() is None:
        pytest.fail("the C++ kernel did not build on this machine")
    g = torch.Generator().manual_seed(3)
    nb = 64
    kv = torch.randn(2, nb, bs, nkv, hd, generator=g).to(torch.bfloat16)
    lens_a, lens_b = list(range(1, 151)), list(range(ctx + 1, ctx + 71))
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    width = (max(lens_a[-1], lens_b[-1]) + bs - 1) // bs
    ta, tb = perm[:width], perm[nb - width:]
    tables = torch.stack([ta] * len(lens_a) + [tb] * len(lens_b)).contiguous()
    lens = torch.tensor(lens_a + lens_b, dtype=torch.int32)
    t = len(lens)
    q = torch.randn(t, nh, hd, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    ops.paged_decode(out, q, kv, tables, lens, t, hd ** -0.5, 0, cap)
    for i in range(t):
        one = torch.empty(1, nh, hd, dtype=torch.bfloat16)
        ops.paged_decode(one, q[i:i + 1].contiguous(), kv, tables[i:i + 1].contiguous(), lens[i:i + 1].contiguous(),
                         1, hd ** -0.5, 0, cap)
        assert torch.equal(out[i], one[0]), f"row {i}"


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_soft_cap_in_every_path(use_kernel, dtype):
    """Gemma 2's attention soft cap inside attention: decodes, whole prompts (batched and
    alone), chunks with earlier context, with a window, against the dense reference; bf16
    with head_dim 64 takes the kernel's AVX512-BF16 path."""
    global NH, NKV, HD
    old = NH, NKV, HD
    NH, NKV, HD = (6, 2, 16) if dtype == torch.float32 else (4, 2, 64)
    try:
        qlens, slens = [1, 1, 7, 7, 5, 3], [9, 30, 7, 7, 13, 30]
        kv, md, q, k, v, fk, fv = random_batch(qlens, slens, dtype, seed=4)
        q = q * 4  # scores well past the cap of 1.5
        attn = PagedAttention(NH, HD, NKV, HD ** -0.5, sliding_window=6, use_kernel=use_kernel,
                              logits_soft_cap=1.5)
        out = attn(q.reshape(len(q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), kv, md).view(-1, NH, HD)
        starts = md.query_starts()
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for i in range(len(qlens)):
            ref = dense_attention(q[starts[i]:starts[i + 1]], fk[i], fv[i], 6, softcap=1.5)
            torch.testing.assert_close(out[starts[i]:starts[i + 1]].float(), ref, atol=tol, rtol=tol)
            uncapped = dense_attention(q[starts[i]:starts[i + 1]], fk[i], fv[i], 6)
            assert (uncapped - ref).abs().max() > 0.1 or slens[i] == 1
    finally:
        NH, NKV, HD = old


@pytest.mark.parametrize("hd,nh,nkv", [(64, 9, 3), (128, 8, 2)])
@pytest.mark.parametrize("window,cap", [(None, 0.0), (11, 0.0), (None, 30.0)])
def test_float32_kernel_at_model_head_sizes(hd, nh, nkv, window, cap):
    """float32 rows at head_dim 64 / 128 (the AVX2 path of dtype auto on CPUs without
    bfloat16: 8 keys per horizontal-sum tree, the P.V sum in registers) against the torch
    path, context lengths on and off multiples of 8; and each row's output is bit for bit
    what it gets alone."""
    op = get_decode_kernel()
    if op is None:
        pytest.fail("the C++ decode kernel did not build on this machine")
    g = torch.Generator().manual_seed(hd + (window or 0))
    bs, nb = 16, 48
    kv = torch.randn(2, nb, bs, nkv, hd, generator=g)
    lens = [1, 7, 8, 9, 16, 31, 64, 65, 130, 200]
    width = (max(lens) + bs - 1) // bs
    tables = torch.stack([torch.randperm(nb, generator=g)[:width].to(torch.int32) for _ in lens]).contiguous()
    seq = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), nh, hd, generator=g)
    out = torch.empty_like(q)
    op(out, q, kv, tables, seq, len(lens), hd ** -0.5, window or 0, cap)
    ref = decode_attention_torch(q, kv, tables, seq, max(lens), hd ** -0.5, window, logits_soft_cap=cap or None)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for i in range(len(lens)):
        one = torch.empty(1, nh, hd)
        op(one, q[i:i + 1].contiguous(), kv, tables[i:i + 1].contiguous(), seq[i:i + 1].contiguous(), 1,
           hd ** -0.5, window or 0, cap)
        assert torch.equal(out[i], one[0]), f"row {i}"
