"""KV event publishers (vLLM's ``vllm.distributed.kv_events`` publishers): the engine hands
each step's ``KVEventBatch`` (core/kv_events.py) to ``publish``; a thread encodes it with
msgpack and sends it, so the step loop never waits on a socket.

Wire format of ``ZmqEventPublisher`` (what vLLM's subscribers, llm-d's KV indexer and
Dynamo's KV router read):

* a PUB socket at ``endpoint`` sends each batch as three frames: ``topic`` (UTF-8),
  the batch's sequence number (8 bytes, big-endian, from 0) and the msgpack payload;
  the numbers go on rising across the engine processes of one server (sleep level 2's
  wake-up, ``--restart-engine-on-failure``: distributed/kv_event_seq.py), and a
  publisher that resumes a sequence first sends ``AllBlocksCleared`` (the ended
  process's cache is gone);
* a ROUTER socket at ``replay_endpoint`` takes ``[client id, b"", start seq]`` (a REQ
  or DEALER client) and answers ``[client id, b"", seq, payload]`` for every batch still
  buffered (the last ``buffer_steps``) from ``start seq`` on, then the end marker
  ``[client id, b"", -1 as 8 signed big-endian bytes, b""]``;
* the payload is ``[ts, events, data_parallel_rank]``; each event a map tagged ``"type"``
  (``event_layout`` "map", the default: current vLLM's, see ``as_tagged_map``) or an
  array ``["BlockStored", ...fields]`` ("array": older vLLM's ``array_like`` events);
* with data parallel, rank r binds ``endpoint`` and ``replay_endpoint`` with the TCP
  port + r (``ipc``/``inproc`` names get ``_dp<r>``) and stamps ``data_parallel_rank``
  on its batches.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Optional

import msgspec
import zmq

from llmserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventBatch
from llmserve.distributed.kv_event_seq import SeqFile, seq_file_path

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def offset_endpoint_port(endpoint: Optional[str], data_parallel_rank: int) -> Optional[str]:
    """The endpoint of DP rank ``data_parallel_rank``: ``tcp://host:port`` -> port + rank;
    ``ipc://`` / ``inproc://`` names get ``_dp<rank>`` (vLLM's rule). Rank 0 and None
    keep ``endpoint``. Raises ValueError for a tcp endpoint without a numeric port."""
    if endpoint is None or not data_parallel_rank:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"kv_events_config: endpoint {endpoint!r} has no port to offset by the "
                         f"data-parallel rank {data_parallel_rank}")
    return f"{base}:{int(port) + data_parallel_rank}"


def check_rank_endpoints(endpoint: str, replay_endpoint: Optional[str], data_parallel_size: int) -> None:
    """With ``data_parallel_size`` ranks, rank r uses both endpoints at port + r: raise
    ValueError naming ``kv_events_config.replay_endpoint`` when a rank's replay socket
    would take another rank's PUB port (e.g. the defaults 5557/5558 at DP=2)."""
    if replay_endpoint is None or data_parallel_size < 2:
        return
    pubs = {offset_endpoint_port(endpoint, r) for r in range(data_parallel_size)}
    clash = [offset_endpoint_port(replay_endpoint, r) for r in range(data_parallel_size)
             if offset_endpoint_port(replay_endpoint, r) in pubs]
    if clash:
        raise ValueError(f"kv_events_config.replay_endpoint: with data_parallel_size={data_parallel_size} each rank "
                         f"r uses port + r, so {clash[0]} would be both a replay and a PUB endpoint; put the "
                         f"replay port at least {data_parallel_size} away from the endpoint's")


def as_tagged_map(event) -> dict:
    """One event in the map layout (``event_layout: "map"``): ``{"type": <class name>,
    <field>: ...}`` with newer vLLM's extra fields (a BlockStored's ``lora_name``: its
    adapter's name, None for the base model; ``group_idx`` 0: one KV cache group)."""
    out = {"type": type(event).__name__, **msgspec.structs.asdict(event)}
    if isinstance(event, (BlockStored, BlockRemoved)):
        out["group_idx"] = 0
    return out


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host (``*``, ``::``) or a local ipc/inproc name is bound;
    any other address is connected to (a collector that binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class NullEventPublisher:
    """Drops every batch (``publisher: "null"``)."""

    def publish(self, batch: EventBatch) -> None:
        pass

    def shutdown(self, timeout: float = 1.0) -> None:
        pass


class ZmqEventPublisher:
    """Sends event batches on a ZMQ PUB socket from its own thread, keeps the last
    ``buffer_steps`` for replay (see the module docstring for the frames).

    ``publish`` only queues (``max_queue_size`` batches; past that it blocks the caller
    until the thread catches up, as vLLM's). The sockets are bound in ``__init__``, so a
    taken port is a ``zmq.ZMQError`` at engine start, not a silent thread death.
    ``seq_path``: the file that carries the sequence number over from this rank's
    previous publisher (``kv_event_seq.SeqFile``; None: count from 0)."""

    def __init__(self, data_parallel_rank: int = 0, endpoint: str = "tcp://*:5557",
                 replay_endpoint: Optional[str] = None, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = "", event_layout: str = "map",
                 seq_path: Optional[str] = None) -> None:
        self.data_parallel_rank = data_parallel_rank
        self._as_maps = event_layout == "map"
        self.endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            (self._pub.bind if _binds(self.endpoint) else self._pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {self.endpoint} / {self.replay_endpoint}: {e}") from e
        self._seq = SeqFile(seq_path)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        if self._seq.start:  # a fresh engine after an ended one: its blocks are gone
            self.publish(KVEventBatch(time.time(), [AllBlocksCleared()]))

    def publish(self, batch: EventBatch) -> None:
        """Queue one batch (stamped with this rank). Raises RuntimeError after shutdown."""
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        self._queue.put(batch)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._thread.join(timeout)
        if not self._thread.is_alive():  # else it still sends: its sockets go with the process
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=200)
        self._ctx.term()

    def _run(self) -> None:
        seq = self._seq.start
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                if self._as_maps:
                    batch = EventBatch(batch.ts, [as_tagged_map(e) for e in batch.events], batch.data_parallel_rank)
                payload = self._encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            except Exception:  # noqa: BLE001 - a bad batch or socket must not stop the stream
                logger.exception("KV event batch %d not sent", seq)
                continue
            self._buffer.append((seq, payload))
            seq += 1
            self._seq.store(seq)
        self._seq.close()

    def _serve_replay(self) -> None:
        """Answer one replay request: the buffered batches from its start seq, then END_SEQ."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV event replay: ignoring a request of %d frames (want id, b'', start seq)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def make_kv_event_publisher(config) -> Optional[ZmqEventPublisher | NullEventPublisher]:
    """The publisher an engine of ``config`` (VllmConfig) runs, or None when it makes no
    events (no ``kv_events_config``, events off, publisher "null", or prefix caching off:
    only cached blocks have events, as vLLM warns). The DP rank is the config's
    ``parallel_config.data_parallel_rank`` (0 for a single engine)."""
    kec = getattr(config, "kv_events_config", None)
    if kec is None or not kec.publishes:
        return None
    if not config.cache_config.enable_prefix_caching:
        logger.warning("KV cache events are on, but prefix caching is off (--no-enable-prefix-caching): "
                       "no block is cached, so none is published")
        return None
    rank = config.parallel_config.data_parallel_rank or 0
    pub = ZmqEventPublisher(rank, kec.endpoint, kec.replay_endpoint, kec.buffer_steps, kec.hwm,
                            kec.max_queue_size, kec.topic, kec.event_layout, seq_file_path(kec, rank))
    # vLLM's rule (_binds) surprises operators: tcp://127.0.0.1:5557 is connected to, so a
    # router that connects to it (vllm-router's --kv-event-source) never gets an event.
    how = ("publishing on" if _binds(pub.endpoint) else
           "publishing to a subscriber that binds (a host that is not a wildcard is connected to, as in vLLM; "
           "use tcp://*:PORT for routers that connect)")
    logger.info("KV cache events: %s %s (replay %s), topic %r, data-parallel rank %d",
                how, pub.endpoint, pub.replay_endpoint, kec.topic, rank)
    return pub


# /kv_event_sources' entry schema (what vllm-router 0.1.17's kv_aware discovery reads): the
# stream is msgpack; schema 1 is the map layout (each event a map tagged "type", newest
# vLLM's), 0 the array-like structs of vLLM's documented subscriber example. vllm-router
# subscribes only to schema 1 and skips any other entry without a log line.
SOURCE_ENCODING = "msgpack"
SOURCE_SCHEMA_VERSIONS = {"map": 1, "array": 0}


def kv_event_sources(config, ranks) -> dict[str, dict]:
    """The KV event publishers of the data-parallel ``ranks`` an API server fronts, for
    ``GET /kv_event_sources``: ``{"<rank>": {endpoint, replay_endpoint, topic, hwm,
    buffer_steps, publisher, encoding, schema_version, enable_kv_cache_events}}``, each
    endpoint with rank r's port offset (``offset_endpoint_port``). Empty when the engines
    publish nothing (the rule of :func:`make_kv_event_publisher`) and for an endpoint the
    publisher connects to (a subscriber that binds owns it: nothing there to connect to).

    A wildcard host (``tcp://*:5557``) is sent as bound: a consumer puts the worker's host
    in its place (vllm-router does). The topic matters: vllm-router's static
    ``--kv-event-source`` reads only the empty topic and drops every other batch
    silently, while a discovered source carries its topic."""
    kec = getattr(config, "kv_events_config", None)
    if kec is None or not kec.publishes or not config.cache_config.enable_prefix_caching:
        return {}
    sources = {}
    for rank in ranks:
        endpoint = offset_endpoint_port(kec.endpoint, rank)
        if not _binds(endpoint):
            continue
        sources[str(rank)] = {
            "endpoint": endpoint, "replay_endpoint": offset_endpoint_port(kec.replay_endpoint, rank),
            "topic": kec.topic, "hwm": kec.hwm, "buffer_steps": kec.buffer_steps, "publisher": kec.publisher,
            "encoding": SOURCE_ENCODING, "schema_version": SOURCE_SCHEMA_VERSIONS[kec.event_layout],
            "enable_kv_cache_events": True}
    return sources
