"""BERT encoder (``BertModel``, e.g. sentence-transformers/all-MiniLM-L6-v2) for pooling.

Follows transformers' ``modeling_bert`` numerically (post-LayerNorm blocks, exact-erf
GELU, absolute position embeddings, token type 0) with vLLM's layout: flat token batches
(``[T, hidden]``, no padding in the linears), fused q/k/v. Attention is bidirectional over
each whole prompt: the q/k/v rows are scattered into a padded ``[B, L]`` batch only for
``scaled_dot_product_attention`` with a key-padding mask. No KV cache is read or kept.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, x: torch.Tensor, pad: Optional[tuple[torch.Tensor, torch.Tensor, int, int]]) -> torch.Tensor:
        T, H = x.shape
        nh, hd = self.heads, H // self.heads
        qkv = self.qkv(x)
        if pad is None:  # one sequence: no padding needed
            q, k, v = qkv.view(1, T, 3, nh, hd).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(T, H)
        else:
            flat_idx, mask, B, L = pad
            padded = qkv.new_zeros(B * L, 3 * H).index_copy_(0, flat_idx, qkv)
            q, k, v = padded.view(B, L, 3, nh, hd).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            a = a.transpose(1, 2).reshape(B * L, H).index_select(0, flat_idx)
        x = self.attn_norm(x + self.attn_out(a))
        return self.out_norm(x + self.out(F.gelu(self.inter(x))))


class BertModel(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches (unused), attn_metadata)`` ->
    last hidden states ``[T, hidden]``; ``attn_metadata.query_lens_list`` gives each
    prompt's length, in order (the flat batch is the prompts back to back).
    ``load_weights`` takes HF names (``bert.`` prefix allowed; the pooler/MLM heads are
    ignored) and raises ValueError for a missing or misshapen tensor."""

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
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.emb_norm(x)
        pad = _padding(attn_metadata.query_lens_list, x.device)
        for layer in self.layers:
            x = layer(x, pad)
        return x

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


def _padding(lens: list[int], device: torch.device) -> Optional[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """For several prompts: (flat row -> padded row index [T], key mask [B, 1, 1, L] bool,
    B, L); None for one prompt."""
    if len(lens) == 1:
        return None
    B, L = len(lens), max(lens)
    lens_t = torch.tensor(lens, device=device)
    valid = torch.arange(L, device=device)[None, :] < lens_t[:, None]  # [B, L]
    flat_idx = valid.reshape(-1).nonzero().squeeze(1)
    return flat_idx, valid[:, None, None, :], B, L
