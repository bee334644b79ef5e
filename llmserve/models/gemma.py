"""Gemma 2 and Gemma 3 (text) decoders over the paged KV cache, on llama.py's blocks.

Follows transformers' ``modeling_gemma2`` / ``modeling_gemma3`` numerically:
- RMSNorm with the ``(1 + w)`` weight: the checkpoint's ``w`` is stored as ``1 + w`` at load
  (the same float32 product as HF's ``normed * (1 + w.float())``), so Llama's RMSNorm (and
  its C++ kernel) runs it; in bfloat16 HF rounds once where this rounds twice.
- embeddings scaled by ``sqrt(hidden_size)`` rounded to the model dtype (as HF's
  ``Gemma2TextScaledWordEmbedding``); the tied LM head uses the unscaled table;
- GeGLU MLP (``gelu_pytorch_tanh``); norms before and after attention and the MLP
  (``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``);
- softmax scale ``query_pre_attn_scalar ** -0.5``; attention logit soft-capping inside
  ``PagedAttention`` and final-logit soft-capping (Gemma 2; Gemma 3 when its config sets it);
- per-head q/k RMSNorm (Gemma 3);
- ``layer_types`` (``sliding_attention`` / ``full_attention``; Gemma 3 configs without it
  derive it from ``sliding_window_pattern``), each type with its own RoPE (Gemma 3:
  ``rope_local_base_freq`` for sliding layers, the global base and any ``rope_scaling`` for
  full ones), windowed layers attending to the last ``sliding_window`` positions.
vLLM's equivalents: ``vllm/model_executor/models/gemma2.py``, ``gemma3.py``.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.attention.backend import AttentionMetadata
from llmserve.models.llama import (Linear, LlamaAttention, LlamaForCausalLM, RMSNorm, RopeInputs,
                                   RotaryEmbedding)

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def _layer_types(config: Any) -> list[str]:
    """``sliding_attention`` / ``full_attention`` per layer (HF ``layer_types``; older Gemma 2
    configs alternate sliding, full)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]


def _rope_params_for(config: Any, layer_type: str) -> dict:
    """The rope parameters of one layer type: Gemma 3 keeps one dict per type in
    ``rope_parameters`` (transformers 5), Gemma 2 one for all."""
    rp = getattr(config, "rope_parameters", None) or {}
    params = dict(rp.get(layer_type) or {}) if isinstance(rp.get(layer_type), dict) else dict(rp)
    if "rope_theta" not in params:
        if layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
            params["rope_theta"] = config.rope_local_base_freq
        else:
            params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


class GemmaMLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))`` with gate and up fused (``gate_up_proj``)."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in _GELU_TANH:
            raise ValueError(f"hidden_activation {act!r} is not supported for Gemma (only {_GELU_TANH})")
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        i = self.intermediate_size
        return self.down_proj.forward(F.gelu(gate_up[:, :i], approximate="tanh") * gate_up[:, i:])


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale (``query_pre_attn_scalar``), soft cap, window
    per ``layer_types`` and (Gemma 3) q/k norms; ``forward`` is Llama's."""

    def options(self, config: Any, layer_idx: int) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        sliding = _layer_types(config)[layer_idx] == "sliding_attention"
        scalar = getattr(config, "query_pre_attn_scalar", None) or self.head_dim
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": str(getattr(config, "model_type", "")).startswith("gemma3"),
                "scale": float(scalar) ** -0.5,
                "sliding_window": int(config.sliding_window) if sliding and getattr(config, "sliding_window", None) else None,
                "logits_soft_cap": getattr(config, "attn_logit_softcapping", None)}


class GemmaDecoderLayer(nn.Module):
    """Norms around attention and around the MLP (``post_*`` on the sublayer's output before
    the residual add, which the next norm fuses)."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = _layer_types(config)[layer_idx]
        self.self_attn = GemmaAttention(config, layer_idx, dtype)
        self.mlp = GemmaMLP(config, dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dtype)

    def forward(self, hidden, residual, rope, kv_cache, md):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.post_attention_layernorm.forward(self.self_attn.forward(hidden, rope, kv_cache, md))
        hidden, residual = self.pre_feedforward_layernorm.forward(hidden, residual)
        return self.post_feedforward_layernorm.forward(self.mlp.forward(hidden)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 causal LM over a paged KV cache (HF ``Gemma2ForCausalLM`` configs); also the
    base of Gemma 3. ``hf_config``: the transformers config; ``dtype``: parameter and
    activation dtype. Raises ValueError for an unsupported activation or rope type."""

    decoder_layer_cls = GemmaDecoderLayer

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32):
        super().__init__(hf_config, dtype)
        self.embed_scale = torch.tensor(hf_config.hidden_size ** 0.5, dtype=dtype)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def make_rotary(self, hf_config: Any, head_dim: int) -> nn.Module:
        """One ``RotaryEmbedding`` per layer type (Gemma 3's sliding and full layers use
        different bases and scalings; Gemma 2's share one)."""
        return nn.ModuleDict({t: RotaryEmbedding(head_dim, hf_config.max_position_embeddings,
                                                 _rope_params_for(hf_config, t))
                              for t in sorted(set(_layer_types(hf_config)))})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Optional[list[torch.Tensor]], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``: ``[T]`` ids and positions -> ``[T, hidden]``."""
        hidden = self._embed(input_ids)
        ropes = {}
        for t, rotary in self.rotary_emb.items():
            rotary.ensure_positions(positions, attn_metadata.max_seq_len - 1)
            ropes[t] = RopeInputs(positions, rotary, hidden.dtype)
        residual = None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer.forward(hidden, residual, ropes[layer.layer_type],
                                             kv_caches[i] if kv_caches else None, attn_metadata)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times ``sqrt(hidden_size)`` (in the model dtype, as HF)."""
        return super()._embed(input_ids) * self.embed_scale

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Llama's head, then ``c * tanh(logits / c)`` with ``final_logit_softcapping`` c."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Llama's loader, with every RMSNorm weight ``w`` stored as ``1 + w``."""
        super().load_weights((name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
                             for name, tensor in weights)


_MULTIMODAL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text model (HF ``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): Gemma 2
    with q/k norms, 5 sliding layers per full one and per-type RoPE; soft caps only when the
    config sets them. Also the text part of a ``Gemma3ForConditionalGeneration`` checkpoint
    (``load_hf_config`` hands its ``text_config``): the language model's weights under either
    of transformers' prefixes, the vision tower and projector skipped."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_text_name(name), t) for name, t in weights
                             if not any(part in name for part in _VISION_PARTS))


def _text_name(name: str) -> str:
    for old, new in _MULTIMODAL_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name
