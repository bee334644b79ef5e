"""LoRA-capable wrappers of the Llama layer's linears (vLLM's ``*WithLoRA`` layers).

``wrap_model`` replaces each decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
``down_proj`` (dense, GGUF-packed or tensor-parallel shards alike) with a wrapper that runs
the base module once for all rows and then adds each row's low-rank delta from stacked
per-slot weights (``llmserve.ops.lora_ops``). A fused module's slices (q/k/v, gate/up)
each have their own A and B: A side by side in ``a_stack [slots, in, n * R]``, B
block-diagonal in ``b_stack [slots, n * R, out]`` (zeros elsewhere add exactly 0), so a
fused module's delta is still two GEMMs. Under tensor parallel, a column-parallel module
keeps the B columns of its rows (``lora_out_index``, recorded by ``shard_llama``); a
row-parallel one keeps the A rows of its input columns (``lora_in_index``) and adds its
partial delta before the all-reduce, as vLLM's ``RowParallelLinearWithLoRA``."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from llmserve.ops import batch_invariant
from llmserve.ops.lora_ops import LoRAMapping, add_lora


class LoRAStepContext:
    """The step's row -> slot mapping, shared by every wrapped layer of one model
    (set by ``LoRAModelManager.begin_step``; None: no row has an adapter)."""

    __slots__ = ("mapping",)

    def __init__(self) -> None:
        self.mapping: Optional[LoRAMapping] = None


class LinearWithLoRA(nn.Module):
    """``base(x)`` plus the rows' deltas. slices: ``(offset, size)`` of each LoRA target in
    the module's full (unsharded) output; in_full: its full input size."""

    def __init__(self, base: nn.Module, slices: list[tuple[int, int]], in_full: int, num_slots: int,
                 rank: int, dtype: torch.dtype, ctx: LoRAStepContext, device: torch.device) -> None:
        super().__init__()
        self.base = base
        # Plain attributes for the hot path: nn.Module.__getattr__ (submodules) costs ~1 us
        # a lookup, ~500 a step with adapters on all four linears of 30 layers.
        self.__dict__["_base_forward"] = base.forward
        self.slices, self.in_full, self.rank, self.ctx = slices, in_full, rank, ctx
        self.out_full = sum(size for _, size in slices)
        self.out_index: Optional[torch.Tensor] = getattr(base, "lora_out_index", None)
        self.in_index: Optional[torch.Tensor] = getattr(base, "lora_in_index", None)
        in_local = in_full if self.in_index is None else len(self.in_index)
        out_local = self.out_full if self.out_index is None else len(self.out_index)
        width = len(slices) * rank
        self.a_stack = torch.zeros(num_slots, in_local, width, dtype=dtype, device=device)
        self.b_stack = torch.zeros(num_slots, width, out_local, dtype=dtype, device=device)
        self.slot_used = [False] * num_slots
        # Per-slot views of the stacks (written in place: they stay current).
        self.a_slots, self.b_slots = list(self.a_stack.unbind(0)), list(self.b_stack.unbind(0))

    def set_slot(self, slot: int, parts: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Write one adapter's ``(A [r, in], B [out_i, r])`` per slice (None: not targeted)
        into ``slot``; shapes were checked when the adapter was read."""
        self.a_stack[slot].zero_()
        self.b_stack[slot].zero_()
        self.slot_used[slot] = any(p is not None for p in parts)
        if not self.slot_used[slot]:
            return
        b_full = torch.zeros(self.b_stack.shape[1], self.out_full)
        for i, part in enumerate(parts):
            if part is None:
                continue
            a, b = part
            r, (off, size) = a.shape[0], self.slices[i]
            a_t = a.t() if self.in_index is None else a.t()[self.in_index.cpu()]
            self.a_stack[slot, :, i * self.rank:i * self.rank + r] = a_t
            b_full[i * self.rank:i * self.rank + r, off:off + size] = b.t()
        self.b_stack[slot] = b_full if self.out_index is None else b_full[:, self.out_index.cpu()]

    def clear_slot(self, slot: int) -> None:
        self.slot_used[slot] = False

    def _delta_into(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        m = self.ctx.mapping
        if m is None or not any(self.slot_used[s] for s in m.slots):
            return y
        return add_lora(y, x, self.a_stack, self.b_stack, m, self.a_slots, self.b_slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._delta_into(self._base_forward(x), x)


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
