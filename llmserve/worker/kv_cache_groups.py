"""KV cache groups in the model runner: which KV tensor and which block table each layer of
a hybrid model uses (vLLM's ``KVCacheConfig`` with uniform page size: its
``kv_cache_groups`` and the ``KVCacheTensor`` s the groups share).

A model whose attention layers all have the same kind (all full, or all windowed) has one
group: one KV tensor per layer, one block table per request, as before.

A hybrid model (Gemma 2: sliding and full layers alternate; Gemma 3: five sliding per full
one) gets its layers grouped by kind (full attention first, then each window size), each
kind cut in order into groups of S layers, S the number of layers of the rarest kind
(Gemma 2 with L layers: S = L/2, one full and one sliding group; Gemma 3 1B's 4 full and 22
sliding layers: S = 4, one full group and six sliding ones, the last holding 2 layers).
There are S KV tensors ``[2, num_blocks, block_size, kv_heads, head_dim]``; the j-th layer
of every group uses tensor j. A block id is thus one page of S layers' K/V belonging to
whichever group the scheduler gave it to (core/kv_cache_coordinator.py), and each group
has its own block table per request: the full group's holds every block, a windowed
group's only those its window reaches (null block 0 elsewhere).

Memory: the same bytes serve every group. The KV budget is divided into blocks of
``2 * S * block_size * kv_heads * head_dim`` elements (S layers, not all of them), so
the same budget gives num_layers / S times as many block ids as one group would; a
request of n tokens holds ceil(n / block_size) of them in the full group and at most the
window's in each windowed group. The price: a group with fewer than S layers (the last
sliding group when S does not divide their number) leaves the rest of its pages unused
(Gemma 3 1B: 2 of 4 layers in the sixth sliding group), as in vLLM.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from llmserve.attention.backend import AttentionMetadata, PagedAttention


@dataclass(frozen=True)
class KVCacheLayout:
    """group_windows: per group, None (full attention) or its window (tokens);
    layer_group / layer_slot: per layer, its group and the KV tensor it uses;
    num_slots: KV tensors (layers per group, S)."""

    group_windows: list[Optional[int]]
    layer_group: list[int]
    layer_slot: list[int]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)


def plan_kv_cache_layout(layer_windows: Sequence[Optional[int]], hybrid: bool = True) -> KVCacheLayout:
    """The layout for layers with these windows (None: full attention), in layer order.

    One group (a tensor per layer) unless full-attention and windowed layers mix and
    ``hybrid`` is True; its window is the largest when every layer is windowed, else None
    (a full-attention layer reads every block). Otherwise the groups of the module
    docstring, layers of different windows in different groups.
    """
    n = len(layer_windows)
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    mixed = None in kinds and len(kinds) > 1  # full-attention and windowed layers
    if not (mixed and hybrid):
        window = None if not n or None in kinds else max(layer_windows)
        return KVCacheLayout([window], [0] * n, list(range(n)), n)
    by_kind = {k: [i for i, w in enumerate(layer_windows) if w == k] for k in kinds}
    size = min(len(v) for v in by_kind.values())
    windows: list[Optional[int]] = []
    layer_group, layer_slot = [0] * n, [0] * n
    for k in kinds:
        layers = by_kind[k]
        for start in range(0, len(layers), size):
            for j, i in enumerate(layers[start:start + size]):
                layer_group[i], layer_slot[i] = len(windows), j
            windows.append(k)
    return KVCacheLayout(windows, layer_group, layer_slot, size)


def paged_attention_layers(model: Optional[torch.nn.Module]) -> list[PagedAttention]:
    """The model's ``PagedAttention`` layers in module order (one per decoder layer)."""
    if model is None:
        return []
    return [a for m in model.modules() for a in vars(m).values() if isinstance(a, PagedAttention)]


def assign_kv_cache_groups(model: Optional[torch.nn.Module], layout: KVCacheLayout) -> None:
    """Tell each ``PagedAttention`` layer of ``model`` its group (``kv_cache_group``)."""
    if layout.num_groups > 1:
        for a, g in zip(paged_attention_layers(model), layout.layer_group):
            a.kv_cache_group = g


def layout_for_model(model: Optional[torch.nn.Module], config: Any) -> KVCacheLayout:
    """``plan_kv_cache_layout`` over the windows of ``model`` 's attention layers
    (``config``: the EngineConfig), with its layers told their groups. Several groups
    only for a decoder mixing full and windowed layers (Gemma 2/3) without a KV connector
    (connectors move one block table per request) or pipeline stages (each would lay out
    its own layers); otherwise one tensor per layer (``num_layers`` of them)."""
    mc = config.model_config
    attns = [] if mc.is_encoder_only else paged_attention_layers(model)
    ktc = getattr(config, "kv_transfer_config", None)
    hybrid = (len(attns) == mc.num_layers and not mc.is_encoder_decoder
              and not (ktc is not None and ktc.is_kv_transfer_instance)
              and config.parallel_config.pipeline_parallel_size == 1)
    layout = plan_kv_cache_layout([a.sliding_window for a in attns], hybrid)
    if layout.num_groups > 1:
        assign_kv_cache_groups(model, layout)
        return layout
    return KVCacheLayout(layout.group_windows, [0] * mc.num_layers, list(range(mc.num_layers)), mc.num_layers)


def add_group_metadata(md: AttentionMetadata, group_block_ids: Sequence[Sequence[Sequence[int]]],
                       positions: np.ndarray, query_lens: Sequence[int], device: torch.device) -> None:
    """Give ``md`` (built on the first group's tables) one ``AttentionMetadata`` per group
    in ``md.kv_groups``: the same batch with that group's block tables ``[B, max_blocks]``
    int32 and slot mapping ``[T]`` int64. ``group_block_ids[i][g]``: request i's table in
    group g (in the batch's order); ``positions`` ``[T]`` int64, ``query_lens`` per request.
    A token's slot in a windowed group is never the null block: the scheduler frees only
    blocks before the window of the step's first token."""
    num_groups = len(group_block_ids[0])
    bs = md.block_size
    row = np.repeat(np.arange(len(query_lens)), query_lens)
    groups = [md]
    for g in range(1, num_groups):
        tables = np.zeros((len(group_block_ids), max(len(ids[g]) for ids in group_block_ids)), dtype=np.int32)
        for i, ids in enumerate(group_block_ids):
            tables[i, :len(ids[g])] = ids[g]
        slots = tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        groups.append(dataclasses.replace(md, slot_mapping=torch.from_numpy(slots).to(device),
                                          block_tables=torch.from_numpy(tables).to(device)))
    md.kv_groups = groups
