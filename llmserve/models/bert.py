"""BERT encoder (``BertModel``, e.g. sentence-transformers/all-MiniLM-L6-v2) for pooling.

Follows transformers' ``modeling_bert`` numerically (post-LayerNorm blocks, exact-erf
GELU, absolute position embeddings, token type 0 unless a text pair gives them) with
vLLM's layout: flat token batches (``[T, hidden]``), fused q/k/v. Attention is
bidirectional over each whole prompt (``scaled_dot_product_attention`` with a key-padding
mask). No KV cache is read or kept.

Batch invariance: a prompt's embedding must not depend on what else is in the step (an
input embedded alone, or beside others, gives the same vector bit for bit). CPU GEMM
kernels (oneDNN/MKL) reduce differently with the number of rows M and a row's offset, so
every linear runs on fixed ``CHUNK``-row blocks (the flat batch is zero-padded to a
multiple of CHUNK) of one batched GEMM, in which each row's result was measured to
depend on that row only; attention gathers q/k/v of prompts of the same padded length
into one SDPA call (``_Layout``) and pooling runs per prompt. The linears never see the
attention padding (about 8% of the rows at 8-128 words with 16-token buckets).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.ops import onednn_linear


#: Rows per GEMM block (see the module docstring); 64 keeps the GEMMs near full speed.
CHUNK = 64
#: Attention pads each prompt to a multiple of BUCKET tokens and batches equal lengths
#: (only attention sees the padding, so a small bucket wastes little).
BUCKET = 8


def _linear(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """``lin(x)`` (x rows a multiple of CHUNK). With the weight packed for oneDNN
    (``ops/onednn_linear.py``; 2.3x faster here in float32) one GEMM: a row's result is the
    same in every GEMM of >= 4 rows. Otherwise fixed CHUNK-row blocks of ``x`` as one
    batched GEMM over the blocks (as fast as one big GEMM here, measured; a Python loop of
    small GEMMs was many times slower on a busy 2-core machine)."""
    if lin.weight.is_mkldnn:
        return onednn_linear.linear(x, lin.weight, lin.bias)
    n = x.shape[0] // CHUNK
    w = lin.weight.t().expand(n, -1, -1)
    return torch.baddbmm(lin.bias, x.view(n, CHUNK, -1), w).view(n * CHUNK, -1)


class _Layer(nn.Module):
    def __init__(self, h: int, inter: int, heads: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.eps = heads, eps
        self.qkv = nn.Linear(h, 3 * h, dtype=dtype)
        self.attn_out = nn.Linear(h, h, dtype=dtype)
        self.attn_norm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.inter = nn.Linear(h, inter, dtype=dtype)
        self.out = nn.Linear(inter, h, dtype=dtype)
        self.out_norm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        for lin in (self.qkv, self.attn_out, self.inter, self.out):
            lin.onednn_packable = True  # run by _linear, which takes packed weights

    def forward(self, x: torch.Tensor, layout: "_Layout") -> torch.Tensor:
        """x: ``[rows, H]``, the flat tokens then ``tail`` zero rows (see ``_Layout``)."""
        H = x.shape[1]
        nh, hd = self.heads, H // self.heads
        # Padding costs only attention: the linears run on the flat rows, and q/k/v are
        # gathered into the padded per-bucket layout just for SDPA.
        qkv = _linear(x, self.qkv)[layout.src]
        outs = []
        for off, n, L, mask in layout.buckets:
            q, k, v = qkv[off:off + n * L].view(n, L, 3, nh, hd).permute(2, 0, 3, 1, 4)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(n * L, H))
        attn = torch.cat(outs)[layout.back]
        if layout.tail:
            attn = torch.cat([attn, attn.new_zeros(layout.tail, H)])
        x = self.attn_norm(x + _linear(attn, self.attn_out))
        return self.out_norm(x + _linear(F.gelu(_linear(x, self.inter)), self.out))


class _Layout:
    """Where each token sits: the linears and norms run on the flat tokens (``T`` rows,
    then ``tail`` zero rows up to a multiple of CHUNK); attention gathers them into
    buckets: prompts whose lengths round up to the same ``L`` (a multiple of BUCKET)
    form a bucket of ``n`` prompts x ``L`` rows, padded (padding rows are masked out of
    attention), buckets back to back. A prompt's result then depends only on its own
    rows and L, never on the other prompts (batch invariance).

    src: ``[R]`` flat token index of each bucket row (0 for padding); buckets: (row
    offset, n, L, key mask ``[n, 1, 1, L]``); back: ``[T]`` the bucket row of each flat
    token."""

    def __init__(self, lens: list[int], device: torch.device) -> None:
        groups: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for n in lens:
            groups.setdefault(-(-n // BUCKET) * BUCKET, []).append((start, n))
            start += n
        src: list[int] = []
        back = [0] * start
        self.buckets = []
        for L, members in sorted(groups.items()):
            off = len(src)
            ok = torch.zeros(len(members), L, dtype=torch.bool)
            for i, (st, n) in enumerate(members):
                row = off + i * L
                src.extend(range(st, st + n))
                src.extend([0] * (L - n))
                back[st:st + n] = range(row, row + n)
                ok[i, :n] = True
            self.buckets.append((off, len(members), L, ok[:, None, None, :].to(device)))
        self.tail = -start % CHUNK
        self.src = torch.tensor(src, device=device)
        self.back = torch.tensor(back, device=device)


class BertModel(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches (unused), attn_metadata)`` ->
    last hidden states ``[T, hidden]``; ``attn_metadata.query_lens_list`` gives each
    prompt's length, in order (the flat batch is the prompts back to back), and
    ``attn_metadata.token_type_ids`` (optional, ``[T]`` int64) each token's segment.
    ``load_weights`` takes HF names (``bert.`` prefix allowed; the pooler/MLM heads are
    ignored, except by ``seq_cls.BertForSequenceClassification``) and raises ValueError
    for a missing or misshapen tensor."""

    is_causal = False

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        eps = float(getattr(config, "layer_norm_eps", 1e-12))
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("BERT: only absolute position embeddings are supported")
        self.word_embeddings = nn.Embedding(config.vocab_size, h, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h, dtype=dtype)
        self.emb_norm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(h, config.intermediate_size, config.num_attention_heads, eps, dtype)
                                    for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                attn_metadata: Any) -> torch.Tensor:
        layout = _Layout(list(attn_metadata.query_lens_list), input_ids.device)
        types = getattr(attn_metadata, "token_type_ids", None)  # [T] int64, or None: all 0
        tt = self.token_type_embeddings.weight[0] if types is None else self.token_type_embeddings(types)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + tt
        x = self.emb_norm(x)
        T = x.shape[0]
        if layout.tail:
            x = torch.cat([x, x.new_zeros(layout.tail, x.shape[1])])
        for layer in self.layers:
            x = layer(x, layout)
        return x[:T]

    _NAMES = {
        "embeddings.word_embeddings.weight": "word_embeddings.weight",
        "embeddings.position_embeddings.weight": "position_embeddings.weight",
        "embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
        "embeddings.LayerNorm.weight": "emb_norm.weight", "embeddings.LayerNorm.bias": "emb_norm.bias",
    }
    _LAYER = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
              "intermediate.dense": "inter", "output.dense": "out", "output.LayerNorm": "out_norm"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, t in weights:
            name = name.removeprefix("bert.")
            target, rows = self._NAMES.get(name), None
            if name.startswith("encoder.layer."):
                i, rest = name[len("encoder.layer."):].split(".", 1)
                sub, _, kind = rest.rpartition(".")
                if sub.startswith("attention.self."):
                    shard = ("query", "key", "value").index(sub.rsplit(".", 1)[1])
                    target, rows = f"layers.{i}.qkv.{kind}", shard
                elif sub in self._LAYER:
                    target = f"layers.{i}.{self._LAYER[sub]}.{kind}"
            if target is None or target not in params:
                continue  # position_ids, the pooler and MLM heads
            dst = params[target].data
            if rows is not None:
                n = dst.shape[0] // 3
                dst = dst.narrow(0, rows * n, n)
                target = f"{target}#{rows}"
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"BERT weight {name}: shape {tuple(t.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(t)
            loaded.add(target)
        want = {n for n in params if ".qkv." not in n} | {f"{n}#{r}" for n in params if ".qkv." in n for r in range(3)}
        missing = sorted(want - loaded)
        if missing:
            raise ValueError(f"BERT checkpoint is missing weights: {missing[:5]}")
