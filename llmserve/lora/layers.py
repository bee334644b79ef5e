"""LoRA-capable wrappers of the Llama layer's linears (vLLM's ``*WithLoRA`` layers).

``wrap_model`` replaces each decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
``down_proj`` (dense, GGUF-packed or tensor-parallel shards alike) with a wrapper that runs
the base module once for all rows and then adds each row's low-rank delta from stacked
per-slot weights (``llmserve.ops.lora_ops``). A fused module's slices (q/k/v, gate/up)
each have their own A and B: A side by side in ``a_stack [slots, in, n * R]``, each B
over its own columns of ``b_stack [slots, R, out]`` (no zero blocks), and one kernel call
per module adds every row's delta (``lora_ops``), or, on a packed GGUF base with one
adapter in the step, the packed GEMM runs it in its own threads (``fused_weight``). Under tensor parallel, a column-parallel module
keeps the B columns of its rows (``lora_out_index``, recorded by ``shard_llama``); a
row-parallel one keeps the A rows of its input columns (``lora_in_index``) and adds its
partial delta before the all-reduce, as vLLM's ``RowParallelLinearWithLoRA``."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from llmserve.ops import batch_invariant
from llmserve.ops.kquant import KQuantWeight
from llmserve.ops.lora_ops import (LoRAMapping, bind_lora_kernel, column_ranges, kernel_supports, lora_add_torch,
                                   slot_weights)
from llmserve.ops.quant_ops import QuantWeight

# Packed weights whose GEMM takes a LinearHook (csrc/quant_gemv.cpp).
_HOOKABLE = (QuantWeight, KQuantWeight)


def fused_weight(base: nn.Module) -> Optional[Any]:
    """The packed weight whose GEMM can run the deltas in its threads (a ``QuantWeight`` or
    ``KQuantWeight`` that takes every step of a bias-free ``Linear``), else None."""
    qw = getattr(base, "qweight", None)
    if type(qw) in _HOOKABLE and base.packed_only and base.bias is None:
        return qw
    return None


class LoRAStepContext:
    """The step's row -> slot mapping, shared by every wrapped layer of one model
    (set by ``LoRAModelManager.begin_step``; None: no row has an adapter)."""

    __slots__ = ("mapping",)

    def __init__(self) -> None:
        self.mapping: Optional[LoRAMapping] = None


class LinearWithLoRA(nn.Module):
    """``base(x)`` plus the rows' deltas. slices: ``(offset, size)`` of each LoRA target in
    the module's full (unsharded) output; in_full: its full input size. Weights: ``a_stack
    [slots, in_local, len(slices) * rank]`` and ``b_stack [slots, rank, out_local]`` in
    ``dtype``, sized for ``rank`` (max_lora_rank), each slot at its adapter's own rank
    ``ranks[slot]`` (int32; 0: not targeted; layout: ``llmserve.ops.lora_ops``)."""

    def __init__(self, base: nn.Module, slices: list[tuple[int, int]], in_full: int, num_slots: int,
                 rank: int, dtype: torch.dtype, ctx: LoRAStepContext, device: torch.device) -> None:
        super().__init__()
        self.base = base
        # Plain attributes for the hot path: nn.Module.__getattr__ (submodules) costs ~1 us
        # a lookup, ~500 a step with adapters on all four linears of 30 layers.
        self.__dict__["_base_forward"] = base.forward
        self.__dict__["_base"] = base
        self.slices, self.in_full, self.rank, self.ctx = slices, in_full, rank, ctx
        self.out_full = sum(size for _, size in slices)
        self.out_index: Optional[torch.Tensor] = getattr(base, "lora_out_index", None)
        self.in_index: Optional[torch.Tensor] = getattr(base, "lora_in_index", None)
        in_local = in_full if self.in_index is None else len(self.in_index)
        out_local = self.out_full if self.out_index is None else len(self.out_index)
        self.a_stack = torch.zeros(num_slots, in_local, len(slices) * rank, dtype=dtype, device=device)
        self.b_stack = torch.zeros(num_slots, rank, out_local, dtype=dtype, device=device)
        self.ranks = torch.zeros(num_slots, dtype=torch.int32)  # on the CPU: the kernel reads it per call
        self.ranges = column_ranges(slices, None if self.out_index is None else self.out_index.cpu())
        self.slot_used = [False] * num_slots
        self.used = False  # any slot holds weights for this module (else the delta is skipped)
        # add(y, x, segs): the C++ kernel bound to this module's stacks (one pybind call of
        # three tensors a module: lora_ops.bind_lora_kernel), else the torch path.
        self.native = bind_lora_kernel(self.a_stack, self.b_stack, self.ranges, self.ranks) \
            if kernel_supports(dtype, device) else None
        self.__dict__["_add"] = self.native.add if self.native is not None else self._add_torch
        # The packed weight whose GEMM runs the deltas in its threads (None: never fused),
        # and the address of the hook it runs, armed once a step for every such module
        # (lora_ops.arm_hooks): looked up once here, not per call (the base is packed
        # before it is wrapped: ModelRunner.load_model, Worker.load_model).
        self.__dict__["_fused_qw"] = fused_weight(base) if self.native is not None else None
        self.__dict__["_hook"] = self.native.hook_address() if self._fused_qw is not None else 0

    def pack(self, parts: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """One adapter's ``(A [r_i, in], B [out_i, r_i])`` per slice (None: not targeted) in a
        slot's layout at the adapter's rank ``r = max r_i`` (not the slots' rank: only r is
        read per step): ``(a [in_local, n * r], b [r, out_local])`` in the stacks' dtype, or
        None when no slice is targeted. Touches no layer state (runs in the loading thread);
        shapes and ``r <= rank`` were checked when the adapter was read."""
        if all(p is None for p in parts):
            return None
        rank = max(p[0].shape[0] for p in parts if p is not None)
        a_full = torch.zeros(self.in_full, len(self.slices) * rank)
        b_full = torch.zeros(rank, self.out_full)
        for i, part in enumerate(parts):
            if part is not None:
                a, b = part
                r, (off, size) = a.shape[0], self.slices[i]
                a_full[:, i * rank:i * rank + r] = a.t()
                b_full[:r, off:off + size] = b.t()
        a_loc = a_full if self.in_index is None else a_full[self.in_index.cpu()]
        b_loc = b_full if self.out_index is None else b_full[:, self.out_index.cpu()]
        return a_loc.to(self.a_stack.dtype).contiguous(), b_loc.to(self.b_stack.dtype).contiguous()

    def set_slot(self, slot: int, packed: Optional[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write a packed adapter (``pack``; None: this module not targeted, rank 0) into
        ``slot``. The slot's storage past the adapter's rank keeps whatever it held: it is
        never read (``lora_ops.slot_weights``)."""
        rank = 0 if packed is None else packed[1].shape[0]
        if packed is not None:
            a, b = slot_weights(self.a_stack, self.b_stack, slot, rank)
            a.copy_(packed[0])
            b.copy_(packed[1])
        self.ranks[slot] = rank
        self.slot_used[slot] = packed is not None
        self.used = any(self.slot_used)

    def clear_slot(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.slot_used[slot] = False
        self.used = any(self.slot_used)

    def _add_torch(self, y: torch.Tensor, x: torch.Tensor, segs: torch.Tensor) -> None:
        lora_add_torch(y, x, self.a_stack, self.b_stack, segs, self.ranges, self.ranks)

    def _delta_into(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        m = self.ctx.mapping
        if m is not None and self.used:
            self._add(y, x, m.segs)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.ctx.mapping  # inline, not _delta_into: one Python call less in 120 modules a step
        if m is None or not self.used:
            return self._base_forward(x)
        if m.fused:
            qw = self._fused_qw
            if qw is not None and x.dim() == 2:  # the deltas inside the packed GEMM's threads (lora.cpp: arm)
                return qw.linear(x, False, self._hook)
        y = self._base_forward(x)
        self._add(y, x, m.segs)
        return y


class RowParallelLinearWithLoRA(LinearWithLoRA):
    """A row-parallel shard: ``all_reduce(x @ W_r.T + delta_r) + b``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        y = self._delta_into(batch_invariant.linear(x, base.weight), x)
        y = base.tp.all_reduce(y)
        return y if base.bias is None else y + base.bias


# llmserve module -> HF targets of its slices, in order.
MODULE_TARGETS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


def target_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """HF target -> its full ``(out, in)`` in this model (what an adapter must match)."""
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    hd = getattr(hf_config, "head_dim", None) or h // heads
    kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * hd
    i = hf_config.intermediate_size
    return {"q_proj": (heads * hd, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, heads * hd),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def wrap_model(model: nn.Module, num_slots: int, rank: int, dtype: torch.dtype,
               device: torch.device) -> tuple[LoRAStepContext, dict]:
    """Wrap every decoder layer's four linears (in place). Returns the shared context and
    ``{(layer, module_key): wrapper}``."""
    from llmserve.models.tensor_parallel import RowParallelLinear

    ctx = LoRAStepContext()
    shapes = target_shapes(model.config)
    wrappers: dict[tuple[int, str], LinearWithLoRA] = {}
    for li, layer in enumerate(model.model.layers):
        for key, targets in MODULE_TARGETS.items():
            parent_name, attr = key.split(".")
            parent = getattr(layer, parent_name)
            base = getattr(parent, attr)
            slices, off = [], 0
            for t in targets:
                slices.append((off, shapes[t][0]))
                off += shapes[t][0]
            cls = RowParallelLinearWithLoRA if isinstance(base, RowParallelLinear) else LinearWithLoRA
            w = cls(base, slices, shapes[targets[0]][1], num_slots, rank, dtype, ctx, device)
            setattr(parent, attr, w)
            wrappers[(li, key)] = w
    return ctx, wrappers

