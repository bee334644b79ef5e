"""The prefix cache's block events, in vLLM's KV-event wire schema
(``vllm.distributed.kv_events``, as documented by vLLM's kv_events_subscriber example).

The block pool (core/kv_cache_manager.py) makes these plain msgspec structs when
``--kv-events-config`` enables events; the engine drains them once per step into one
``KVEventBatch`` that llmserve/distributed/kv_events.py encodes with msgpack and sends.
No ZMQ and no torch here.

Wire facts a vLLM subscriber relies on (so keep them): every struct is ``array_like``
(a msgpack array of its fields in this order) with ``omit_defaults``; an event is tagged
with its class name as the array's first element (``["BlockStored", ...]``); a batch is
``[ts, events]`` plus ``data_parallel_rank`` when set (a trailing default is omitted).
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

# vLLM names the tier of the engine's own KV blocks "GPU" (its BlockPool's medium); the
# pool here is that tier whatever the device, so a router that tracks tiers sees the
# primary one.
MEDIUM_PRIMARY = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events. ts: wall-clock time (seconds since the epoch) when the batch
    was made; data_parallel_rank: the DP rank of the engine that made it."""

    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the block events (tagged by class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache. block_hashes: one per block, in prefix order
    (64-bit chain hashes, core/kv_cache_manager.hash_block_tokens); parent_block_hash:
    the hash of the block before the first one (None at the start of a sequence);
    token_ids: the blocks' tokens, ``block_size * len(block_hashes)`` of them; lora_id:
    the adapter's int id (None: base model); medium: the KV tier; lora_name: the
    adapter's name (newer vLLM's field, after ``medium``: an array consumer with vLLM's
    documented six fields ignores it, as msgspec does trailing fields). Routers that hash
    token ids themselves (vllm-router's ``kv_aware``) key an adapter's blocks by this
    name, as the engine keeps two adapters' KV of one prompt apart."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted (their hashes no longer find them)."""

    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset (``reset_prefix_cache``)."""


class KVEventBatch(EventBatch):
    """An EventBatch of block events (what the publisher sends)."""

    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
