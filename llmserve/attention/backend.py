"""Paged attention over a block-structured KV cache (vLLM's PagedAttention, Kwon et al. 2023).

KV cache of one layer: a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` in the
model dtype (index 0 keys, 1 values). A token's K/V live in slot ``block_id * block_size +
offset``; each request owns a list of blocks (its row of ``block_tables``).

Each step the model hands the attention layer the flat tokens of all scheduled requests,
decodes first (vLLM v1 orders its persistent batch the same way). ``PagedAttention.forward``
1. writes this step's K/V into the cache at ``slot_mapping``;
2. on the CPU with the C++ kernel of ``llmserve.ops.cpu_ops`` built, runs every
   token (decodes and prompt tokens alike) in one call, each token one query over its
   causal context in the cache; otherwise:
3. runs the decode requests (one query token each) in one batched pure-torch gather op,
4. and each prefill / prefill chunk with ``scaled_dot_product_attention`` over its
   context, causal within the chunk: query i of a request with query_len q and seq_len s
   sees keys ``0 .. s - q + i`` (and, with a sliding window W, only keys > position - W,
   as transformers' ``sliding_window_overlay``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from llmserve.ops import cpu_ops


@dataclass
class AttentionMetadata:
    """Per-step layout of the flat token batch, shared by all layers (vLLM's
    ``CommonAttentionMetadata``).

    num_actual_tokens: T, tokens in this step. slot_mapping: ``[T]`` int64, KV slot of each
    token. query_start_loc: ``[B+1]`` int32 (CPU), cumulative query lengths. seq_lens:
    ``[B]`` int32, context length of each request INCLUDING this step's tokens.
    block_tables: ``[B, max_blocks_per_req]`` int32 block ids, padded with 0. num_decodes:
    the first ``num_decodes`` requests have exactly one query token. query_lens_list /
    seq_lens_list: python copies (no tensor syncs). max_seq_len: max of seq_lens.
    block_size: tokens per KV block.

    Build a new object each step: layers cache step-derived tensors (decode masks, int32
    tables) in ``_derived`` and reuse them across layers.
    """

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_seq_len: int
    block_size: int
    # Several KV cache groups (a hybrid model, worker/kv_cache_groups.py): this batch's
    # metadata per group (its block tables and slot mapping; the first is this object).
    # Each PagedAttention layer reads its group's (``kv_cache_group``). None: one group.
    kv_groups: Optional[list] = field(default=None, repr=False, compare=False)
    # Tensors derived once per step and reused by every layer (decode masks, block views).
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    def query_starts(self) -> list[int]:
        """Python list of the B+1 cumulative query offsets (computed once)."""
        qs = self._derived.get("query_starts")
        if qs is None:
            qs = [0]
            for q in self.query_lens_list:
                qs.append(qs[-1] + q)
            self._derived["query_starts"] = qs
        return qs


def build_attn_metadata(query_lens: Sequence[int], seq_lens: Sequence[int],
                        block_ids: Sequence[Sequence[int]], block_size: int,
                        device: torch.device | str = "cpu") -> AttentionMetadata:
    """Build ``AttentionMetadata`` from per-request python lists.

    query_lens[i]: tokens of request i in this step; seq_lens[i]: its context length after
    this step; block_ids[i]: its KV block ids (enough for seq_lens[i] tokens). The leading
    requests with one query token become ``num_decodes`` (put decodes first); a one-token
    chunk after a longer one is run as a prefill. The tokens of request i are at positions
    ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``.

    Raises ValueError for inconsistent lengths or too few blocks.
    """
    if not (len(query_lens) == len(seq_lens) == len(block_ids)):
        raise ValueError("query_lens, seq_lens and block_ids must have the same length")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    slots: list[int] = []
    for i, (q, s, blocks) in enumerate(zip(query_lens, seq_lens, block_ids)):
        if q < 1 or s < q:
            raise ValueError(f"request {i}: need 1 <= query_len <= seq_len, got {q}, {s}")
        if len(blocks) * block_size < s:
            raise ValueError(f"request {i}: {len(blocks)} blocks cannot hold {s} tokens")
        for pos in range(s - q, s):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    max_blocks = max((len(b) for b in block_ids), default=0)
    table = torch.zeros(len(block_ids), max(max_blocks, 1), dtype=torch.int32)
    for i, blocks in enumerate(block_ids):
        if blocks:
            table[i, :len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(list(query_lens), dtype=torch.int32).cumsum(0)
    return AttentionMetadata(
        num_actual_tokens=sum(query_lens),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=qsl,
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=table.to(device),
        num_decodes=num_decodes,
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
    )


def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, int, int, int, int]:
    """Shape of one layer's KV cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    (vLLM's ``AttentionBackend.get_kv_cache_shape``)."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def write_to_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Store K/V ``[T, num_kv_heads, head_dim]`` at the flat slots ``slot_mapping [T]``
    of ``kv_cache`` (vLLM's ``reshape_and_cache``); casts to the cache dtype."""
    _, nb, bs, nkv, hd = kv_cache.shape
    if (key.device.type == "cpu" and key.dtype == value.dtype and cpu_ops.kv_dtypes_ok(key.dtype, kv_cache.dtype)
            and slot_mapping.dtype == torch.long and key.stride(-1) == 1 and value.stride(-1) == 1
            and key.stride(1) == hd and value.stride(1) == hd):
        ops = cpu_ops.cpu_ops_for(key)
        if ops is not None:
            ops.reshape_and_cache(key, value, kv_cache, slot_mapping)
            return
    kv_cache[0].view(nb * bs, nkv, hd).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, nkv, hd).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def decode_attention_torch(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           max_seq_len: int, scale: float,
                           sliding_window: Optional[int] = None,
                           _cache: Optional[dict] = None,
                           logits_soft_cap: Optional[float] = None) -> torch.Tensor:
    """Batched single-token attention over paged K/V, in pure torch (the reference path).

    query: ``[N, num_heads, head_dim]``; kv_cache: one layer's cache; block_tables ``[N, M]``
    and seq_lens ``[N]`` of the N decode requests; max_seq_len: max of seq_lens.
    Gathers each request's blocks (a copy), masks keys past seq_len (and, with a sliding
    window W, keys at or before ``seq_len - 1 - W``), softmax in float32. ``logits_soft_cap``
    c: scores become ``c * tanh(scores / c)`` before the mask (Gemma 2, see ``soft_cap``).
    Runs in the query dtype (K/V of a narrower cache are widened). Returns ``[N, num_heads,
    head_dim]`` in the query dtype.
    """
    n, nh, hd = query.shape
    _, _, bs, nkv, _ = kv_cache.shape
    g = nh // nkv
    nblk = (max_seq_len + bs - 1) // bs
    key = None if _cache is None else _cache.get(("mask", sliding_window))
    if key is None:
        bt = block_tables[:n, :nblk].to(query.device, torch.long)
        pos = torch.arange(nblk * bs, device=query.device)
        last = seq_lens[:n].to(query.device, torch.long).unsqueeze(1)
        mask = pos.unsqueeze(0) >= last
        if sliding_window is not None:
            mask |= pos.unsqueeze(0) <= last - 1 - sliding_window
        key = (bt, mask.view(n, 1, 1, nblk * bs))
        if _cache is not None:
            _cache[("mask", sliding_window)] = key
    bt, mask = key
    k = kv_cache[0][bt].view(n, nblk * bs, nkv, hd)
    v = kv_cache[1][bt].view(n, nblk * bs, nkv, hd)
    if k.dtype is not query.dtype:  # a narrower cache (--kv-cache-dtype): widened exactly
        k, v = k.to(query.dtype), v.to(query.dtype)
    q = query.view(n, nkv, g, hd)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)).float()  # [n, nkv, g, L]
    scores.mul_(scale)
    if logits_soft_cap:
        scores = soft_cap(scores, logits_soft_cap)
    scores.masked_fill_(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))  # [n, nkv, g, hd]
    return out.reshape(n, nh, hd).to(query.dtype)


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Attention logit soft-capping ``cap * tanh(scores / cap)`` (Gemma 2's
    ``attn_logit_softcapping``, applied to the scaled scores before the mask and softmax as
    transformers' ``eager_attention_forward``; vLLM's ``logits_soft_cap``)."""
    return torch.tanh(scores / cap) * cap


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                      scale: float, cap: float) -> torch.Tensor:
    """Eager attention with soft-capped scores (SDPA has no soft cap). q ``[B, H, q, D]``,
    k/v ``[B, KV, s, D]``, mask ``[q, s]`` bool (True = attend) or None for causal q == s."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = soft_cap(torch.matmul(q, k.transpose(-1, -2)).float() * scale, cap)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float, sliding_window: Optional[int] = None,
                      logits_soft_cap: Optional[float] = None) -> torch.Tensor:
    """Attention of one request's chunk over its whole context with SDPA.

    query ``[q, num_heads, head_dim]``; key/value ``[s, num_kv_heads, head_dim]`` (s >= q;
    the query tokens are the last q of the s). Query i sees keys ``0 .. s - q + i``.
    A leading batch dimension (``[B, q, ...]`` and ``[B, s, ...]``) runs B such requests
    of the same lengths in one call. ``logits_soft_cap``: soft-capped scores (eager
    attention instead of SDPA).
    Runs in the query dtype, except float16 on CPU (float32 there). Measured here for
    prompt shapes (9/3 heads, head dim 64, 256-1024 tokens), bf16 SDPA with GQA is as fast
    as float32 (the slow bf16 case in DESIGN.md is the decode shape, handled elsewhere).
    Returns ``[q, num_heads, head_dim]`` in the query dtype.
    """
    batched = query.dim() == 4
    if not batched:
        query, key, value = query[None], key[None], value[None]
    ql, nh, hd = query.shape[1:]
    sl, nkv, _ = key.shape[1:]
    cpu_half = query.device.type == "cpu" and query.dtype == torch.float16
    work = torch.float32 if cpu_half else query.dtype
    q = query.transpose(1, 2).to(work)
    k = key.transpose(1, 2).to(work)
    v = value.transpose(1, 2).to(work)
    mask = None
    causal = sl == ql and sliding_window is None
    if not causal:
        qpos = torch.arange(sl - ql, sl, device=query.device).unsqueeze(1)
        kpos = torch.arange(sl, device=query.device).unsqueeze(0)
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
    if logits_soft_cap:
        out = _capped_attention(q, k, v, mask, scale, logits_soft_cap)
    else:
        # 4-D inputs ([B, heads, L, D]) select torch's flash-attention CPU kernel; 3-D ones
        # fall back to the much slower math path.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             scale=scale, enable_gqa=nkv != nh)
    out = out.transpose(1, 2).to(query.dtype)
    return out if batched else out[0]


class PagedAttention:
    """One layer's attention over the paged KV cache (vLLM's ``Attention`` layer).

    num_heads / num_kv_heads / head_dim: the layer's shape (GQA when num_kv_heads <
    num_heads); scale: softmax scale (``head_dim ** -0.5``); sliding_window: attend only to
    the last ``sliding_window`` positions (Mistral/Qwen2 windowed layers, Gemma 2/3's
    sliding layers), None for full; logits_soft_cap: ``c * tanh(scores / c)`` on the scaled
    scores (Gemma 2's ``attn_logit_softcapping``, vLLM's ``logits_soft_cap``), None for none.
    use_kernel: try the C++ decode kernel (falls back to torch if it cannot be built).
    ``kv_cache_group``: its KV cache group (0; a hybrid model's runner sets it).
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: Optional[int] = None, use_kernel: bool = True,
                 logits_soft_cap: Optional[float] = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.use_kernel = use_kernel
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        # The KV cache group whose block tables this layer reads (set by the model runner
        # for hybrid models; ``AttentionMetadata.kv_groups``).
        self.kv_cache_group = 0

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: Optional[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """query ``[T, num_heads*head_dim]``, key/value ``[T, num_kv_heads*head_dim]`` ->
        ``[T, num_heads*head_dim]``. ``kv_cache`` None (or empty) runs without a cache:
        every request must then be a whole prompt (seq_len == query_len)."""
        groups = attn_metadata.kv_groups
        md = attn_metadata if groups is None else groups[self.kv_cache_group]
        if (self.use_kernel and kv_cache is not None and cpu_ops.kv_dtypes_ok(query.dtype, kv_cache.dtype)
                and key.dtype is query.dtype and value.dtype is query.dtype):
            step = _cpu_kernel_step(md, query, kv_cache)
            if step is not None:
                return self._forward_cpu_kernels(query, key, value, kv_cache, step)
        t = md.num_actual_tokens
        q = query[:t].view(t, self.num_heads, self.head_dim)
        k = key[:t].view(t, self.num_kv_heads, self.head_dim)
        v = value[:t].view(t, self.num_kv_heads, self.head_dim)
        has_cache = kv_cache is not None and kv_cache.numel() > 0
        if has_cache:
            write_to_kv_cache(k, v, kv_cache, md.slot_mapping[:t])
        out = torch.empty_like(q)
        if has_cache and self.use_kernel and q.device.type == "cpu":
            op = cpu_ops.get_decode_kernel()
            if op is not None:
                # Every token, prompt tokens included, as one query over its own causal
                # context in the paged cache (written above): one kernel call per layer, and
                # the same arithmetic whether a prompt runs whole, in chunks or after a
                # prefix-cache hit.
                tables, lens = _token_tables(md)
                op(out, q, kv_cache, tables, lens, t, self.scale, self.sliding_window or 0,
                   self.logits_soft_cap or 0.0)
                return out.view(t, self.num_heads * self.head_dim)
        nd = md.num_decodes
        if nd:
            if not has_cache:
                raise ValueError("decode requests need a KV cache")
            self._decode(q[:nd], kv_cache, md, out[:nd])
        starts = md.query_starts()
        whole: dict[int, list[int]] = {}  # whole prompts in this step, by length
        for i in range(nd, md.num_reqs):
            s0, s1 = starts[i], starts[i + 1]
            sl = md.seq_lens_list[i]
            if sl == s1 - s0:  # whole prompt in this step: its K/V are at hand
                whole.setdefault(sl, []).append(i)
                continue
            if not has_cache:
                raise ValueError("a prefill chunk with earlier context needs a KV cache")
            ki, vi = self._gather_context(kv_cache, md, i, sl)
            out[s0:s1] = prefill_attention(q[s0:s1], ki, vi, self.scale, self.sliding_window,
                                           self.logits_soft_cap)
        for length, reqs in whole.items():
            if len(reqs) == 1:
                s0, s1 = starts[reqs[0]], starts[reqs[0] + 1]
                out[s0:s1] = prefill_attention(q[s0:s1], k[s0:s1], v[s0:s1], self.scale,
                                               self.sliding_window, self.logits_soft_cap)
                continue
            # Prompts of equal length run as one batched SDPA call (fewer, larger kernels).
            sel = [slice(starts[i], starts[i + 1]) for i in reqs]
            res = prefill_attention(torch.stack([q[x] for x in sel]), torch.stack([k[x] for x in sel]),
                                    torch.stack([v[x] for x in sel]), self.scale, self.sliding_window,
                                    self.logits_soft_cap)
            for j, x in enumerate(sel):
                out[x] = res[j]
        return out.view(t, self.num_heads * self.head_dim)

    __call__ = forward

    @staticmethod
    def _gather_context(kv_cache: torch.Tensor, md: AttentionMetadata, i: int,
                        seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs = md.block_size
        nblk = (seq_len + bs - 1) // bs
        ids = md.block_tables[i, :nblk].to(kv_cache.device, torch.long)
        nkv, hd = kv_cache.shape[-2:]
        k = kv_cache[0][ids].view(nblk * bs, nkv, hd)[:seq_len]
        v = kv_cache[1][ids].view(nblk * bs, nkv, hd)[:seq_len]
        return k, v  # in the cache's dtype; prefill_attention widens them to the query's

    def _forward_cpu_kernels(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             kv_cache: torch.Tensor, step: "_CpuKernelStep") -> torch.Tensor:
        """``forward``'s kernel path with the step's checks done once (``_cpu_kernel_step``):
        the cache write and one ``paged_decode`` call, every token as one query over its own
        causal context. The general path's per-layer checks, slices and lookups cost ~11 us
        a layer against ~4 us of kernels at one decode row (SmolLM2: ~0.3 ms of a 5 ms step)."""
        t, h, d, kvh = step.t, self.num_heads, self.head_dim, self.num_kv_heads
        if query.shape[0] == t:
            q, k, v = query.view(t, h, d), key.view(t, kvh, d), value.view(t, kvh, d)
        else:
            q, k, v = query[:t].view(t, h, d), key[:t].view(t, kvh, d), value[:t].view(t, kvh, d)
        ops = step.ops
        ops.reshape_and_cache(k, v, kv_cache, step.slots)
        out = torch.empty_like(q)
        ops.paged_decode(out, q, kv_cache, step.tables, step.lens, t, self.scale, self.sliding_window or 0,
                         self.logits_soft_cap or 0.0)
        return out.view(t, h * d)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                out: torch.Tensor) -> None:
        """Attention of the ``num_decodes`` one-token requests, written into ``out``, by the
        pure-torch gather path (``forward`` sends every token to the C++ kernel when it
        is available)."""
        nd = md.num_decodes
        max_len = md._derived.get("decode_max_len")
        if max_len is None:
            max_len = max(md.seq_lens_list[:nd])
            md._derived["decode_max_len"] = max_len
        out.copy_(decode_attention_torch(q, kv_cache, md.block_tables, md.seq_lens, max_len,
                                         self.scale, self.sliding_window, md._derived,
                                         self.logits_soft_cap))


class _CpuKernelStep:
    """What every layer's kernel path needs from one step's metadata, built once."""

    __slots__ = ("t", "slots", "tables", "lens", "ops")

    def __init__(self, t: int, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, ops: Any) -> None:
        self.t, self.slots, self.tables, self.lens, self.ops = t, slots, tables, lens, ops


def _cpu_kernel_step(md: AttentionMetadata, query: torch.Tensor,
                     kv_cache: torch.Tensor) -> Optional[_CpuKernelStep]:
    """The step's kernel inputs when the CPU kernels can run it (CPU tensors, a non-empty
    cache, int64 slots, kernels built), else None; cached in ``md._derived`` by the cache's
    dtype (the caller checked query's dtype against it), so layers after the first pay a
    dict lookup. The kernels check shapes and strides themselves (RuntimeError)."""
    key = ("cpu_kernel_step", kv_cache.dtype)
    if key in md._derived:
        return md._derived[key]
    step = None
    ops = cpu_ops.get_cpu_ops() if query.device.type == "cpu" and kv_cache.device.type == "cpu" else None
    if ops is not None and kv_cache.numel() > 0 and md.slot_mapping.dtype == torch.long:
        t = md.num_actual_tokens
        tables, lens = _token_tables(md)
        step = _CpuKernelStep(t, md.slot_mapping[:t].contiguous(), tables, lens, ops)
    md._derived[key] = step
    return step


def _token_tables(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token block tables ``[T, M]`` int32 and causal context lengths ``[T]`` int32:
    token i of request r (query_len q, seq_len s) sees positions ``0 .. s - q + i``, so its
    length is ``s - q + i + 1`` and its table is row r. Decode-only steps reuse the request
    tables as they are. Built once per step (cached in ``md._derived``)."""
    cached = md._derived.get("token_tables")
    if cached is not None:
        return cached
    bt = md.block_tables.to(torch.int32)
    sl = md.seq_lens.to(torch.int32)
    if md.num_decodes == md.num_reqs:
        cached = (bt.contiguous(), sl.contiguous())
    else:
        qlens = torch.tensor(md.query_lens_list, dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(md.num_reqs), qlens)
        ends = md.query_start_loc[1:].to(torch.long)  # one past each request's last token
        offset_from_end = ends[row] - 1 - torch.arange(md.num_actual_tokens)
        lens = (sl.to(torch.long)[row] - offset_from_end).to(torch.int32)
        cached = (bt.index_select(0, row.to(bt.device)).contiguous(), lens.contiguous())
    md._derived["token_tables"] = cached
    return cached


def default_scale(head_dim: int) -> float:
    """Softmax scale ``1 / sqrt(head_dim)`` (Vaswani et al. 2017)."""
    return 1.0 / math.sqrt(head_dim)
