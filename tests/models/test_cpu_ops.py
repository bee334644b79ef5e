"""The C++ CPU ops against the torch code they replace (transformers' numerics).

float32: equal up to summation order. bfloat16: the ops round to bf16 where transformers'
separate torch ops do, so results agree to bf16 rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.attention.backend import write_to_kv_cache
from llmserve.ops.cpu_ops import get_cpu_ops
from llmserve.models.llama import RotaryEmbedding, apply_rope, compute_inv_freq

ops = get_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="C++ CPU ops could not be built here")

DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


def hf_rms_norm(x, w, eps):
    """transformers' LlamaRMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 37])  # vector body and scalar tail
def test_rms_norm_and_fused_add(dtype, hidden):
    torch.manual_seed(0)
    x = torch.randn(33, hidden, dtype=dtype) * 3
    res = torch.randn(33, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    torch.testing.assert_close(out, hf_rms_norm(x, w, 1e-6), **tol(dtype))
    # fused: residual <- x + residual (rounded to dtype), out <- norm(residual)
    res_ref = x + res
    ops.fused_add_rms_norm(out, x, res, w, 1e-6)
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)
    torch.testing.assert_close(out, hf_rms_norm(res_ref, w, 1e-6), **tol(dtype))


def test_rms_norm_on_strided_heads():
    """Qwen3's per-head norm runs on a [T, heads, head_dim] view of the fused qkv output."""
    torch.manual_seed(1)
    qkv = torch.randn(5, 3 * 32 + 40)
    x = qkv[:, :96].view(5, 3, 32)
    w = torch.randn(32)
    out = torch.empty(5, 3, 32)
    ops.rms_norm(out, x, w, 1e-6)
    torch.testing.assert_close(out, hf_rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 21])
def test_silu_and_mul(dtype, inter):
    torch.manual_seed(2)
    gate_up = torch.randn(17, 2 * inter, dtype=dtype) * 4
    out = torch.empty(17, inter, dtype=dtype)
    ops.silu_and_mul(out, gate_up)
    ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(out, ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rotary_embedding_in_place(dtype, head_dim):
    torch.manual_seed(3)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    pos = torch.tensor([0, 5, 4095, 17, 1000])
    qkv = torch.randn(5, (4 + 2 + 2) * head_dim, dtype=dtype)
    x = qkv[:, :6 * head_dim].view(5, 6, head_dim)  # q and k heads of the fused output
    cos, sin = rope.cos_sin(pos, dtype)
    ref = apply_rope(x.clone(), cos, sin)
    v_before = qkv[:, 6 * head_dim:].clone()
    ops.rotary_embedding(pos, x, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(x, ref, **tol(dtype))
    assert torch.equal(qkv[:, 6 * head_dim:], v_before)  # V untouched
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rotary_embedding(torch.tensor([0, 1, 2, 3, 4096]), x, rope.cos_cache, rope.sin_cache)


def test_reshape_and_cache_matches_index_copy(monkeypatch):
    torch.manual_seed(4)
    kv_a = torch.zeros(2, 6, 4, 2, 16)
    kv_b = torch.zeros(2, 6, 4, 2, 16)
    qkv = torch.randn(5, 3 * 32)
    k, v = qkv[:, 32:64].view(5, 2, 16), qkv[:, 64:].view(5, 2, 16)
    slots = torch.tensor([7, 0, 23, 12, 13])
    ops.reshape_and_cache(k, v, kv_a, slots)
    from llmserve.ops import cpu_ops
    monkeypatch.setattr(cpu_ops, "get_cpu_ops", lambda: None)
    write_to_kv_cache(k, v, kv_b, slots)
    assert torch.equal(kv_a, kv_b) and kv_a.abs().sum() > 0
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.reshape_and_cache(k, v, kv_a, torch.tensor([0, 1, 2, 3, 48]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_to_float(dtype):
    x = torch.randn(7, 1000).to(dtype)[:, 3:]  # strided rows
    out = torch.empty(7, 997)
    ops.to_float(out, x)
    assert torch.equal(out, x.float())


def test_llama3_inv_freq_feeds_the_kernel_tables():
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(32, 512, params)
    assert torch.equal(rope.inv_freq, compute_inv_freq(32, params, 512))
    x = torch.randn(3, 2, 32)
    pos = torch.tensor([1, 100, 511])
    ref = apply_rope(x.clone(), *rope.cos_sin(pos, torch.float32))
    ops.rotary_embedding(pos, x, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(x, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_model_same_with_and_without_kernels(tmp_path, save_tiny_model_fn, model_config_fn,
                                                     tokens_fn, step_runner_cls, monkeypatch):
    """A whole bf16 step (prefill chunk + decodes) through the kernels and through the torch
    paths: logits agree to bf16 noise and the greedy tokens are the same."""
    from llmserve.ops import cpu_ops
    from llmserve.model_loader import get_model, load_hf_config, resolve_model

    save_tiny_model_fn("llama", str(tmp_path))
    resolved = resolve_model(str(tmp_path))
    model = get_model(model_config_fn(resolved, load_hf_config(resolved), "bfloat16"))
    seqs = {"a": tokens_fn(20, 5), "b": tokens_fn(12, 6)}

    def run():
        r = step_runner_cls(model)
        outs = [r.step([("a", seqs["a"][:19]), ("b", seqs["b"][:11])]),
                r.step([("a", seqs["a"][19:]), ("b", seqs["b"][11:])])]
        return torch.cat([o[k] for o in outs for k in ("a", "b")])

    fast = run()
    monkeypatch.setattr(cpu_ops, "get_cpu_ops", lambda: None)
    slow = run()
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))
    torch.testing.assert_close(fast, slow, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_token_bitmask_equals_xgrammar(dtype):
    """Our grammar-mask kernel against xgrammar's on random words (incl. all-clear and
    all-set), a vocab that is not a multiple of 32 and longer logits rows than the mask,
    rows out of order and a bitmask row per logits row that is not its own index."""
    import xgrammar as xgr

    torch.manual_seed(0)
    V, W = 1000, 32  # 32 words cover 1024 > V; logits are wider still
    bm = torch.randint(-2**31, 2**31 - 1, (6, W), dtype=torch.int32)
    bm[0, :5], bm[1, 5:9] = 0, -1
    logits = torch.randn(9, 1030, dtype=dtype)
    rows, bm_rows = [7, 2, 4, 0], [1, 0, 5, 3]
    got = logits.clone()
    ops.apply_token_bitmask(got, bm, torch.tensor(rows), torch.tensor(bm_rows))
    want = logits.clone()
    aligned = torch.full((9, W), -1, dtype=torch.int32)
    aligned[rows] = bm[bm_rows]
    xgr.apply_token_bitmask_inplace(want, aligned, vocab_size=1024, indices=rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3, 5, 6, 8]], logits[[1, 3, 5, 6, 8]])  # unconstrained rows untouched
    assert torch.isinf(got[2, :160]).all() and torch.equal(got[:, 1024:], logits[:, 1024:])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.apply_token_bitmask(got, bm, torch.tensor([9]), torch.tensor([0]))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nkv,hd", [(3, 64), (3, 6)])  # vector rows; an 18-value row (scalar tail)
def test_reshape_and_cache_narrows_float32_as_torch_rounds(cache_dtype, nkv, hd, monkeypatch):
    """float32 K/V into a float16 / bfloat16 cache (--kv-cache-dtype): the same bits as
    torch's ``.to()`` (round to nearest even), ties, tiny and huge values and NaN included."""
    torch.manual_seed(5)
    t = 9
    k, v = torch.randn(t, nkv, hd) * 3, torch.randn(t, nkv, hd)
    one = torch.tensor(1.0).view(torch.int32)
    k.view(-1)[:4] = torch.stack([one + 0x8000, one + 0x18000, one + 0x1000, one + 0x7fff]).view(torch.float32)
    k.view(-1)[4:9] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, 7e4])
    kv_a = torch.zeros(2, 4, 4, nkv, hd, dtype=cache_dtype)
    kv_b = torch.zeros_like(kv_a)
    slots = torch.tensor([3, 0, 15, 7, 5, 8, 2, 11, 1])
    ops.reshape_and_cache(k, v, kv_a, slots)
    from llmserve.ops import cpu_ops
    monkeypatch.setattr(cpu_ops, "get_cpu_ops", lambda: None)
    write_to_kv_cache(k, v, kv_b, slots)
    nan = kv_b.isnan()
    assert nan.sum() == 1 and torch.equal(kv_a.isnan(), nan)
    assert torch.equal(kv_a[~nan].view(torch.int16), kv_b[~nan].view(torch.int16))
    with pytest.raises(RuntimeError, match="float32 into float16/bfloat16"):
        ops.reshape_and_cache(k.to(torch.bfloat16), v.to(torch.bfloat16), kv_a.to(torch.float16), slots)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nkv,nh,hd,window,cap", [(3, 9, 64, 0, 0.0), (2, 8, 128, 40, 0.0), (3, 9, 64, 0, 30.0),
                                                  (2, 4, 24, 0, 0.0)])
def test_paged_decode_reads_a_narrow_cache_as_its_float32_widening(cache_dtype, nkv, nh, hd, window, cap):
    """float32 queries over a float16 / bfloat16 cache give the same bits as over a float32
    cache holding the widened values (widening is exact; the arithmetic is the float32
    kernel's), on the vector paths (head dims 64, 128) and the generic one (24)."""
    g = torch.Generator().manual_seed(6)
    nb, bs = 24, 16
    kv = torch.randn(2, nb, bs, nkv, hd, generator=g).to(cache_dtype)
    lens = torch.tensor([1, 17, 100, 255, 64, 33], dtype=torch.int32)
    tables = torch.stack([torch.randperm(nb, generator=g)[:16] for _ in lens]).to(torch.int32).contiguous()
    q = torch.randn(len(lens), nh, hd, generator=g)
    out, ref = torch.empty_like(q), torch.empty_like(q)
    ops.paged_decode(out, q, kv, tables, lens, len(lens), hd ** -0.5, window, cap)
    ops.paged_decode(ref, q, kv.float(), tables, lens, len(lens), hd ** -0.5, window, cap)
    assert torch.equal(out, ref)
    with pytest.raises(RuntimeError, match="float16/bfloat16 under float32 q"):
        ops.paged_decode(out.to(torch.bfloat16), q.to(torch.bfloat16), kv.to(torch.float16), tables, lens,
                         len(lens), hd ** -0.5, window, cap)
