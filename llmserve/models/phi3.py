"""Phi-3 / Phi-3.5 / Phi-4-mini (HF ``Phi3ForCausalLM``) on llama.py's blocks.

The layer is Llama's (pre-norm, SiLU-gated MLP, GQA); the checkpoint already holds the
fused ``qkv_proj`` and ``gate_up_proj`` weights (q, k, v and gate, up in llmserve's order).
What differs is RoPE, as transformers' ``modeling_phi3`` / ``modeling_rope_utils``:
- partial rotary (``partial_rotary_factor``, Phi-4-mini 0.75): only the first
  ``int(head_dim * factor)`` dims of each head rotate;
- LongRoPE (``rope_type`` ``longrope``, formerly ``su``): inverse frequencies divided by
  per-dim ``short_factor`` or ``long_factor``, cos/sin times the attention factor
  (``attention_factor``, else ``sqrt(1 + ln(s) / ln(original_max_position_embeddings))``
  with ``s = max_position_embeddings / original_max_position_embeddings``). A request
  whose sequence is longer than ``original_max_position_embeddings`` runs this step's
  tokens on the long factors (HF picks them when the forward's sequence is that long;
  vLLM's ``Phi3LongRoPEScaledRotaryEmbedding`` decides per batch, here per request); keys
  already cached keep the rotation they were written with, as in both.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from llmserve.attention.backend import AttentionMetadata
from llmserve.models.llama import (LlamaForCausalLM, RopeInputs, RotaryEmbedding, _rope_parameters, apply_rope,
                                   compute_inv_freq, rope_attention_factor)
from llmserve.ops.cpu_ops import cpu_ops_for

_LONGROPE = ("longrope", "su")


class Phi3RotaryEmbedding(RotaryEmbedding):
    """RoPE over the first ``rotary_dim`` dims with optional LongRoPE. Tables
    ``[2 * rows, rotary_dim // 2]`` float32: rows ``0 .. rows-1`` hold the short factors
    (or plain RoPE), rows ``rows ..`` the long ones; a token on the long factors indexes
    ``position + rows``. Raises ValueError for an unsupported rope type."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        nn.Module.__init__(self)
        self.max_position = int(max_position)
        self.rotary_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
        self.longrope = params["rope_type"] in _LONGROPE
        self.original_max = int(params.get("original_max_position_embeddings") or max_position)
        self.mscale = 1.0
        if self.longrope:
            base = float(params["rope_theta"])
            shape = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
            short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * base ** shape)
            long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * base ** shape)
            self.mscale = _longrope_mscale(params, self.max_position, self.original_max)
        else:
            short = long = compute_inv_freq(self.rotary_dim, params, max_position)
            self.mscale = rope_attention_factor(params)
        self.register_buffer("inv_freq", short, persistent=False)
        self.register_buffer("long_inv_freq", long, persistent=False)
        self.rows = min(self.max_position, self._INITIAL_ROWS)
        cos, sin = self._tables(self.rows)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _tables(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(rows, dtype=torch.float32)
        freqs = torch.cat([torch.outer(t, self.inv_freq), torch.outer(t, self.long_inv_freq)])
        return freqs.cos() * self.mscale, freqs.sin() * self.mscale

    def ensure_positions(self, positions: torch.Tensor, max_pos: Optional[int] = None) -> None:
        """Grow the tables to cover ``positions`` (plain positions, before the long offset);
        ValueError for a position >= max_position_embeddings."""
        if positions.numel():
            top = int(positions.max()) if max_pos is None else max_pos
            if top >= self.rows:
                if top >= self.max_position:
                    raise ValueError(f"position {top} exceeds max_position_embeddings ({self.max_position})")
                self.rows = self.max_position
                self.cos_cache, self.sin_cache = self._tables(self.rows)

    def table_positions(self, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """``positions [T]`` as rows of the tables: ``+ rows`` for the tokens of requests whose
        sequence (``md.seq_lens_list``) is longer than ``original_max_position_embeddings``."""
        if not self.longrope or md.max_seq_len <= self.original_max:
            return positions
        long = torch.tensor([s > self.original_max for s in md.seq_lens_list], dtype=torch.long)
        per_token = torch.repeat_interleave(long, torch.tensor(md.query_lens_list))
        return positions + per_token.to(positions.device) * self.rows


def _longrope_mscale(params: dict, max_position: int, original_max: int) -> float:
    """LongRoPE's attention factor (transformers' ``_compute_longrope_parameters``)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor") or max_position / original_max
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))


class PartialRopeInputs(RopeInputs):
    """``RopeInputs`` rotating only the first ``rotary_dim`` dims of each head, in place."""

    __slots__ = ()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        rot = self.rotary.rotary_dim
        part = x[..., :rot]
        ops = cpu_ops_for(x)
        if ops is not None and x.stride(-1) == 1:  # the kernel takes the head stride as it is
            ops.rotary_embedding(self.positions, part, self.rotary.cos_cache, self.rotary.sin_cache)
            return x
        if self._cos_sin is None:
            self._cos_sin = (self.rotary.cos_cache[self.positions].to(self.dtype).unsqueeze(1),
                             self.rotary.sin_cache[self.positions].to(self.dtype).unsqueeze(1))
        part.copy_(apply_rope(part, *self._cos_sin))
        return x


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 family causal LM over a paged KV cache (HF ``Phi3ForCausalLM`` configs):
    Llama's layers with partial rotary and LongRoPE (see the module docstring).
    Raises ValueError for unsupported settings (activation, rope type)."""

    def make_rotary(self, hf_config: Any, head_dim: int) -> nn.Module:
        params = _rope_parameters(hf_config)
        if "partial_rotary_factor" not in params and getattr(hf_config, "partial_rotary_factor", None):
            params["partial_rotary_factor"] = hf_config.partial_rotary_factor
        if not params.get("original_max_position_embeddings"):
            params["original_max_position_embeddings"] = getattr(hf_config, "original_max_position_embeddings", None)
        return Phi3RotaryEmbedding(head_dim, hf_config.max_position_embeddings, params)

    def rope_inputs(self, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                    dtype: torch.dtype) -> RopeInputs:
        self.rotary_emb.ensure_positions(positions, attn_metadata.max_seq_len - 1)
        return PartialRopeInputs(self.rotary_emb.table_positions(positions, attn_metadata), self.rotary_emb, dtype)
