"""Whisper (Radford et al. 2022) as an encoder-decoder in the engine (vLLM's
``WhisperForConditionalGeneration``).

Encoder: log-mel features ``[B, num_mel_bins, 3000]`` -> two convolutions (the second with
stride 2) + GELU -> sinusoidal positions -> pre-LN transformer layers (bidirectional) ->
``[B, 1500, d_model]``; it runs once per request. Each decoder layer's cross-attention K/V
are computed from that output once (``cross_kv``) and kept per request by the runner.

Decoder: token + learned positions -> pre-LN layers of causal self-attention over the
paged KV cache (``PagedAttention``), cross-attention over the request's encoder K/V, and a
GELU MLP -> final LayerNorm; logits use the tied token embedding. Parameter names are
transformers' (``model.encoder...``, ``model.decoder...``), so HF checkpoints load as
they are and CTranslate2 ones through ``llmserve.model_loader.ct2_loader``.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.attention.backend import AttentionMetadata, PagedAttention

CrossKV = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder layer: K, V [heads, frames, head_dim]


class WhisperAttention(nn.Module):
    """Multi-head attention with HF Whisper's projections (no k bias)."""

    def __init__(self, d_model: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(d_model, d_model, dtype=dtype)
        self.k_proj = nn.Linear(d_model, d_model, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(d_model, d_model, dtype=dtype)
        self.out_proj = nn.Linear(d_model, d_model, dtype=dtype)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., T, d_model]`` -> ``[..., heads, T, head_dim]``."""
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-3, -2)

    def encoder_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Bidirectional self-attention, ``x`` ``[B, T, d_model]``."""
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        o = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(o.transpose(1, 2).flatten(2))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn = WhisperAttention(d, config.encoder_attention_heads, dtype)
        self.self_attn_layer_norm = nn.LayerNorm(d, dtype=dtype)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim, dtype=dtype)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d, dtype=dtype)
        self.final_layer_norm = nn.LayerNorm(d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.encoder_forward(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """Log-mel ``[B, num_mel_bins, 2 * max_source_positions]`` -> ``[B, max_source_positions,
    d_model]``."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1, dtype=dtype)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1, dtype=dtype)
        self.embed_positions = nn.Embedding(config.max_source_positions, d, dtype=dtype)
        self.layers = nn.ModuleList(WhisperEncoderLayer(config, dtype) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d, dtype=dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(features.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight[:x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d, h = config.d_model, config.decoder_attention_heads
        self.self_attn = WhisperAttention(d, h, dtype)
        self.attn = PagedAttention(h, d // h, h, self.self_attn.scale)
        self.self_attn_layer_norm = nn.LayerNorm(d, dtype=dtype)
        self.encoder_attn = WhisperAttention(d, h, dtype)
        self.encoder_attn_layer_norm = nn.LayerNorm(d, dtype=dtype)
        self.fc1 = nn.Linear(d, config.decoder_ffn_dim, dtype=dtype)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, d, dtype=dtype)
        self.final_layer_norm = nn.LayerNorm(d, dtype=dtype)

    def cross_kv(self, enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output ``[B, frames, d]`` -> cross-attention K, V ``[B, heads, frames, head_dim]``."""
        ea = self.encoder_attn
        return ea.heads(ea.k_proj(enc)).contiguous(), ea.heads(ea.v_proj(enc)).contiguous()

    def forward(self, x: torch.Tensor, kv_cache: Optional[torch.Tensor], md: AttentionMetadata,
                cross: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        t = x.shape[0]
        sa = self.self_attn
        h = self.self_attn_layer_norm(x)
        o = self.attn(sa.q_proj(h), sa.k_proj(h), sa.v_proj(h), kv_cache, md)
        x = x + sa.out_proj(o[:t])
        x = x + self._cross(self.encoder_attn_layer_norm(x), md, cross)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))

    def _cross(self, h: torch.Tensor, md: AttentionMetadata,
               cross: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Each request's query rows over its own encoder K/V (no mask: all frames). One
        call per encoder output: stacking the requests' K/V would copy them every layer;
        the beams of one request (core/beam_search.py) share theirs, so their rows go in
        one call (beam 5: 5x fewer calls over the 1500 frames)."""
        ea = self.encoder_attn
        q = ea.heads(ea.q_proj(h))  # [heads, T, head_dim]
        out = torch.empty_like(q)
        starts = md.query_starts()
        groups: dict[int, list[int]] = {}
        for i in range(md.num_reqs):
            groups.setdefault(id(cross[i][0]), []).append(i)
        for reqs in groups.values():
            k, v = cross[reqs[0]]
            if len(reqs) == 1:
                s0, s1 = starts[reqs[0]], starts[reqs[0] + 1]
                out[:, s0:s1] = F.scaled_dot_product_attention(q[:, s0:s1], k, v, scale=ea.scale)
                continue
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in reqs]).to(q.device)
            out[:, rows] = F.scaled_dot_product_attention(q[:, rows], k, v, scale=ea.scale)
        return ea.out_proj(out.transpose(0, 1).flatten(1))


class WhisperDecoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = config.d_model
        self.embed_tokens = nn.Embedding(config.vocab_size, d, dtype=dtype)
        self.embed_positions = nn.Embedding(config.max_target_positions, d, dtype=dtype)
        self.layers = nn.ModuleList(WhisperDecoderLayer(config, dtype) for _ in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(d, dtype=dtype)


class WhisperModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(config, dtype)
        self.decoder = WhisperDecoder(config, dtype)


class WhisperForConditionalGeneration(nn.Module):
    """Whisper for the engine. ``encode`` runs the encoder and returns each request's
    cross-attention K/V (``CrossKV`` per request); ``forward`` runs the decoder over the
    flat step batch (``input_ids``/``positions`` ``[T]`` int64) with ``cross_kv[i]`` for
    the i-th request of ``attn_metadata``; ``compute_logits`` -> ``[N, vocab]`` float32.
    Parameters start uninitialised: call ``load_weights`` (HF names)."""

    is_causal = True
    is_encoder_decoder = True

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = WhisperModel(config, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.decoder.embed_tokens.weight.dtype

    def encode(self, features: torch.Tensor) -> list[CrossKV]:
        """``features`` ``[B, num_mel_bins, frames]`` -> per request, per decoder layer,
        cross K/V ``[heads, frames // 2, head_dim]``."""
        enc = self.model.encoder(features)
        per_layer = [layer.cross_kv(enc) for layer in self.model.decoder.layers]
        return [[(k[b], v[b]) for k, v in per_layer] for b in range(enc.shape[0])]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Optional[list[torch.Tensor]], attn_metadata: AttentionMetadata,
                cross_kv: Sequence[CrossKV] = ()) -> torch.Tensor:
        dec = self.model.decoder
        if positions.numel() and int(positions.max()) >= dec.embed_positions.num_embeddings:
            raise ValueError(f"Whisper decodes at most {dec.embed_positions.num_embeddings} tokens")
        x = dec.embed_tokens(input_ids) + dec.embed_positions(positions)
        for i, layer in enumerate(dec.layers):
            x = layer(x, kv_caches[i] if kv_caches else None, attn_metadata, [c[i] for c in cross_kv])
        return dec.layer_norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.model.decoder.embed_tokens.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (any float dtype) into the parameters; ``proj_out`` is the
        tied embedding. Raises ValueError for a wrong shape or a parameter left without
        a weight."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name in params:
                if tuple(params[name].shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(params[name].shape)}")
                params[name].data.copy_(tensor)
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for {len(missing)} parameters, e.g. {missing[:5]}")
