"""Sparse Mixture-of-Experts decoders: Mixtral (HF ``MixtralForCausalLM``), Qwen2-MoE
(``Qwen2MoeForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``) on llama.py's attention and
layer structure.

The MoE block follows transformers' ``modeling_mixtral`` / ``modeling_qwen2_moe`` /
``modeling_qwen3_moe`` (``*TopKRouter`` + ``*Experts``) numerically:
router logits ``gate(x)`` ``[T, E]`` in the model dtype -> softmax in float32 -> top-k
(``num_experts_per_tok``) -> renormalised to sum 1 (Mixtral always; Qwen3-MoE when
``norm_topk_prob``) -> each chosen expert's SiLU-gated MLP ``down(silu(gate(x)) * up(x))``
weighted by its routing weight and summed per token; Qwen2-MoE adds a shared expert
(``shared_expert``, width ``shared_expert_intermediate_size``) on every token, scaled by
``sigmoid(shared_expert_gate(x))``.

Experts run grouped by expert (as vLLM's fused MoE does, without its kernel): the ``T * k``
token-expert pairs are sorted by expert, each expert runs one GEMM pair over its gathered
tokens, and the weighted outputs are ``index_add``-ed back to their tokens. ``MOE_IMPL =
"token_loop"`` runs the same math one token and one expert at a time (the baseline of
``llmserve/benchmarks/moe.py``).

Checkpoint names (Qwen2-MoE's shared expert loads as its own ``LlamaMLP``): Mixtral's ``block_sparse_moe.gate`` / ``experts.{e}.w1|w3|w2`` (gate, up,
down) and Qwen3-MoE's ``mlp.gate`` / ``mlp.experts.{e}.gate_proj|up_proj|down_proj``; both load
into ``mlp.gate`` and ``mlp.experts[e].gate_up_proj|down_proj`` (each expert is a ``LlamaMLP``,
so its linears are packed for oneDNN like the dense ones). Mixtral GGUF files (llama.cpp's
``ffn_gate_inp`` router and 3-D ``ffn_*_exps`` stacks) arrive under the same names, split per
expert by ``model_loader.gguf_loader``, as do Qwen2-MoE / Qwen3-MoE GGUF files (llama.cpp's
``qwen2moe`` / ``qwen3moe``; the shared expert's ``ffn_*_shexp`` and its gate
``ffn_gate_inp_shexp``), whose config ``model_loader.gguf_config`` completes (expert widths,
``norm_topk_prob`` as llama.cpp routes each).
"""
from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Iterable

import torch
from torch import nn

from llmserve.models.llama import (Linear, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                   RMSNorm, _sliding_window)

# "grouped" (the engine's path) or "token_loop" (benchmark baseline; same results).
MOE_IMPL = "grouped"


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing (transformers' ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``).

    router_logits ``[T, E]`` (any float dtype). Returns ``(weights [T, k] float32,
    expert ids [T, k] int64)``; weights sum to 1 per token when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoeBlock(nn.Module):
    """Router ``gate`` (``Linear(hidden, E)``, no bias) and ``E`` SiLU-gated expert MLPs of
    width ``moe_intermediate_size``.

    With ``shared_intermediate_size`` > 0, also Qwen2-MoE's shared expert and its gate
    (``Linear(hidden, 1)``).
    ``forward(x [T, hidden]) -> [T, hidden]`` in ``x``'s dtype. Raises ValueError for a
    config with ``num_experts_per_tok`` outside ``1..E`` or an activation other than SiLU."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, hidden_act: str, dtype: torch.dtype, shared_intermediate_size: int = 0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.top_k, self.num_experts, self.renormalize = top_k, num_experts, renormalize
        self.weights_in_model_dtype = False  # Mixtral weights its experts' outputs in float32
        self.gate = Linear(hidden_size, num_experts, False, dtype)
        expert_cfg = SimpleNamespace(hidden_size=hidden_size, intermediate_size=intermediate_size,
                                     hidden_act=hidden_act, mlp_bias=False)
        self.experts = nn.ModuleList(LlamaMLP(expert_cfg, dtype) for _ in range(num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            expert_cfg.intermediate_size = shared_intermediate_size
            self.shared_expert = LlamaMLP(expert_cfg, dtype)
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate.forward(x), self.top_k, self.renormalize)
        if self.weights_in_model_dtype:  # Qwen-MoE rounds them first (HF's ``.to(router_logits.dtype)``)
            weights = weights.to(x.dtype)
        out = self._token_loop(x, weights, ids) if MOE_IMPL == "token_loop" else self._grouped(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate.forward(x)) * self.shared_expert.forward(x)
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sort the ``T * k`` pairs by expert; one expert MLP call per expert over its tokens."""
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // self.top_k
        pair_weight = weights.reshape(-1)[order]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                tokens = token_of[start:start + n]
                y = self.experts[e].forward(x.index_select(0, tokens))
                out.index_add_(0, tokens, (y * pair_weight[start:start + n, None]).to(x.dtype))
                start += n
        return out

    def _token_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same sum one (token, expert) pair at a time: the benchmark's baseline."""
        out = torch.zeros_like(x)
        for t, (row_w, row_e) in enumerate(zip(weights.tolist(), ids.tolist())):
            for w, e in zip(row_w, row_e):
                y = self.experts[e].forward(x[t:t + 1])
                out[t:t + 1] += (y * torch.tensor(w, dtype=weights.dtype)).to(x.dtype)
        return out


def _num_experts(config: Any) -> int:
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0) or 0)


def _is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``; Mixtral: every layer."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and _num_experts(config) > 0 and (layer_idx + 1) % step == 0)


class MoeAttention(LlamaAttention):
    """Llama's attention with Qwen2-MoE's q/k/v biases (``qkv_bias``) or Qwen3-MoE's
    per-head q/k norms."""

    def options(self, config: Any, layer_idx: int) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bool(getattr(config, "qkv_bias", True)) if config.model_type == "qwen2_moe" else bias
        return {"qkv_bias": qkv_bias, "o_bias": False if config.model_type in ("qwen2_moe", "qwen3_moe") else bias,
                "qk_norm": config.model_type == "qwen3_moe", "scale": self.head_dim ** -0.5,
                "sliding_window": _moe_sliding_window(config, layer_idx)}


def _moe_sliding_window(config: Any, layer_idx: int):
    """Mixtral's ``sliding_window``; Qwen2/Qwen3-MoE's only with ``use_sliding_window``."""
    if config.model_type in ("qwen2_moe", "qwen3_moe") and not getattr(config, "use_sliding_window", False):
        return None
    return _sliding_window(config, layer_idx)


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer whose ``mlp`` is a ``SparseMoeBlock`` (dense on Qwen3-MoE's
    ``mlp_only_layers``)."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.self_attn = MoeAttention(config, layer_idx, dtype)
        if _is_sparse_layer(config, layer_idx):
            width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
            renorm = config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
            self.mlp = SparseMoeBlock(config.hidden_size, width, _num_experts(config), config.num_experts_per_tok,
                                      renorm, getattr(config, "hidden_act", "silu"), dtype,
                                      int(getattr(config, "shared_expert_intermediate_size", 0) or 0))
            self.mlp.weights_in_model_dtype = config.model_type != "mixtral"
        else:
            self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.(gate\.|experts\.(\d+)\.w([123])\.)")
_W_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def hf_moe_name(name: str) -> str:
    """A Mixtral checkpoint name in Qwen-MoE / Llama terms (``block_sparse_moe`` -> ``mlp``,
    ``w1|w3|w2`` -> ``gate_proj|up_proj|down_proj``); other names unchanged."""
    m = _MIXTRAL_EXPERT.search(name)
    if m is None:
        return name
    if m.group(2) is None:
        return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    return name[:m.start()] + f".mlp.experts.{m.group(2)}.{_W_NAMES[m.group(3)]}." + name[m.end():]


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen3-MoE causal LM over a paged KV cache (see the module docstring).
    Parameters start uninitialised: ``load_weights`` takes HF checkpoint names.
    Raises ValueError for unsupported settings (activation, rope type, top-k)."""

    decoder_layer_cls = MoeDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As ``LlamaForCausalLM.load_weights`` after renaming Mixtral's expert names; the
        experts' gate/up halves fuse into ``gate_up_proj``. Raises ValueError for a missing
        weight or a wrong shape (e.g. a checkpoint with fewer experts than the config)."""
        super().load_weights((hf_moe_name(n), t) for n, t in weights)


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    """Qwen2-MoE: Mixtral's block plus the sigmoid-gated shared expert, ``norm_topk_prob``
    routing and q/k/v biases."""


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Qwen3-MoE: Mixtral's block with ``norm_topk_prob`` routing, per-head q/k norms and
    dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say."""
