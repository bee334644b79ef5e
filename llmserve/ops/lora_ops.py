"""Batched LoRA deltas for a step that mixes adapters (in the spirit of punica's SGMV /
BGMV kernels, Chen et al. 2023), over stacked per-slot weights:

    a_stack [slots, in, R]   (lora_A transposed, rank padded to R with zeros)
    b_stack [slots, R, out]  (lora_B transposed, scale folded in)

Each token row t with slot s = ``token_slots[t]`` (-1: the base model, no delta) gets
``y[t] += (x[t] @ a_stack[s]) @ b_stack[s]``; the base GEMM ran once for all rows before.

Two ways, picked once per step by :class:`LoRAMapping` (the runner orders the step's
requests by adapter, so each adapter's rows are few contiguous segments):
- ``sgmv``: per segment, two GEMMs on views (no copies) - few segments (one adapter at
  c=1, prompts);
- ``bgmv``: the rows gathered into a ``[slots_used, m, in]`` batch (m: the most rows of
  one slot, shorter slots padded), two ``bmm``, one ``index_add_`` - many small
  segments (decodes spread over adapters): a fixed 4-5 ops per layer whatever the number
  of adapters, where a loop over segments would cost ~2 Python-dispatched GEMMs each.
``lora_delta_reference`` is the pure-torch per-row definition both are tested against.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

# Segments at or above which a step gathers rows for bmm (measured on SmolLM2 shapes,
# 2 cores: a segment's two GEMMs cost ~8 us of dispatch; the gather path ~30 us a layer).
BGMV_MIN_SEGMENTS = 3


def lora_delta_reference(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                         token_slots: torch.Tensor) -> torch.Tensor:
    """The delta ``[T, out]`` row by row: ``x[t] @ a_stack[s] @ b_stack[s]`` for slot
    ``s = token_slots[t]`` (int64 ``[T]``), zero where ``s < 0``. x ``[T, in]``."""
    out = x.new_zeros(x.shape[0], b_stack.shape[-1])
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] = (x[t:t + 1] @ a_stack[s]) @ b_stack[s]
    return out


class LoRAMapping:
    """One step's rows -> slots, built once per step (not per layer).

    segments: ``(slot, start, end)`` runs of rows with the same slot (base rows left out).
    For the gathered path: ``slots_used`` (the slot range 0..n that the bmm covers),
    ``gather_idx [n * m]`` (row of x for each batch entry; pads repeat a real row),
    ``valid`` (entries that are real rows, None when none is a pad) and ``scatter_idx``
    (their rows in y)."""

    def __init__(self, segments: Sequence[tuple[int, int, int]], num_tokens: int,
                 device: torch.device, min_bgmv_segments: int = BGMV_MIN_SEGMENTS) -> None:
        self.segments = [s for s in segments if s[2] > s[1]]
        self.num_tokens = num_tokens
        self.slots = sorted({s for s, _, _ in self.segments})
        self.use_bgmv = len(self.segments) >= min_bgmv_segments
        if self.use_bgmv:
            self._build_gather(device)

    def _build_gather(self, device: torch.device) -> None:
        rows: dict[int, list[int]] = {}
        for slot, start, end in self.segments:
            rows.setdefault(slot, []).extend(range(start, end))
        n = self.slots[-1] + 1
        m = max(len(r) for r in rows.values())
        gather, valid = [], []
        for slot in range(n):
            r = rows.get(slot, [])
            pad = m - len(r)
            gather.extend(r + [r[0] if r else 0] * pad)
            valid.extend([True] * len(r) + [False] * pad)
        self.num_slots, self.rows_per_slot = n, m
        self.gather_idx = torch.tensor(gather, dtype=torch.long, device=device)
        flags = torch.tensor(valid, dtype=torch.bool, device=device)
        self.valid = None if all(valid) else flags.nonzero().squeeze(1)
        self.scatter_idx = self.gather_idx if self.valid is None else self.gather_idx[self.valid]

    def token_slots(self) -> torch.Tensor:
        """``[T]`` int64 slot of each row (-1: base), for the reference."""
        out = torch.full((self.num_tokens,), -1, dtype=torch.long)
        for slot, start, end in self.segments:
            out[start:end] = slot
        return out


def add_lora(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             mapping: LoRAMapping, a_slots: Optional[Sequence[torch.Tensor]] = None,
             b_slots: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
    """``y += delta`` in place (y ``[T, out]``, x ``[T, in]``) by the mapping's path;
    returns y. Weights of another dtype than y (float32 adapters on a bfloat16 model)
    compute in theirs and add into y's. ``a_slots`` / ``b_slots``: the stacks' per-slot
    views, made once (indexing a list costs no tensor op; ~1 us a view here)."""
    if x.dtype != a_stack.dtype:
        x = x.to(a_stack.dtype)
    if mapping.use_bgmv:
        return bgmv(y, x, a_stack, b_stack, mapping)
    return sgmv(y, x, a_stack if a_slots is None else a_slots, b_stack if b_slots is None else b_slots,
                mapping.segments)


def sgmv(y: torch.Tensor, x: torch.Tensor, a_stack, b_stack,
         segments: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """Segmented: for each ``(slot, start, end)``, ``y[start:end] += x[start:end] @ a @ b``
    (``a_stack`` / ``b_stack``: the stacks or lists of their slots). A segment of the
    whole batch (one adapter at c=1) takes no slicing op."""
    n = y.shape[0]
    same = y.dtype == x.dtype
    for slot, start, end in segments:
        ys, xs = (y, x) if start == 0 and end == n else (y[start:end], x[start:end])
        if same:
            ys.addmm_(torch.mm(xs, a_stack[slot]), b_stack[slot])
        else:  # in-place add casts the delta to y's dtype
            ys.add_(torch.mm(torch.mm(xs, a_stack[slot]), b_stack[slot]))
    return y


def bgmv(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
         mapping: LoRAMapping) -> torch.Tensor:
    """Gathered: all rows of slots ``0..n`` in one ``[n, m, in]`` batch, two ``bmm``,
    then the real rows added into y."""
    n, m = mapping.num_slots, mapping.rows_per_slot
    xg = x.index_select(0, mapping.gather_idx).view(n, m, x.shape[1])
    d = torch.bmm(torch.bmm(xg, a_stack[:n]), b_stack[:n]).view(n * m, -1)
    if mapping.valid is not None:
        d = d.index_select(0, mapping.valid)
    return y.index_add_(0, mapping.scatter_idx, d if d.dtype == y.dtype else d.to(y.dtype))


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


def maybe_mapping(row_slots: Sequence[int], row_lens: Sequence[int], device: torch.device) -> Optional[LoRAMapping]:
    """The step's mapping, or None when no row has an adapter (no LoRA work at all)."""
    segs = segments_of(row_slots, row_lens)
    return LoRAMapping(segs, sum(row_lens), device) if segs else None
