"""--kv-events-config (issue 35 item 3): the prefix cache's block events in vLLM's wire
format. A subscriber written from vLLM's documented schema (tests/kv_event_subscriber.py,
its own structs) decodes every batch of a run, the blocks it tracks as stored equal the
engine's prefix cache after evictions and after a reset, a subscriber that starts late
recovers every batch through the replay socket, and a bad config names its field."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from llmserve import LLM, SamplingParams
from llmserve.benchmarks.kv_events import token_trace
from llmserve.engine_args import EngineArgs
from tests.kv_event_subscriber import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, save_tiny_model_fn):
    path = str(tmp_path_factory.mktemp("tiny-kv-events"))
    save_tiny_model_fn("llama", path)
    return path


def _conversations(n_conv: int, turns: int) -> list[list[list[int]]]:
    """Per conversation, its turns' prompts: each turn extends the previous one (a chat)."""
    return token_trace(n_conv, turns, first=(20, 60), turn=(10, 30))


@pytest.mark.parametrize("n_conv, turns", [(8, 3), pytest.param(50, 4, marks=pytest.mark.slow)])
def test_vllm_schema_subscriber_tracks_the_prefix_cache_and_replays(tiny_path, tmp_path, n_conv, turns):
    """n_conv conversations of ``turns`` turns (make test: 24 requests; slow: 200)."""
    pub, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    live = Subscriber(pub, replay, topic="kv")
    llm = LLM(tiny_path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              block_size=BLOCK, num_gpu_blocks_override=40, max_model_len=256, max_num_seqs=8,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
                                "replay_endpoint": replay, "topic": "kv"})
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.pool
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        convs = _conversations(n_conv, turns)
        for turn in range(turns):  # 40 blocks of 16 tokens hold a third of 8 conversations
            llm.generate([{"prompt_token_ids": c[turn]} for c in convs], params, use_tqdm=False)
        live.sync()
        print(f"{n_conv * turns} requests: {live.next_seq} batches ({live.replayed} replayed), "
              f"{live.count(BlockStored)} BlockStored, {live.count(BlockRemoved)} BlockRemoved, "
              f"{len(pool.cached)} blocks cached")
        assert live.count(BlockStored) > 0 and live.count(BlockRemoved) > 0  # evictions happened
        assert {b.data_parallel_rank for b in live.batches.values()} == {0}
        assert live.layouts == {"map"}  # the default: current vLLM's tagged-map events
        assert live.tracked_blocks() == set(pool.cached)
        stored = next(ev for b in live.batches.values() for ev in b.events if isinstance(ev, BlockStored))
        assert stored.parent_block_hash is None and stored.block_size == BLOCK and stored.medium == "GPU"
        assert stored.token_ids == convs[0][0][:BLOCK * len(stored.block_hashes)]

        late = Subscriber(pub, replay, topic="kv", live=False)  # joins after the run
        assert late.replay(0) == live.next_seq
        assert [late.batches[s] for s in range(late.next_seq)] == [live.batches[s] for s in range(live.next_seq)]

        assert llm.reset_prefix_cache()
        live.sync()
        assert isinstance(live.batches[live.next_seq - 1].events[-1], AllBlocksCleared)
        assert live.tracked_blocks() == set(pool.cached) == set()
        late.close()
    finally:
        live.close()
        llm.llm_engine.shutdown()


def _walk(sub: Subscriber) -> set:
    """Replay ``sub``'s batches in order, as a router tracks them: every BlockStored's parent
    and every BlockRemoved's hash must be a block announced and not removed since; returns
    the blocks tracked at the end."""
    tracked: set = set()
    for seq in range(sub.next_seq):
        for ev in sub.batches[seq].events:
            if isinstance(ev, BlockStored):
                assert ev.parent_block_hash is None or ev.parent_block_hash in tracked, \
                    f"batch {seq}: BlockStored's parent {ev.parent_block_hash} was never announced"
                tracked.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= tracked, f"batch {seq}: removed blocks never announced"
                tracked.difference_update(ev.block_hashes)
            else:
                tracked.clear()
    return tracked


def test_blocks_restored_from_a_disk_tier_are_announced_before_anything_else(tiny_path, tmp_path):
    """An engine started over a disk KV tier filled by an earlier one restores blocks into
    its prefix cache (restore_on_start, the default): each is announced (BlockStored, chain
    order, tokens that hash to it) before serving, so the evictions that new prompts cause
    and the stores chained on restored blocks refer to announced blocks only."""
    from llmserve.core.kv_cache_manager import hash_block_tokens

    kv = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "tier")}}
    args = dict(tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False, block_size=BLOCK,
                num_gpu_blocks_override=40, max_model_len=256, max_num_seqs=8, kv_transfer_config=kv)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    convs = _conversations(8, 2)
    first = LLM(tiny_path, **args)  # fills the tier
    for turn in range(2):
        first.generate([{"prompt_token_ids": c[turn]} for c in convs], params, use_tqdm=False)
    first.llm_engine.shutdown()

    pub, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    llm = LLM(tiny_path, **args, kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                                   "endpoint": pub, "replay_endpoint": replay, "topic": "kv"})
    sub = Subscriber(pub, replay, topic="kv", live=False)
    try:
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.pool
        restored = set(pool.cached)
        assert len(restored) >= 8  # the restore ran (in-process: all of it at start)
        sub.replay(0)
        assert _walk(sub) == restored  # announced before any request
        for seq in range(sub.next_seq):
            for ev in sub.batches[seq].events:
                parent = ev.parent_block_hash or 0
                for i, h in enumerate(ev.block_hashes):  # the tokens a router hashes
                    assert hash_block_tokens(parent, ev.token_ids[i * BLOCK:(i + 1) * BLOCK]) == h
                    parent = h
                assert ev.block_size == BLOCK and ev.medium == "GPU" and ev.lora_id is None

        # Turn 3 extends restored chains (stores whose parents were restored); new prompts
        # evict the restored blocks (40 blocks hold about a third of it all).
        longer = _conversations(8, 3)
        fresh = [[(t * 7 + k) % 30000 + 300 for t in range(60)] for k in range(8)]
        llm.generate([{"prompt_token_ids": c[2]} for c in longer], params, use_tqdm=False)
        llm.generate([{"prompt_token_ids": p} for p in fresh], params, use_tqdm=False)
        sub.replay(sub.next_seq)
        assert sub.count(BlockRemoved) > 0 and not restored & set(pool.cached)  # every restored block evicted
        assert _walk(sub) == set(pool.cached)
    finally:
        sub.close()
        llm.llm_engine.shutdown()


def test_kv_events_off_makes_no_events(tiny_path):
    llm = LLM(tiny_path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              block_size=BLOCK, num_gpu_blocks_override=40, max_model_len=256)
    core = llm.llm_engine.engine_core.engine_core
    try:
        llm.generate([{"prompt_token_ids": list(range(1000, 1050))}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert core.kv_event_publisher is None and core.scheduler.kv_cache_manager.pool.events is None
        assert len(core.scheduler.kv_cache_manager.pool.cached) == 3
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("value, field", [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "kv_events_config.publisher"),
    ('{"enable_kv_cache_events": true, "buffer_step": 10}', "kv_events_config: unknown field 'buffer_step'; did you mean 'buffer_steps'"),
    ('{"enable_kv_cache_events": "yes"}', "kv_events_config.enable_kv_cache_events"),
    ('{"enable_kv_cache_events": true, "hwm": 0}', "kv_events_config.hwm"),
    ('{"endpoint": "localhost:5557"}', "kv_events_config.endpoint"),
    ('{"enable_kv_cache_events": true', "kv_events_config: not valid JSON"),
    ('[1, 2]', "kv_events_config must be a JSON object"),
    ('{"event_layout": "json"}', "kv_events_config.event_layout"),
])
def test_malformed_kv_events_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(".", r"\.")):
        EngineArgs(kv_events_config=value)


def test_kv_events_config_defaults_follow_vllm():
    cfg = EngineArgs(kv_events_config='{"enable_kv_cache_events": true}').kv_events_config
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.topic, cfg.buffer_steps, cfg.hwm,
            cfg.max_queue_size, cfg.event_layout) == ("zmq", "tcp://*:5557", None, "", 10_000, 100_000, 100_000, "map")
    assert EngineArgs(kv_events_config={}).kv_events_config.publisher == "null"


def test_endpoint_offset_by_data_parallel_rank():
    from llmserve.distributed.kv_events import offset_endpoint_port

    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("ipc:///tmp/ev", 1) == "ipc:///tmp/ev_dp1"
    assert offset_endpoint_port(None, 1) is None


def test_map_layout_decodes_with_newer_vllm_structs(tmp_path):
    """event_layout "map": a subscriber with newer vLLM's tagged-map structs decodes each
    kind of event (fetched through the replay socket: no slow-joiner race)."""
    import msgspec
    import zmq

    from llmserve.core import kv_events as ev
    from llmserve.distributed.kv_events import ZmqEventPublisher
    from tests.kv_event_subscriber import MapAllBlocksCleared, MapBlockRemoved, MapBlockStored, MapKVEventBatch

    pub = ZmqEventPublisher(1, f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay", event_layout="map")
    try:
        pub.publish(ev.KVEventBatch(1.5, [ev.BlockStored([7, 2**64 - 1], None, list(range(32)), 16, None, "GPU"),
                                          ev.BlockRemoved([7], "GPU"), ev.AllBlocksCleared()]))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(pub.replay_endpoint)  # rank 1: ipc://.../replay_dp1
        payload = b""
        for _ in range(50):  # the batch reaches the buffer once the thread has sent it
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            assert sock.poll(5000), "no replay answer"
            frames = [sock.recv_multipart()]
            while frames[-1][2]:
                frames.append(sock.recv_multipart())
            if len(frames) > 1:
                payload = frames[0][2]
                break
        sock.close(linger=0)
        ctx.term()
    finally:
        pub.shutdown()
    batch = msgspec.msgpack.Decoder(MapKVEventBatch).decode(payload)
    stored, removed, cleared = batch.events
    assert pub.replay_endpoint.endswith("/replay_dp1") and batch.data_parallel_rank == 1 and batch.ts == 1.5
    assert isinstance(stored, MapBlockStored) and stored.block_hashes == [7, 2**64 - 1]
    assert stored.token_ids == list(range(32)) and stored.lora_name is None and stored.group_idx == 0
    assert isinstance(removed, MapBlockRemoved) and removed.block_hashes == [7]
    assert isinstance(cleared, MapAllBlocksCleared)


def test_replay_port_of_one_rank_may_not_be_the_pub_port_of_another(tiny_path):
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    with pytest.raises(ValueError, match="kv_events_config.replay_endpoint"):
        EngineArgs(tiny_path, tokenizer="SmolLM2-135M-Instruct", data_parallel_size=2,
                   kv_events_config=events).create_engine_config()
    EngineArgs(tiny_path, tokenizer="SmolLM2-135M-Instruct", data_parallel_size=2,
               kv_events_config=dict(events, replay_endpoint="tcp://*:5567")).create_engine_config()


def test_the_start_log_says_when_the_endpoint_is_connected_to_not_bound(caplog):
    """vLLM's rule binds only wildcard hosts: tcp://127.0.0.1:P is connected to, so a router
    that connects there (vllm-router --kv-event-source) got nothing while the log said
    'publishing on' it (found putting two servers behind vllm-router's kv_aware policy)."""
    import logging
    from types import SimpleNamespace

    from llmserve.config import KVEventsConfig
    from llmserve.distributed.kv_events import make_kv_event_publisher

    for endpoint, connects in (("tcp://127.0.0.1:0", True), ("tcp://*:0", False)):
        kec = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)
        config = SimpleNamespace(kv_events_config=kec, cache_config=SimpleNamespace(enable_prefix_caching=True),
                                 parallel_config=SimpleNamespace(data_parallel_rank=0))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="llmserve.distributed.kv_events"):
            pub = make_kv_event_publisher(config)
        pub.shutdown()
        assert ("use tcp://*:PORT" in caplog.text) == connects, caplog.text


def _router_block_keys(token_ids: list[int], block_size: int, lora_name=None) -> list[bytes]:
    """vllm-router's own key of each full block (src/kv_index/local_hash.rs, what its
    kv_aware index matches a request's tokens against): sha256 of the adapter's name, then
    each token id as 4 little-endian bytes; no chaining, no engine hash."""
    keys = []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.sha256(lora_name.encode() if lora_name else b"")
        for t in token_ids[i:i + block_size]:
            h.update(t.to_bytes(4, "little"))
        keys.append(h.digest())
    return keys


def test_events_give_a_router_the_request_block_keys_of_each_adapter():
    """A KV-aware router that keys blocks by their tokens and adapter (vllm-router's
    kv_aware) finds in a BlockStored exactly the keys it computes from the request's
    tokens: ``token_ids`` per ``block_size``, and ``lora_name`` for an adapter's blocks
    (it was always None, so an adapter's KV was indexed as the base model's). In the
    array layout lora_name is the seventh field (after ``medium``, as vLLM added it), and
    the six-field structs of vLLM's documented subscriber still decode the event."""
    import msgspec

    from llmserve.core.kv_cache_manager import KVCacheManager
    from llmserve.core.request import Request
    from llmserve.distributed.kv_events import as_tagged_map

    prompt = list(range(1000, 1000 + 2 * BLOCK + 5))
    m = KVCacheManager(num_blocks=20, block_size=BLOCK, enable_kv_cache_events=True)
    for rid, lora in (("base", None), ("sql", SimpleNamespace(lora_int_id=3, lora_name="sql-adapter"))):
        r = Request(rid, prompt, SamplingParams(max_tokens=1), eos_token_id=None)
        r.lora_request = lora
        m.allocate_slots(r, len(prompt))
        r.num_computed_tokens = len(prompt)
        m.cache_blocks(r, len(prompt))
    events = m.take_events()
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode([as_tagged_map(e) for e in events]))
    stored = {e["lora_name"]: e for e in wire if e["type"] == "BlockStored"}
    assert set(stored) == {None, "sql-adapter"}
    for name, ev in stored.items():
        assert len(ev["block_hashes"]) == 2 and ev["block_size"] == BLOCK and ev["group_idx"] == 0
        assert _router_block_keys(ev["token_ids"], ev["block_size"], ev["lora_name"]) == \
            _router_block_keys(prompt, BLOCK, name)
    assert stored[None]["lora_id"] is None and stored["sql-adapter"]["lora_id"] == 3
    assert stored[None]["block_hashes"] != stored["sql-adapter"]["block_hashes"]  # the engine keeps them apart
    assert not set(_router_block_keys(prompt, BLOCK)) & set(_router_block_keys(prompt, BLOCK, "sql-adapter"))
    arrays = [a for a in msgspec.msgpack.decode(msgspec.msgpack.encode(events)) if a[0] == "BlockStored"]
    assert [a[-1] for a in arrays] == [None, "sql-adapter"] and {len(a) for a in arrays} == {1 + 7}  # tag + fields
    decoded = msgspec.msgpack.Decoder(BlockStored).decode(msgspec.msgpack.encode(events[-1]))
    assert decoded.token_ids == prompt[:2 * BLOCK] and decoded.lora_id == 3


def _replayed(endpoint: str, want: int) -> list[tuple[int, list[str]]]:
    """(seq, event type names) of the batches a replay from 0 answers, once ``want`` have
    reached the publisher's buffer (its thread sends them first)."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    got: list = []
    try:
        for _ in range(100):
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            assert sock.poll(5000), "no replay answer"
            got = []
            while True:
                _, seq, payload = sock.recv_multipart()
                if not payload:
                    break
                ts, events, rank = msgspec.msgpack.decode(payload)
                got.append((int.from_bytes(seq, "big"), [e["type"] for e in events]))
            if len(got) >= want:
                return got
    finally:
        sock.close(linger=0)
        ctx.term()
    return got


def test_sequence_numbers_go_on_rising_in_the_next_engine_process(tmp_path):
    """Sleep level 2's wake-up and --restart-engine-on-failure start a fresh engine process
    with the same config: its publisher carries on the sequence (a subscriber saw it go
    back to 0 and dropped the batches) and first clears the ended process's blocks. An
    engine in its caller's process (no spawn: no sequence directory) counts from 0."""
    import pickle
    from types import SimpleNamespace

    from llmserve.config import KVEventsConfig
    from llmserve.core import kv_events as ev
    from llmserve.distributed.kv_event_seq import attach_seq_dir
    from llmserve.distributed.kv_events import make_kv_event_publisher

    kec = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/ev",
                         replay_endpoint=f"ipc://{tmp_path}/replay")

    def engine(cfg):  # the publisher an engine process makes from the config it was sent
        return make_kv_event_publisher(SimpleNamespace(
            kv_events_config=pickle.loads(pickle.dumps(cfg)), parallel_config=SimpleNamespace(data_parallel_rank=0),
            cache_config=SimpleNamespace(enable_prefix_caching=True)))

    stored = ev.BlockStored([7], None, list(range(16)), 16, None, "GPU")
    inproc = engine(kec)  # before any spawn: no directory
    inproc.publish(ev.KVEventBatch(1.0, [stored]))
    assert _replayed(inproc.replay_endpoint, 1) == [(0, ["BlockStored"])]
    inproc.shutdown()
    assert attach_seq_dir(kec) == attach_seq_dir(kec)  # the spawning process keeps one per config
    seqs = []
    for _ in range(2):  # an engine process, then the one started after it ended
        pub = engine(kec)
        try:
            for _ in range(2):
                pub.publish(ev.KVEventBatch(1.0, [stored]))
            seqs.append(_replayed(pub.replay_endpoint, 2 + len(seqs)))
        finally:
            pub.shutdown()
    assert seqs[0] == [(0, ["BlockStored"]), (1, ["BlockStored"])]
    assert seqs[1] == [(2, ["AllBlocksCleared"]), (3, ["BlockStored"]), (4, ["BlockStored"])]
