"""The decoder layers of a GGUF-packed Llama-family model in one C++ call per step.

``LlamaForCausalLM.forward`` runs its layers here when :func:`run_layers` can: every linear
of every layer runs on its GGUF blocks at every step (``Linear.packed_only``; no LoRA
wrappers, no tensor parallelism), the layers are the plain Llama / Mistral / Qwen2 /
Qwen3 ones, every token's attention goes through the CPU paged kernel (the KV caches in
the model dtype or float16/bfloat16 under float32, one KV cache group) and the C++
kernels are built. The driver (``csrc/layer_driver.cpp``, ``LlamaLayers``) calls the same
kernels in the same order on the same tensors as the Python loop, so its outputs are the
same numbers (tested bit for bit); it only removes the interpreter between the ~12
kernel calls of each layer, which was ~20% of a batch-1 decode step's CPU samples
(SmolLM2 Q4_K_M, 30 layers, 2-core AVX2), and releases the GIL for the step. Other models and steps take the Python loop.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from llmserve.ops import cpu_ops
from llmserve.ops.kquant import packed_parts

# The Python loop stays available for comparison (tests, benchmarks): set False.
ENABLED = True


class DriverTypes(NamedTuple):
    """The exact module classes the driver runs as their ``forward`` would (a subclass may
    change the math, so each layer's parts must be these types): set by ``llama.py`` on
    ``LlamaForCausalLM.driver_types`` (this module imports no model code)."""

    layer: type
    attention: type
    mlp: type
    norm: type
    linear: type


def _linear_args(lin: Any, types: DriverTypes) -> Optional[tuple]:
    """(parts, bias) of a ``Linear`` that runs on its blocks at every step, else None."""
    if type(lin) is not types.linear or not lin.packed_only:
        return None
    parts = packed_parts(lin.qweight)
    return None if parts is None else (parts, lin.bias)


def _layer_args(layer: Any, types: DriverTypes) -> Optional[list]:
    """``LlamaLayers.add_layer``'s arguments for one decoder layer, or None when the
    driver cannot run it as the Python loop would."""
    from llmserve.attention.backend import PagedAttention

    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if (type(layer) is not types.layer or type(attn) is not types.attention or type(mlp) is not types.mlp
            or type(attn.attn) is not PagedAttention or not attn.attn.use_kernel
            or attn.attn.kv_cache_group != 0 or type(layer.input_layernorm) is not types.norm
            or type(layer.post_attention_layernorm) is not types.norm):
        return None
    linears = [_linear_args(m, types) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(a is None for a in linears):
        return None
    qk = _qk_norm_args(attn, types)
    if qk is None:
        return None
    pa = attn.attn
    return [layer.input_layernorm.weight, layer.input_layernorm.eps,
            layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
            *[x for a in linears for x in a], *qk, pa.scale, pa.sliding_window or 0, pa.logits_soft_cap or 0.0]


def _qk_norm_args(attn: Any, types: DriverTypes) -> Optional[list]:
    """(q_norm weight, k_norm weight, eps) of a Qwen3-style attention, (None, None, 0.0)
    without per-head norms, None for norms the driver cannot run (other eps per norm)."""
    if not attn.qk_norm:
        return [None, None, 0.0]
    qn, kn = attn.q_norm, attn.k_norm
    if type(qn) is not types.norm or type(kn) is not types.norm or qn.eps != kn.eps:
        return None
    return [qn.weight, kn.weight, qn.eps]


def build_plan(model: Any) -> Optional[Any]:
    """The model's ``LlamaLayers`` (``csrc/layer_driver.cpp``), or None when a layer does
    not qualify (see the module docstring) or the kernels are not built."""
    from llmserve.ops.quant_ops import get_quant_ops

    ops, qops = cpu_ops.get_cpu_ops(), get_quant_ops()
    layers, types = list(model.model.layers), getattr(model, "driver_types", None)
    if ops is None or qops is None or not hasattr(ops, "LlamaLayers") or not layers or types is None:
        return None
    args = [_layer_args(layer, types) for layer in layers]
    if any(a is None for a in args):
        return None
    a0 = layers[0].self_attn
    plan = ops.LlamaLayers(qops.packed_linear_address(), qops.packed_linear_abi(), a0.num_heads, a0.num_kv_heads,
                           a0.head_dim, layers[0].mlp.intermediate_size)
    for a in args:
        plan.add_layer(*a)
    return plan


# Bumped by every ``Linear.set_packed`` (blocks attached, replaced or dropped, in any layer).
_packed_version = 0


def packed_weights_changed() -> None:
    """Make every cached plan stale (``Linear.set_packed`` calls it)."""
    global _packed_version
    _packed_version += 1


def _plan_key(model: Any) -> tuple:
    """What would make a cached plan stale, cheaply: any ``Linear.set_packed`` since, and the
    first and last layers' fused linears and their packed weights (LoRA wraps replace the
    modules; a level-2 sleep drops the whole model, plan included)."""
    layers = model.model.layers
    q = getattr(getattr(layers[0], "self_attn", None), "qkv_proj", None) if len(layers) else None
    d = getattr(getattr(layers[-1], "mlp", None), "down_proj", None) if len(layers) else None
    return _packed_version, id(q), id(getattr(q, "qweight", None)), id(d), id(getattr(d, "qweight", None))


def plan_for(model: Any) -> Optional[Any]:
    """The model's cached plan (built on first use, rebuilt when :func:`_plan_key` changes),
    or None when the driver cannot run it."""
    key = _plan_key(model)
    cached = model.__dict__.get("_layer_plan")
    if cached is None or cached[0] != key:
        cached = (key, build_plan(model))
        model.__dict__["_layer_plan"] = cached
    return cached[1]


def run_layers(model: Any, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: Optional[list],
               md: Any) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(hidden, residual)`` after the model's decoder layers, run by the driver, or None
    when this model or step takes the Python loop. hidden ``[T, H]`` (the embeddings,
    updated in place as the loop's first residual); positions ``[T]`` int64; kv_caches one
    tensor per layer; md the step's ``AttentionMetadata``. The rotary tables must cover the
    step (``LlamaForCausalLM.rope_inputs``)."""
    from llmserve.attention.backend import _cpu_kernel_step

    if not ENABLED or not kv_caches or md.kv_groups is not None or hidden.device.type != "cpu":
        return None
    if any(not cpu_ops.kv_dtypes_ok(hidden.dtype, c.dtype) for c in kv_caches):
        return None
    plan = plan_for(model)
    if plan is None or len(kv_caches) != plan.num_layers():
        return None
    step = _cpu_kernel_step(md, hidden, kv_caches[0])
    if step is None or step.t != hidden.shape[0] or not hidden.is_contiguous():
        return None
    rot = model.rotary_emb
    return plan.run(hidden, positions, rot.cos_cache, rot.sin_cache, kv_caches, step.slots, step.tables, step.lens)
