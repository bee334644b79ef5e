"""`llmserve serve --data-parallel-size 2` (issue 14): both ranks serve (the official
client works unchanged), /metrics has one series per rank (engine label), and SIGKILL of
one rank fails the requests in flight (an error, not a hang), /health stops answering 200
and the server exits by itself (as vLLM's does when an engine dies), leaving no engine.
Issue 35: the X-data-parallel-rank header pins a request's rank (400 naming it when bad),
and each rank publishes its KV events on its own endpoint, stamped with its rank, which
/kv_event_sources lists per rank."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time

import httpx
import psutil
import pytest

from tests.e2e.e2e_utils import RemoteServer
from tests.kv_event_subscriber import BlockStored, Subscriber

# A DP=2 server (own servers, ~15 s); DP itself is tests/engine/test_data_parallel.py; `make test-all` runs it (make test keeps under 15 minutes)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kv_event_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dp-kv-events"))


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, kv_event_dir):
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{kv_event_dir}/ev",
              "replay_endpoint": f"ipc://{kv_event_dir}/replay"}
    srv = RemoteServer(["--model", tiny_model_dir, "--served-model-name", "tiny", "--dtype", "float32",
                        "--kv-cache-memory", "32MiB", "--data-parallel-size", "2",
                        "--kv-events-config", json.dumps(events)])
    yield srv
    srv.stop()


def _finished_by_rank(srv) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in srv.http.get("/metrics").text.splitlines():
        m = re.match(r'vllm:request_success_total\{.*engine="(\d+)".*\} (\S+)', line)
        if m:
            counts[m[1]] = counts.get(m[1], 0.0) + float(m[2])
    return counts


def _wait_finished(srv, want: dict[str, float]) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while (got := _finished_by_rank(srv)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_x_data_parallel_rank_header_pins_the_rank_and_each_rank_publishes_kv_events(dp_server, kv_event_dir):
    subs = [Subscriber(f"ipc://{kv_event_dir}/ev" + ("_dp1" if r else ""),
                       f"ipc://{kv_event_dir}/replay" + ("_dp1" if r else "")) for r in (0, 1)]
    client = dp_server.client(timeout=60)
    prompt = "the same long prompt " * 12  # several full KV blocks
    try:
        before = _finished_by_rank(dp_server)
        for rank, n in ((1, 3), (0, 1)):
            headers = {"X-data-parallel-rank": str(rank)}
            for i in range(n):
                client.completions.create(model="tiny", prompt=f"{prompt} {i}", max_tokens=2, extra_headers=headers)
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=2, extra_headers=headers)
            client.responses.create(model="tiny", input=prompt, max_output_tokens=2, extra_headers=headers)
        # a stream pinned to rank 1 and dropped by its client: its abort counts under rank 1 too
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True}, extra_headers={"X-data-parallel-rank": "1"})
        next(iter(stream))
        stream.close()
        want = dict(before)
        want["1"] = want.get("1", 0.0) + 6  # every pinned request ran on its rank, none elsewhere
        want["0"] = want.get("0", 0.0) + 3
        assert _wait_finished(dp_server, want) == want
        for bad in ("one", "2", "-1"):
            r = dp_server.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1},
                               headers={"X-data-parallel-rank": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "X-data-parallel-rank", r.text
        for rank, sub in enumerate(subs):
            sub.sync()
            assert sub.count(BlockStored) > 0
            assert {b.data_parallel_rank for b in sub.batches.values()} == {rank}
        # what a KV-aware router discovers: each rank's own endpoints (vllm-router's kv_aware)
        sources = dp_server.http.get("/kv_event_sources").json()
        assert {r: (e["endpoint"], e["replay_endpoint"]) for r, e in sources.items()} == {
            "0": (f"ipc://{kv_event_dir}/ev", f"ipc://{kv_event_dir}/replay"),
            "1": (f"ipc://{kv_event_dir}/ev_dp1", f"ipc://{kv_event_dir}/replay_dp1")}
    finally:
        for sub in subs:
            sub.close()


def _engine_pids(srv) -> list[int]:
    kids = psutil.Process(srv.proc.pid).children()
    return [p.pid for p in kids if "llmserve.engine.core" in " ".join(p.cmdline())]


def test_dp_server_serves_labels_metrics_and_fails_fast_on_a_dead_rank(dp_server):
    pids = _engine_pids(dp_server)
    assert len(pids) == 2
    client = dp_server.client(timeout=60)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: client.completions.create(
            model="tiny", prompt=f"hello {i}", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}),
            range(8)))
    assert [o.usage.completion_tokens for o in outs] == [4] * 8
    metrics = dp_server.http.get("/metrics").text
    engines = {line.split('engine="')[1][0] for line in metrics.splitlines()
               if line.startswith("vllm:num_requests_running{")}
    assert engines == {"0", "1"}

    def long(i):
        try:
            client.completions.create(model="tiny", prompt=f"story {i}", max_tokens=100,
                                      extra_body={"ignore_eos": True, "min_tokens": 100})
            return "ok"
        except Exception as e:  # the engine died under it: an HTTP error, not a hang
            return type(e).__name__

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(long, i) for i in range(4)]
        os.kill(pids[1], signal.SIGKILL)
        results = [f.result(timeout=60) for f in futs]
    assert set(results) <= {"ok", "InternalServerError", "APIError", "APIConnectionError"}
    try:
        assert dp_server.http.get("/health").status_code == 503
    except httpx.TransportError:  # already closing: refused or reset connection
        pass
    assert dp_server.proc.wait(60) is not None  # exits by itself: no SIGTERM from the test
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
