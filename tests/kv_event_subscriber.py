"""A KV-event subscriber written only from vLLM's documented schema and protocol
(docs.vllm.ai, examples/online_serving/kv_events_subscriber.py and
vllm/distributed/kv_events.py): its own msgspec structs, not llmserve's, so the tests
check that a vLLM consumer (llm-d's indexer, Dynamo's KV router) decodes what we send.

Protocol: SUB frames ``[topic, seq (8 bytes big-endian), msgpack payload]``; a gap in seq
(or a late start) is filled by sending ``[b"", start seq]`` on a DEALER socket to the
replay endpoint, which answers ``[b"", seq, payload]`` per buffered batch and an empty
payload at the end.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional, Union

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


# Newer vLLM's layout (event_layout "map"): the batch is still an array, each event a map
# tagged "type" that also carries lora_name and group_idx.
class MapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapKVCacheEvent, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    group_idx: Optional[int] = None


class MapBlockRemoved(MapKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class MapAllBlocksCleared(MapKVCacheEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(EventBatch):
    events: list[Union[MapBlockStored, MapBlockRemoved, MapAllBlocksCleared]]


_ARRAY_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_MAP_DECODER = msgspec.msgpack.Decoder(MapKVEventBatch)


def _from_map(event: Any) -> KVCacheEvent:
    if isinstance(event, MapBlockStored):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                           event.lora_id, event.medium)
    if isinstance(event, MapBlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> tuple[KVEventBatch, str]:
    """A batch in either layout as the array structs (a map event's extra fields left
    out) and the layout it came in: "map" (current vLLM's tagged maps) or "array"."""
    try:
        batch = _MAP_DECODER.decode(payload)
    except msgspec.ValidationError:
        return _ARRAY_DECODER.decode(payload), "array"
    return KVEventBatch(batch.ts, [_from_map(e) for e in batch.events], batch.data_parallel_rank), "map"


class Subscriber:
    """Collects every batch (live, gaps replayed) in a thread; ``sync()`` waits for the
    stream to go quiet and fetches any tail by replay. ``batches``: seq -> batch."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "", live: bool = True) -> None:
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.batches: dict[int, KVEventBatch] = {}
        self.layouts: set[str] = set()  # the layouts the batches came in (decode_batch)
        self.next_seq = 0
        self.replayed = 0  # batches that came through the replay socket
        self.last_message = time.monotonic()
        self.ctx = zmq.Context()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = None
        if live:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(self.endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        while not self.stop.is_set():
            if not sub.poll(50):
                continue
            topic, seq_bytes, payload = sub.recv_multipart()
            assert topic == self.topic.encode()
            seq = int.from_bytes(seq_bytes, "big")
            with self.lock:
                if seq > self.next_seq:  # missed some (or joined late): replay them first
                    self.replay(self.next_seq)
                if seq == self.next_seq:
                    self.batches[seq] = self._decode(payload)
                    self.next_seq = seq + 1
                self.last_message = time.monotonic()
        sub.close(linger=0)

    def _decode(self, payload: bytes) -> KVEventBatch:
        batch, layout = decode_batch(payload)
        self.layouts.add(layout)
        return batch

    def replay(self, start: int) -> int:
        """Ask the replay socket for batches from ``start``; returns how many came."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = 0
        while True:
            assert sock.poll(5000), "the replay socket did not answer"
            empty, seq_bytes, payload = sock.recv_multipart()
            assert empty == b""
            if not payload:  # the end marker (seq -1)
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                break
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= self.next_seq:
                assert seq == self.next_seq, f"replay skipped from {self.next_seq} to {seq}"
                self.batches[seq] = self._decode(payload)
                self.next_seq = seq + 1
                got += 1
        sock.close(linger=0)
        self.replayed += got
        return got

    def sync(self, quiet_s: float = 0.3) -> None:
        """Wait until no live message came for ``quiet_s``, then replay any tail."""
        while time.monotonic() - self.last_message < quiet_s:
            time.sleep(0.05)
        with self.lock:
            self.replay(self.next_seq)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(5)
        self.ctx.term()

    def tracked_blocks(self) -> set:
        """The block hashes stored and not removed since the last clear, from the events."""
        blocks: set = set()
        for seq in range(self.next_seq):
            for ev in self.batches[seq].events:
                if isinstance(ev, BlockStored):
                    assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                    blocks.update(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    assert set(ev.block_hashes) <= blocks, "removed a block never stored"
                    blocks.difference_update(ev.block_hashes)
                else:
                    blocks.clear()
        return blocks

    def count(self, kind: type) -> int:
        return sum(isinstance(ev, kind) for b in self.batches.values() for ev in b.events)
