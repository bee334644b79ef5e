"""llmserve behind vLLM's router (PyPI ``vllm-router``, issue 35 item 5): the router's
cache-aware policy in front of two instances keeps each conversation's turns on one
instance, so the pair's prefix-cache hit rate on a multi-turn chat trace stays within 10%
of one instance's (slow); the metrics Kubernetes routers scrape are there with vLLM's
names. The make-test twin puts the router in front of the shared tiny server. The
kv_aware policy, given only the worker URLs, finds each instance's KV events through
/get_server_info and /kv_event_sources and sends a prompt to the instance whose cache
holds its prefix (slow; the make-test twin checks both routes on the shared server)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from llmserve.benchmarks.router_trace import (ROUTER_METRICS, free_port, multi_turn_trace, prefix_hit_rate, run_trace,
                                              scrape, start_router)
from tests.e2e.e2e_utils import API_KEY, RemoteServer

# The tiny model's context (512 tokens) holds four turns of this size.
TRACE = dict(context_words=50, turn_words=12)


def _stop(proc) -> None:
    proc.terminate()
    proc.wait(10)


def test_router_in_front_of_one_instance_answers_a_chat_and_sees_the_metrics(tiny_server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    router, url = start_router([tiny_server.url_root], "cache_aware")
    try:
        before = [scrape(tiny_server.url_root, auth)]
        stats = run_trace(url, "tiny", multi_turn_trace(2, 2, **TRACE), 2, 4, headers=auth)
        after = [scrape(tiny_server.url_root, auth)]
    finally:
        _stop(router)
    assert stats["requests"] == 4
    assert prefix_hit_rate(before, after) > 0  # the second turns found their first turn's blocks
    assert all(name in after[0] for name in ROUTER_METRICS), set(ROUTER_METRICS) - set(after[0])


def _tiny(tiny_model_dir) -> RemoteServer:
    return RemoteServer(["--model", tiny_model_dir, "--served-model-name", "tiny", "--dtype", "float32",
                         "--kv-cache-memory", "32MiB", "--num-threads", "1"], api_key=None)


@pytest.mark.slow
def test_pair_behind_cache_aware_router_keeps_the_prefix_cache_hit_rate(tiny_model_dir):
    trace = multi_turn_trace(8, 4, **TRACE)
    single = _tiny(tiny_model_dir)
    try:
        before = [scrape(single.url_root)]
        run_trace(single.url_root, "tiny", trace, 4, 8)
        single_rate = prefix_hit_rate(before, [scrape(single.url_root)])
    finally:
        single.stop()
    pair = [_tiny(tiny_model_dir) for _ in range(2)]
    router, url = start_router([s.url_root for s in pair], "cache_aware")
    try:
        before = [scrape(s.url_root) for s in pair]
        stats = run_trace(url, "tiny", trace, 8, 8)
        after = [scrape(s.url_root) for s in pair]
    finally:
        _stop(router)
        for s in pair:
            s.stop()
    assert stats["requests"] == 32
    served = [a["vllm:request_success_total"] - b["vllm:request_success_total"] for a, b in zip(after, before)]
    assert min(served) > 0, served  # both instances serve
    pair_rate = prefix_hit_rate(before, after)
    print(f"prefix-cache hit rate: single {single_rate:.3f}, pair {pair_rate:.3f}; requests per instance {served}")
    assert single_rate > 0.3 and pair_rate >= 0.9 * single_rate


def test_kv_aware_discovery_routes_answer_on_the_shared_server(tiny_server):
    """What vllm-router's kv_aware asks a worker first: without ``kv_block_size`` it
    indexes nothing; this server publishes no KV events, so no source."""
    info = tiny_server.http.get("/get_server_info").json()
    assert info["model_id"] == "tiny" and info["kv_block_size"] == info["effective_attention_block_size"] > 0
    assert tiny_server.http.get("/kv_event_sources").json() == {}


def _tiny_with_kv_events(tiny_model_dir) -> RemoteServer:
    # vLLM's flags alone: the default event layout is the tagged maps kv_aware decodes
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}",
              "replay_endpoint": f"tcp://*:{free_port()}", "topic": "kv"}
    return RemoteServer(["--model", tiny_model_dir, "--served-model-name", "tiny", "--dtype", "float32",
                         "--kv-cache-memory", "32MiB", "--num-threads", "1",
                         "--kv-events-config", json.dumps(events)], api_key=None)


@pytest.mark.slow
def test_kv_aware_router_sends_a_prefix_to_the_instance_that_cached_it(tiny_model_dir):
    """A prefix sent straight to the second instance, then four prompts sharing it sent
    through the router: all four go to that instance and find the prefix cached (before
    the discovery routes every lookup missed and requests went by load; with static
    --kv-event-source flags the topic "kv" made the router drop every batch)."""
    pair = [_tiny_with_kv_events(tiny_model_dir) for _ in range(2)]
    router, url = start_router([s.url_root for s in pair], "kv_aware")
    prefix = " ".join(f"Line {i}: the river runs past the old mill." for i in range(20))
    try:
        pair[1].http.post("/v1/completions", json={"model": "tiny", "prompt": prefix, "max_tokens": 1})
        time.sleep(1.0)  # the router indexes the events asynchronously
        before = [scrape(s.url_root) for s in pair]
        for i in range(4):
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": f"{prefix} Question {i}?",
                                                           "max_tokens": 1}, timeout=60)
            assert r.status_code == 200, r.text
        after = [scrape(s.url_root) for s in pair]
    finally:
        _stop(router)
        for s in pair:
            s.stop()
    served = [a["vllm:request_success_total"] - b["vllm:request_success_total"] for a, b in zip(after, before)]
    assert served == [0, 4], served
    assert prefix_hit_rate(before, after) > 0.5
