"""The worker's adapters (vLLM's ``LoRAModelManager`` + ``WorkerLoRAManager``): adapters
read from disk (kept up to the engine's ``max_cpu_loras``), ``max_loras`` weight slots in
the wrapped layers (``layers.py``), and each step's row -> slot mapping.

An adapter gets a slot when a step first needs it; a slot goes to the least recently
used adapter that the step does not need (the scheduler never puts more than
``max_loras`` adapters in one step). ``read`` (run in a loading thread) also packs the
weights into the slots' layout and dtype, so writing a slot on the step loop is two copies
per module (SmolLM2, rank 16: ~5M values, 9.8 MB in bfloat16)."""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional, Sequence

import torch
from torch import nn

from llmserve.lora.config import LoRAConfig
from llmserve.lora.errors import LoRAAdapterError, LoRANotFoundError
from llmserve.lora.layers import MODULE_TARGETS, target_shapes, wrap_model
from llmserve.lora.models import LoRAAdapter, load_adapter
from llmserve.lora.request import LoRARequest
from llmserve.ops.lora_ops import arm_hooks, maybe_mapping

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lora_weights_dtype(lora_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The adapters' dtype: ``lora_dtype``, or for "auto" the model's - except on the CPU
    with a float16 model, where bfloat16 (the C++ kernel ``csrc/lora.cpp`` reads float32 or
    bfloat16 weights and sums in float32). A float32 model keeps float32 adapters (tokens
    equal to peft's); a bfloat16 one reads half the bytes: at decode the deltas are bound by
    reading the adapters (SmolLM2-135M, rank 16: 9.8 MB per adapter a step in bfloat16)."""
    if lora_dtype != "auto":
        return _DTYPES[lora_dtype]
    if device.type == "cpu" and model_dtype == torch.float16:
        return torch.bfloat16
    return model_dtype


class LoRAModelManager:
    """Owns the wrapped model's LoRA state. ``model``: a loaded (and, under tensor
    parallel, sharded) Llama-family model; ``model_dtype``: its dtype (``lora_dtype``
    "auto" uses it)."""

    def __init__(self, model: nn.Module, config: LoRAConfig, model_dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.dtype = lora_weights_dtype(config.lora_dtype, model_dtype, device)
        self.device = device
        self.num_layers = len(model.model.layers)
        self.shapes = target_shapes(model.config)
        self.ctx, self.wrappers = wrap_model(model, config.max_loras, config.max_lora_rank, self.dtype, device)
        # The bound kernels whose packed GEMM runs their deltas (armed once a fused step).
        self.hooked = [w.native for w in self.wrappers.values() if w._fused_qw is not None]
        self.adapters: dict[int, LoRAAdapter] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first

    # ---- adapters ------------------------------------------------------------
    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check ``request``'s adapter (no engine state touched: safe in a
        thread). Raises LoRAAdapterError naming the field at fault."""
        adapter = load_adapter(request.lora_path, self.config.max_lora_rank)
        for (layer, target), (a, b) in adapter.weights.items():
            if layer >= self.num_layers:
                raise LoRAAdapterError(f"adapter {request.lora_name!r}: layer {layer} does not exist (the model "
                                       f"has {self.num_layers})", "target_modules")
            out, inp = self.shapes[target]
            if a.shape[1] != inp or b.shape[0] != out:
                raise LoRAAdapterError(
                    f"adapter {request.lora_name!r}: layer {layer} {target} has lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)}, which do not match the base model's {target} ({out} x {inp})",
                    "target_modules")
        for (layer, key), w in self.wrappers.items():  # the slot layout, here off the step loop
            adapter.packed[(layer, key)] = w.pack([adapter.weights.get((layer, t)) for t in MODULE_TARGETS[key]])
        adapter.weights = {}  # the float32 originals: the packed copy is all a slot needs
        return adapter

    def add(self, request: LoRARequest, adapter: Optional[LoRAAdapter] = None) -> bool:
        """Hold ``request``'s adapter (read now unless given). A live id is replaced
        (its slot rewritten). Returns True."""
        adapter = adapter if adapter is not None else self.read(request)
        self.adapters[request.lora_int_id] = adapter
        slot = self.slot_of.get(request.lora_int_id)
        if slot is not None:
            self._write_slot(slot, adapter)
        return True

    def remove(self, lora_id: int) -> bool:
        """Drop an adapter and free its slot; False when it was not held."""
        if self.adapters.pop(lora_id, None) is None:
            return False
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            for w in self.wrappers.values():
                w.clear_slot(slot)
        return True

    def list(self) -> set[int]:
        return set(self.adapters)

    # ---- slots and steps ---------------------------------------------------------
    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for k, w in self.wrappers.items():
            w.set_slot(slot, adapter.packed.get(k))

    def _activate(self, ids: set[int]) -> None:
        free = set(range(self.config.max_loras)) - set(self.slot_of.values())
        for lora_id in ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            adapter = self.adapters.get(lora_id)
            if adapter is None:
                raise LoRANotFoundError(f"LoRA adapter {lora_id} is not loaded", "lora_request")
            if not free:
                victim = next(i for i in self.slot_of if i not in ids)  # the scheduler keeps <= max_loras
                free.add(self.slot_of.pop(victim))
            slot = min(free)
            free.discard(slot)
            self._write_slot(slot, adapter)
            self.slot_of[lora_id] = slot

    def slot(self, lora_id: int) -> int:
        """The slot of an active adapter (a step's sort key: rows of one adapter together)."""
        return self.slot_of.get(lora_id, -1)

    def begin_step(self, row_ids: Sequence[int], row_lens: Sequence[int]) -> None:
        """Set the step's mapping: request i (``row_lens[i]`` tokens, in the step's row
        order) runs adapter ``row_ids[i]`` (0: the base model)."""
        ids = {i for i in row_ids if i}
        if not ids:
            self.ctx.mapping = None
            return
        self._activate(ids)
        slots = [self.slot_of[i] if i else -1 for i in row_ids]
        mapping = maybe_mapping(slots, row_lens)
        if mapping is not None and mapping.fused:
            arm_hooks(self.hooked, mapping)
        self.ctx.mapping = mapping

    def end_step(self) -> None:
        self.ctx.mapping = None
