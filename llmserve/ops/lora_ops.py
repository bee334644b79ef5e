"""Batched LoRA deltas for a step that mixes adapters (in the spirit of punica's SGMV
kernel, Chen et al. 2023), over stacked per-slot weights:

    a_stack [slots, in, n * R]  (storage sized for the largest rank R, ``--max-lora-rank``)
    b_stack [slots, R, out]
    ranks   [slots] int32       (slot s's rank r_s <= R; 0: the slot's adapter skips the module)

Slot s holds its adapter at its own rank (:func:`slot_weights`): A is the first
``in * n * r_s`` elements of ``a_stack[s]`` read as ``[in, n * r_s]`` (each slice's lora_A
transposed, side by side), B the first ``r_s`` rows of ``b_stack[s]`` (each slice's lora_B
transposed over its own columns only, scale folded in; no zero blocks). Both are
contiguous, so a rank-8 adapter in slots sized for rank 64 reads 1/8 of its slot (with the
rank padded to R it read, and multiplied, the zeros too).

A fused module (q/k/v, gate/up) has ``n`` slices; ``ranges`` (int32 ``[P, 3]``: ``c0, c1,
slice``) says which slice owns each run of output columns. Each token row t with slot s
gets ``y[t, c0:c1] += (x[t] @ A_s)[i*r_s:(i+1)*r_s] @ B_s[:, c0:c1]`` for every range
``(c0, c1, i)``; the base GEMM ran once for all rows before, and rows of no adapter (the
base model) get nothing.

The step's grouping (:class:`LoRAMapping`: segments of rows sharing a slot, as an int32
tensor) is built once per step and used by every layer. On the CPU the delta is one call
of the C++ kernel ``csrc/lora.cpp`` per module (shrink and expand fused, added into y in
place, float32 sums over float32 or bfloat16 weights); elsewhere, or when the kernel cannot
be built, :func:`lora_add_torch` (two GEMMs per segment and range). When the base is a
packed GGUF weight and the step's rows share one adapter (:attr:`LoRAMapping.fused`), the
same arithmetic runs inside the packed GEMM's threads instead (``LoRAModule.arm``, once a
step for every such module: :func:`arm_hooks`): each thread takes its share of the shrink
before its output columns and expands into those columns after them.
``lora_delta_reference`` is the per-row definition both are tested against.

Why a kernel: at one decode row of SmolLM2-135M the torch path took two oneDNN GEMMs
plus two dtype casts per module, ~25 us each x 120 modules: +3 ms on a 3.3 ms step
(+90%, stop 2 of issue 28's profile); the weights' float32 copies added 19.6 MB per adapter
a step, a third of it zero padding.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, Sequence

import torch

from llmserve.ops.cpu_ops import build_dir_for, load_small_extension, ready_word

logger = logging.getLogger(__name__)

_SOURCE = "lora.cpp"
_NAME = "llmserve_lora_ops"


def get_lora_kernel() -> Optional[Callable]:
    """``lora_add(y, x, a, b, segs, ranges, ranks=None)`` of ``csrc/lora.cpp`` (in place; y/x
    ``[T, N]`` / ``[T, K]`` float32, bfloat16 or float16; a ``[S, K, W]``, b ``[S, R, N]``
    float32 or bfloat16; segs int32 ``[G, 3]`` of ``(slot, start, end)``; ranges int32
    ``[P, 3]``; ranks int32 ``[S]`` (None: all R; the layout in the module docstring);
    RuntimeError on a shape, dtype or bound mismatch), or None: no compiler, or
    ``LLMSERVE_CPU_OPS=0`` (then :func:`lora_add_torch` runs). Built on first use (~20 s on
    2 cores) into ``~/.cache/llmserve/torch_extensions/lora_ops_<hash>``."""
    module = _lora_module()
    return None if module is None else module.lora_add


@functools.lru_cache(maxsize=1)
def _lora_module() -> Optional[Any]:
    """The built extension (``lora_add``, ``LoRAModule``), or None (see get_lora_kernel)."""
    return load_small_extension(_NAME, _SOURCE, "lora_ops", "LoRA kernel", "the torch path", ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"], ["-fopenmp"])


def bind_lora_kernel(a_stack: torch.Tensor, b_stack: torch.Tensor, ranges: torch.Tensor,
                     ranks: torch.Tensor) -> Optional[Any]:
    """The kernel bound to one module's stacks (``LoRAModule`` of ``csrc/lora.cpp``), or
    None when it is unavailable. Its ``add(y, x, segs)`` is ``lora_add(y, x, a_stack,
    b_stack, segs, ranges, ranks)`` (the same arithmetic, ~3 us a call less at one decode
    row: see there); ``ranks`` (int32 ``[slots]``) is read at each call, so in-place writes
    to it take effect; the stacks must keep their storage (they are held). RuntimeError
    for a shape or dtype the kernel does not take."""
    module = _lora_module()
    return None if module is None else module.LoRAModule(a_stack, b_stack, ranges, ranks)


def arm_hooks(modules: Sequence[Any], mapping: LoRAMapping) -> None:
    """Arm the GEMM hooks of ``modules`` (bound kernels, :func:`bind_lora_kernel`, of every
    wrapped module whose packed GEMM runs its deltas) for a fused step's ``mapping``, in one
    call: each module's ``hook_address()`` then runs this step's deltas inside the GEMM of
    its ``mapping.num_tokens`` rows, until the next arm. RuntimeError for segments outside
    the rows or slots."""
    if modules:
        _lora_module().arm_all(list(modules), mapping.segs, mapping.num_tokens)


def kernel_supports(weight_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the C++ kernel takes weights of ``weight_dtype`` on ``device`` (CPU, float32 or
    bfloat16) and is built."""
    return device.type == "cpu" and weight_dtype in (torch.float32, torch.bfloat16) and get_lora_kernel() is not None


def column_ranges(slices: Sequence[tuple[int, int]], out_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 ``[P, 3]`` runs ``(c0, c1, slice)`` of a module's local output columns.
    slices: ``(offset, size)`` of each slice in the full output; out_index: the full
    columns this shard keeps (tensor parallel; None: all)."""
    full = [i for i, (_, size) in enumerate(slices) for _ in range(size)]
    owner = full if out_index is None else [full[c] for c in out_index.tolist()]
    runs: list[list[int]] = []
    for c, i in enumerate(owner):
        if runs and runs[-1][2] == i and runs[-1][1] == c:
            runs[-1][1] = c + 1
        else:
            runs.append([c, c + 1, i])
    return torch.tensor(runs, dtype=torch.int32).reshape(-1, 3)


def slot_weights(a_stack: torch.Tensor, b_stack: torch.Tensor, slot: int,
                 rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(A [in, n * rank], B [rank, out])`` of ``slot`` at ``rank`` (the layout in the
    module docstring; writing them writes the stacks)."""
    inp, width = a_stack.shape[1], a_stack.shape[2]
    n = width // b_stack.shape[1]
    a = a_stack[slot].view(-1)[:inp * n * rank].view(inp, n * rank)
    return a, b_stack[slot, :rank]


def _slot_rank(ranks: Optional[torch.Tensor], b_stack: torch.Tensor, slot: int) -> int:
    return b_stack.shape[1] if ranks is None else int(ranks[slot])


def lora_delta_reference(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                         token_slots: torch.Tensor, ranges: torch.Tensor,
                         ranks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The delta ``[T, out]`` (float32) row by row, by the definition in the module
    docstring; ``token_slots`` int64 ``[T]`` (-1: no delta); ``ranks`` int32 ``[slots]``
    (None: every slot at the stacks' full rank)."""
    out = torch.zeros(x.shape[0], b_stack.shape[-1])
    for t, s in enumerate(token_slots.tolist()):
        r = _slot_rank(ranks, b_stack, s) if s >= 0 else 0
        if r == 0:
            continue
        a, b = slot_weights(a_stack, b_stack, s, r)
        h = x[t:t + 1].float() @ a.float()
        for c0, c1, i in ranges.tolist():
            out[t, c0:c1] = (h[:, i * r:(i + 1) * r] @ b[:, c0:c1].float())[0]
    return out


def lora_add_torch(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                   segs: torch.Tensor, ranges: torch.Tensor, ranks: Optional[torch.Tensor] = None) -> None:
    """The kernel's contract in torch ops (any device or dtype): per segment one shrink GEMM
    and one expand GEMM per column range at the slot's rank, computed in the weights' dtype
    and added into y."""
    for slot, start, end in segs.tolist():
        r = _slot_rank(ranks, b_stack, slot)
        if r == 0:
            continue
        a, b = slot_weights(a_stack, b_stack, slot, r)
        h = x[start:end].to(a_stack.dtype) @ a
        for c0, c1, i in ranges.tolist():
            y[start:end, c0:c1] += h[:, i * r:(i + 1) * r] @ b[:, c0:c1]


# Steps of at most this many tokens may run their deltas inside the base GEMM (see
# LoRAMapping.fused): the partial shrinks of a larger step (prefill) take ~RB x W floats
# per 8 rows and chunk of A, and the kernel's own path balances it as well.
FUSED_MAX_ROWS = 64


class LoRAMapping:
    """One step's rows -> slots, built once per step and shared by every layer.

    segments: ``(slot, start, end)`` runs of rows with the same slot (base rows left out);
    ``segs``: the same as an int32 ``[G, 3]`` tensor (the kernel's input); ``slots``: the
    slots used."""

    __slots__ = ("segments", "num_tokens", "slots", "segs", "fused")

    def __init__(self, segments: Sequence[tuple[int, int, int]], num_tokens: int) -> None:
        self.segments = [s for s in segments if s[2] > s[1]]
        self.num_tokens = num_tokens
        self.slots = sorted({s for s, _, _ in self.segments})
        self.segs = torch.tensor(self.segments, dtype=torch.int32).reshape(-1, 3)
        # Whether the deltas run inside a packed base GEMM's threads (LoRAModule.arm): one
        # adapter's rows only. Same bits either way. One decode row of SmolLM2-135M Q4_1,
        # rank 16 on all seven projections, 120 modules, cold adapters, paired medians of
        # 300 alternating steps (three runs): +0.51-0.74 ms a step fused against
        # +0.69-0.81 ms as a call of their own; 16 rows over 8 adapters (bound by reading
        # 78 MB of adapters a step) +4.9 ms fused against +4.0 ms, where each thread's
        # blocks keep whole adapters.
        self.fused = len(self.segments) == 1 and num_tokens <= FUSED_MAX_ROWS

    def token_slots(self) -> torch.Tensor:
        """``[T]`` int64 slot of each row (-1: base), for the reference."""
        out = torch.full((self.num_tokens,), -1, dtype=torch.long)
        for slot, start, end in self.segments:
            out[start:end] = slot
        return out


def segments_of(row_slots: Sequence[int], row_lens: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs ``(slot, start, end)`` of equal slots over requests of ``row_lens`` tokens
    (slot < 0: base, left out)."""
    out: list[tuple[int, int, int]] = []
    t = 0
    for slot, n in zip(row_slots, row_lens):
        if slot >= 0:
            if out and out[-1][0] == slot and out[-1][2] == t:
                out[-1] = (slot, out[-1][1], t + n)
            else:
                out.append((slot, t, t + n))
        t += n
    return out


def maybe_mapping(row_slots: Sequence[int], row_lens: Sequence[int]) -> Optional[LoRAMapping]:
    """The step's mapping, or None when no row has an adapter (no LoRA work at all)."""
    segs = segments_of(row_slots, row_lens)
    return LoRAMapping(segs, sum(row_lens)) if segs else None


def main() -> None:
    """Build (or load) the kernel and say so (``make`` runs this once)."""
    import time
    t0 = time.time()
    ok = get_lora_kernel() is not None
    print(f"llmserve LoRA kernel: {ready_word(ok, _NAME)} in {time.time() - t0:.1f}s ({build_dir_for(_SOURCE, 'lora_ops')})")


if __name__ == "__main__":
    main()
