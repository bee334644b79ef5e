"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Follows transformers' ``modeling_llama`` / ``modeling_mistral`` / ``modeling_qwen2`` /
``modeling_qwen3`` numerically (RMSNorm in float32, RoPE cos/sin in float32 cast to the
model dtype, residual adds in the model dtype), with vLLM's layout: fused ``qkv_proj`` and
``gate_up_proj`` linears, the residual carried beside the hidden state so each RMSNorm
also does the residual add (vLLM's ``fused_add_rms_norm``), and flat token batches
(``[T, hidden]``, no padding) whose attention goes through ``PagedAttention``.

Differences between the architectures, all read from the HF config:
Llama: ``attention_bias`` on q/k/v/o, ``mlp_bias``, ``rope_scaling`` (llama3, linear);
Mistral: ``sliding_window``; Qwen2: bias on q/k/v only, windowed layers from
``layer_types``; Qwen3: per-head RMSNorm on q and k (``q_norm``/``k_norm``), explicit
``head_dim``. ``tie_word_embeddings`` shares the LM head with the embedding.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.attention.backend import AttentionMetadata, PagedAttention
from llmserve.models import layer_driver
from llmserve.ops import batch_invariant, onednn_linear
from llmserve.ops.cpu_ops import cpu_ops_for
from llmserve.ops.quant_ops import ALL_STEPS, QuantWeight


class Linear(nn.Module):
    """``y = x @ W.T + b`` with uninitialised parameters (weights come from the checkpoint,
    so no time is spent on random init). weight: ``[out, in]``; after loading, packed for
    oneDNN on CPU (``ops/onednn_linear.py``, 1.4-3.8x faster GEMMs here)."""

    onednn_packable = True

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

        self.qweight: Optional[QuantWeight] = None  # GGUF blocks (llmserve.models.packed)
        self.packed_max_rows = 0
        self.packed_only = False  # qweight takes every step (set_packed)

    def set_packed(self, qweight: Optional[QuantWeight], max_rows: int, drop_dense: bool = False) -> None:
        """Run steps of at most ``max_rows`` tokens on ``qweight`` instead of ``weight``;
        with ``max_rows`` = ``ALL_STEPS`` and ``drop_dense``, every step, and the dense
        weight is freed (then no longer packed for oneDNN either)."""
        self.qweight, self.packed_max_rows = qweight, max_rows
        self.packed_only = qweight is not None and max_rows >= ALL_STEPS
        layer_driver.packed_weights_changed()  # a cached layer plan may hold the old blocks
        if drop_dense and self.packed_only:
            self.weight = nn.Parameter(self.weight.new_empty(0, self.weight.shape[1]), requires_grad=False)
            self.onednn_packable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_only:  # the kernel is row-invariant: batch-invariant steps too
            # 2-D x (every call of the decoder layers) skips reshape + view: ~2.5 us a call,
            # 121 calls in a SmolLM2 step, ~0.3 ms of a 6 ms batch-1 decode step.
            y = self.qweight.linear(x) if x.dim() == 2 else \
                self.qweight.linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        if x.shape[0] <= self.packed_max_rows and x.dim() == 2 and batch_invariant.unpadded():
            y = self.qweight.linear(x)
            return y if self.bias is None else y + self.bias
        return batch_invariant.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) as transformers' ``LlamaRMSNorm``: normalise in float32,
    cast back, then scale. With ``residual`` given, first adds it (in the input dtype) and
    returns ``(normed, new_residual)`` (vLLM's fused_add_rms_norm)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """x ``[T, hidden]`` (or ``[T, heads, hidden]`` without residual). With the CPU
        kernels the residual is updated in place (the caller's tensor is reused)."""
        ops = cpu_ops_for(x)
        if ops is not None and x.stride(-1) == 1 and (residual is None or (
                x.dim() == 2 and x.is_contiguous() and residual.is_contiguous())):
            if residual is None:
                out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
                ops.rms_norm(out, x, self.weight, self.eps)
                return out
            out = torch.empty_like(x)  # x is contiguous here; 0.9 us against torch.empty's 2.4
            ops.fused_add_rms_norm(out, x, residual, self.weight, self.eps)
            return out, residual
        if residual is not None:
            x = x + residual
            residual = x
        normed = F.rms_norm(x.float(), (self.hidden_size,), eps=self.eps).to(x.dtype)
        out = self.weight * normed
        return out if residual is None else (out, residual)


_SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


def _rope_parameters(config: Any) -> dict:
    """Rope settings from either transformers 5 (``rope_parameters``) or 4.x
    (``rope_theta`` + ``rope_scaling``) configs."""
    params: dict = {}
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict):
        params.update(rp)
    rs = getattr(config, "rope_scaling", None)
    if isinstance(rs, dict):
        for k, v in rs.items():
            params.setdefault(k, v)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    factors = getattr(config, "rope_freq_factors", None)
    if factors:  # a GGUF file's rope_freqs tensor (gguf_config._complete_rope)
        params["freq_factors"] = list(factors)
    return params


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, base: float, params: dict,
                   max_position: int) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023, "YaRN: Efficient Context Window Extension",
    section 3.2; the "yarn" rope type of transformers, vLLM and llama.cpp): dimensions that
    turn fewer than ``beta_slow`` (1) times over the original context are interpolated
    (divided by ``factor``), those turning more than ``beta_fast`` (32) times keep their
    frequency, and a linear ramp over the dimension index blends the two between."""
    factor = float(params["factor"])
    old_len = params.get("original_max_position_embeddings") or max_position
    fast, slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(params: dict) -> float:
    """The factor YaRN multiplies cos and sin by (``attention_factor``, else its ``0.1 ln(s)
    + 1`` of the scale s, as a ratio of the two with DeepSeek's ``mscale`` /
    ``mscale_all_dim``); 1.0 for the other rope types."""
    if params.get("rope_type") != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(params["factor"])
    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, float(params["mscale"])) / mscale(factor, float(params["mscale_all_dim"]))
    return mscale(factor)


def compute_inv_freq(head_dim: int, params: dict, max_position: int) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` float32 (Su et al. 2021), with the
    "linear" (position interpolation), "llama3" and "yarn" scalings as transformers'
    ``modeling_rope_utils`` (YaRN's cos/sin factor: :func:`rope_attention_factor`), then
    divided by ``params["freq_factors"]`` where given (one per frequency: llama.cpp's
    ``rope_freqs``, how its files carry Llama 3.1's scaling). Raises ValueError for other
    rope types, or factors of the wrong count."""
    rope_type = params["rope_type"]
    if rope_type not in _SUPPORTED_ROPE:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {_SUPPORTED_ROPE}")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, head_dim, base, params, max_position)
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        old_len = params.get("original_max_position_embeddings") or max_position
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    factors = params.get("freq_factors")
    if factors is not None:
        if len(factors) != inv_freq.numel():
            raise ValueError(f"rope_freqs has {len(factors)} factors; the rotary dimension {head_dim} needs "
                             f"{inv_freq.numel()}")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin tables ``[positions, head_dim // 2]`` (float32), indexed by position once
    per step; applied in the "rotate_half" (GPT-NeoX) layout HF Llama uses. Tables start at
    ``min(max_position, 8192)`` rows and grow up to ``max_position`` when a step needs it
    (a 128k-context config would otherwise hold ~64 MB of tables)."""

    _INITIAL_ROWS = 8192

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        self.max_position = int(max_position)
        self.attention_factor = rope_attention_factor(params)
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, params, max_position),
                             persistent=False)
        cos, sin = self._tables(min(self.max_position, self._INITIAL_ROWS))
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _tables(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(rows, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        if self.attention_factor != 1.0:  # YaRN scales both (transformers' attention_scaling)
            return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return freqs.cos(), freqs.sin()

    def ensure_positions(self, positions: torch.Tensor, max_pos: Optional[int] = None) -> None:
        """Grow the tables to cover ``positions``. ``max_pos``: the largest position if known
        (saves a device sync). Raises ValueError for a position >= max_position_embeddings."""
        if positions.numel():
            top = int(positions.max()) if max_pos is None else max_pos
            if top >= self.cos_cache.shape[0]:
                if top >= self.max_position:
                    raise ValueError(f"position {top} exceeds max_position_embeddings "
                                     f"({self.max_position})")
                self.cos_cache, self.sin_cache = self._tables(self.max_position)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, max_pos: Optional[int] = None):
        """``(cos, sin)``, each ``[T, 1, head_dim // 2]`` in ``dtype``. ``max_pos``: the
        largest position if known (saves a device sync). Raises ValueError for a position
        >= max_position_embeddings."""
        self.ensure_positions(positions, max_pos)
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [T, heads, head_dim]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RopeInputs:
    """What a step's layers need for RoPE: the positions ``[T]`` int64 and the rotary
    module; the torch path's gathered ``(cos, sin)`` are made on first use (once per step)."""

    __slots__ = ("positions", "rotary", "dtype", "_cos_sin")

    def __init__(self, positions: torch.Tensor, rotary: "RotaryEmbedding", dtype: torch.dtype):
        self.positions = positions
        self.rotary = rotary
        self.dtype = dtype
        self._cos_sin = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]``: in place with the CPU kernel (x must have a
        unit last stride), else out of place."""
        ops = cpu_ops_for(x)
        if ops is not None and x.stride(-1) == 1 and x.stride(1) == x.shape[-1]:
            ops.rotary_embedding(self.positions, x, self.rotary.cos_cache, self.rotary.sin_cache)
            return x
        if self._cos_sin is None:
            self._cos_sin = self.rotary.cos_sin(self.positions, self.dtype)
        return apply_rope(x, *self._cos_sin)


class LlamaAttention(nn.Module):
    """Fused-qkv attention with RoPE (and optional per-head q/k norm) over ``PagedAttention``.
    Subclasses change the architecture's choices through ``options``."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        opt = self.options(config, layer_idx)
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, opt["qkv_bias"], dtype)
        self.o_proj = Linear(self.q_size, hidden, opt["o_bias"], dtype)
        self.qk_norm = opt["qk_norm"]
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_kv_heads, opt["scale"],
                                   opt["sliding_window"], logits_soft_cap=opt.get("logits_soft_cap"))

    def options(self, config: Any, layer_idx: int) -> dict:
        """qkv_bias / o_bias / qk_norm (bools), scale (softmax scale), sliding_window (tokens
        or None), logits_soft_cap (or None) of this layer: Llama / Mistral / Qwen2 / Qwen3's."""
        model_type = getattr(config, "model_type", "llama")
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": True if model_type == "qwen2" else bias, "o_bias": False if model_type == "qwen2" else bias,
                "qk_norm": model_type == "qwen3", "scale": self.head_dim ** -0.5,
                "sliding_window": _sliding_window(config, layer_idx)}

    def forward(self, hidden: torch.Tensor, rope: RopeInputs,
                kv_cache: Optional[torch.Tensor], md: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        v = qkv[:, self.q_size + self.kv_size:]
        if self.qk_norm:
            q = self.q_norm(qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size]
                            .view(t, self.num_kv_heads, self.head_dim))
            q, k = rope.apply(q), rope.apply(k)
        else:  # q and k heads side by side: one rope op for both
            qk = rope.apply(qkv[:, :self.q_size + self.kv_size]
                            .view(t, self.num_heads + self.num_kv_heads, self.head_dim))
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        out = self.attn.forward(q.reshape(t, self.q_size), k.reshape(t, self.kv_size), v, kv_cache, md)
        return self.o_proj.forward(out)


def _sliding_window(config: Any, layer_idx: int) -> Optional[int]:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "model_type", None) == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return int(window)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        self.intermediate_size = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        i = self.intermediate_size
        ops = cpu_ops_for(gate_up)
        if ops is not None:
            act = torch.empty((gate_up.shape[0], i), dtype=gate_up.dtype, device=gate_up.device)
            ops.silu_and_mul(act, gate_up)
        else:
            act = F.silu(gate_up[:, :i]) * gate_up[:, i:]
        return self.down_proj.forward(act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, hidden, residual, rope, kv_cache, md):
        # Submodules' forward() directly: nn.Module.__call__'s hook checks cost ~1 us a
        # call, ~300 calls a step (a few % of a 6 ms batch-1 decode step); no hooks are used.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(hidden, rope, kv_cache, md)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, layer_cls: Optional[type] = None):
        super().__init__()
        layer_cls = layer_cls or LlamaDecoderLayer
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size,
                                                             dtype=dtype), _freeze=True)
        self.layers = nn.ModuleList(layer_cls(config, i, dtype)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


_STACKED = (
    # (fused param, checkpoint name, shard)
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaForCausalLM(nn.Module):
    """Causal LM over a paged KV cache, for Llama / Mistral / Qwen2 / Qwen3 HF configs.

    ``hf_config``: the transformers config; ``dtype``: parameter and activation dtype.
    Parameters start uninitialised: call ``load_weights`` (HF parameter names).
    Raises ValueError for unsupported settings (activation, rope type).
    Subclasses (Gemma, Phi-3) swap the decoder layer (``decoder_layer_cls``) and the rotary
    embedding (``make_rotary``).
    """

    decoder_layer_cls: Optional[type] = None  # None: LlamaDecoderLayer

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.model = LlamaModel(hf_config, dtype, self.decoder_layer_cls)
        head_dim = (getattr(hf_config, "head_dim", None)
                    or hf_config.hidden_size // hf_config.num_attention_heads)
        self.rotary_emb = self.make_rotary(hf_config, head_dim)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(hf_config.hidden_size, hf_config.vocab_size, False, dtype)
        # Tensor parallel: this rank's vocab-parallel head (models/tensor_parallel.py).
        self.tp_lm_head = None
        self.packed_head: Optional[tuple[QuantWeight, int]] = None  # tied head's GGUF blocks, max rows
        self.onednn_head: Optional[torch.Tensor] = None  # tied head packed for oneDNN
        self.embed_from_packed = False  # embedding rows come from packed_head (pack_tied_head)
        self.eval()

    def make_rotary(self, hf_config: Any, head_dim: int) -> nn.Module:
        """The rotary embedding of the config's ``rope_parameters`` (Llama's RoPE)."""
        return RotaryEmbedding(head_dim, hf_config.max_position_embeddings, _rope_parameters(hf_config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Optional[list[torch.Tensor]], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids / positions ``[T]`` int64 (flat tokens of all requests, decodes first);
        kv_caches: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer
        (None to run whole prompts without a cache). Returns hidden states ``[T, hidden]``
        after the final norm, in the model dtype."""
        hidden = self._embed(input_ids)
        rope = self.rope_inputs(positions, attn_metadata, hidden.dtype)
        driven = layer_driver.run_layers(self, hidden, positions, kv_caches, attn_metadata)
        if driven is not None:  # GGUF-packed layers in one C++ call (models/layer_driver.py)
            hidden, residual = driven
        else:
            residual = None
            for i, layer in enumerate(self.model.layers):
                hidden, residual = layer.forward(hidden, residual, rope,
                                                 kv_caches[i] if kv_caches else None, attn_metadata)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def rope_inputs(self, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                    dtype: torch.dtype) -> RopeInputs:
        """The step's RoPE inputs (tables grown to the step's longest sequence)."""
        self.rotary_emb.ensure_positions(positions, attn_metadata.max_seq_len - 1)
        return RopeInputs(positions, self.rotary_emb, dtype)

    def pack_tied_head(self) -> None:
        """A tied head's oneDNN copy: +V x H weights (56 MB for SmolLM2 in bfloat16) for a
        head GEMM 3.2x faster at batch 1 (2.3 -> 0.72 ms, a third of a 7 ms decode step).
        When the head also has GGUF blocks (``packed_head``), the embedding looks its rows
        up there (exactly the dense table's values) and the dense table is freed: the
        model then holds the head twice (oneDNN, blocks) instead of three times, or once
        when the blocks run every step (no oneDNN copy then).
        ``onednn_linear.pack_model`` calls it."""
        if self.lm_head is None and self.tp_lm_head is None:
            all_steps = self.packed_head is not None and self.packed_head[1] >= ALL_STEPS
            self.onednn_head = None if all_steps else onednn_linear.pack(self.model.embed_tokens.weight)
            if (self.onednn_head is not None or all_steps) and self.packed_head is not None:
                emb = self.model.embed_tokens
                emb.weight = nn.Parameter(emb.weight.new_empty(0, emb.weight.shape[1]), requires_grad=False)
                self.embed_from_packed = True

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` in the model dtype."""
        if self.embed_from_packed:
            return self.packed_head[0].rows(input_ids).to(self.dtype)
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> logits ``[N, vocab_size]`` float32."""
        if self.tp_lm_head is not None:
            return self.tp_lm_head.logits(hidden_states)
        head = self.packed_head
        if head is not None and hidden_states.shape[0] <= head[1] and (head[1] >= ALL_STEPS or batch_invariant.unpadded()):
            return head[0].linear(hidden_states, out_float=True)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        weight = weight if self.onednn_head is None else self.onednn_head
        logits = batch_invariant.linear(hidden_states, weight)
        if logits.dtype == torch.float32:
            return logits
        ops = cpu_ops_for(logits)
        if ops is None or logits.dim() != 2:
            return logits.float()
        out = torch.empty(logits.shape, dtype=torch.float32)
        ops.to_float(out, logits)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names, any float dtype) into the parameters, packing
        q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``.

        Raises ValueError for a tensor of the wrong shape or when a parameter got no
        weight; unknown names (e.g. ``rotary_emb.inv_freq``) are ignored. Weights with no
        rows need none: ``set_packed`` / ``packed.drop_tied_embedding`` freed them before
        loading, their GGUF blocks taking every step (the start-up cache's ``-blocks``
        entries hold no dense copy of them).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        attn0 = self.model.layers[0].self_attn if len(self.model.layers) else None
        for name, tensor in weights:
            if "rotary_emb." in name:
                continue
            if name.startswith("lm_head.") and self.lm_head is None:
                continue
            for fused, part, shard in _STACKED:
                if f".{part}." not in name:
                    continue
                target = name.replace(f".{part}.", f".{fused}.")
                if target not in params:
                    break
                param = params[target]
                if fused == "qkv_proj":
                    qs, kvs = attn0.q_size, attn0.kv_size
                    start, size = {"q": (0, qs), "k": (qs, kvs), "v": (qs + kvs, kvs)}[shard]
                else:
                    size = param.shape[0] // 2
                    start = shard * size
                _copy(param.data.narrow(0, start, size), tensor, name)
                loaded.add(f"{target}#{shard}")
                break
            else:
                if name in params:
                    _copy(params[name].data, tensor, name)
                    loaded.add(name)
                    if ".qkv_proj." in name or ".gate_up_proj." in name:  # fused in the checkpoint (Phi-3)
                        loaded.update(f"{name}#{s}" for s in ("q", "k", "v", 0, 1))
        missing = []
        for pname in params:
            if params[pname].dim() == 2 and params[pname].shape[0] == 0:
                continue  # freed before loading: its GGUF blocks run every step (model_loader._load_gguf)
            if ".qkv_proj." in pname:
                need = [f"{pname}#{s}" for s in "qkv"]
            elif ".gate_up_proj." in pname:
                need = [f"{pname}#{s}" for s in (0, 1)]
            else:
                need = [pname]
            missing += [n for n in need if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights for {len(missing)} parameters, "
                             f"e.g. {missing[:5]}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding attention window (``sliding_window``)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases and optional windowed layers."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head q/k RMSNorm and an explicit head_dim."""


# The classes the C++ layer driver may run in place of their forward (exact types only:
# subclasses such as Gemma's layers take the Python loop).
LlamaForCausalLM.driver_types = layer_driver.DriverTypes(
    layer=LlamaDecoderLayer, attention=LlamaAttention, mlp=LlamaMLP, norm=RMSNorm, linear=Linear)
