"""``GET /kv_event_sources`` and ``GET /get_server_info``: what vllm-router 0.1.17's
kv_aware policy asks each worker (only ``--worker-urls`` given) before it subscribes to
the KV events and routes by prefix. Its discovery skips, without a log line, an entry
that lacks a field or has another publisher / encoding / schema_version than zmq /
msgpack / 1, and indexes nothing without ``kv_block_size`` (checked against the router
by hand: README, Behind a router)."""
from __future__ import annotations

from types import SimpleNamespace

from test_app import app_and_engine  # noqa: F401 (fixture)

from llmserve.config import KVEventsConfig

ROUTER_FIELDS = {"endpoint", "replay_endpoint", "topic", "hwm", "buffer_steps", "publisher", "encoding",
                 "schema_version", "enable_kv_cache_events"}


def _config(dp=1, rank=0, external_lb=False, caching=True, **events):
    kec = KVEventsConfig(**{"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
                            "replay_endpoint": "tcp://*:5560", "topic": "kv", "event_layout": "map", **events})
    return SimpleNamespace(
        kv_events_config=kec, cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=caching),
        parallel_config=SimpleNamespace(data_parallel_size=dp, data_parallel_rank=rank,
                                        data_parallel_external_lb=external_lb, data_parallel_hybrid_lb=False))


def test_kv_event_sources_lists_each_served_rank_in_the_routers_shape(app_and_engine):  # noqa: F811
    client, engine = app_and_engine()
    engine.vllm_config = _config(dp=2)
    r = client.get("/kv_event_sources")
    assert r.status_code == 200
    sources = r.json()
    assert set(sources) == {"0", "1"} and all(set(e) == ROUTER_FIELDS for e in sources.values())
    assert sources["1"] == {"endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5561", "topic": "kv",
                            "hwm": 100_000, "buffer_steps": 10_000, "publisher": "zmq", "encoding": "msgpack",
                            "schema_version": 1, "enable_kv_cache_events": True}
    assert sources["0"]["endpoint"] == "tcp://*:5557"
    # external load balancing: this server fronts its own rank only
    engine.vllm_config = _config(dp=2, rank=1, external_lb=True)
    assert list(client.get("/kv_event_sources").json()) == ["1"]
    # the array layout is not the schema vllm-router decodes: listed under schema 0, which it skips
    engine.vllm_config = _config(event_layout="array")
    assert client.get("/kv_event_sources").json()["0"]["schema_version"] == 0


def test_kv_event_sources_empty_when_nothing_a_consumer_can_connect_to(app_and_engine):  # noqa: F811
    client, engine = app_and_engine()
    for config in (_config(enable_kv_cache_events=False), _config(publisher="null"), _config(caching=False),
                   _config(endpoint="tcp://collector:5557")):  # connected to: the collector binds it
        engine.vllm_config = config
        assert client.get("/kv_event_sources").json() == {}
    engine.vllm_config = None
    assert client.get("/kv_event_sources").json() == {}


def test_get_server_info_gives_the_cache_identity_and_block_size(app_and_engine):  # noqa: F811
    client, engine = app_and_engine("--api-key", "k")
    engine.vllm_config = _config()
    assert client.get("/get_server_info").status_code == 401  # the router sends its --api-key
    assert client.get("/kv_event_sources").status_code == 401
    info = client.get("/get_server_info", headers={"Authorization": "Bearer k"}).json()
    assert info == {"model_id": "m", "model_path": "m", "worker_type": "regular", "kv_block_size": 16,
                    "effective_attention_block_size": 16}
