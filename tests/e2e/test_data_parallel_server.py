"""`llmserve serve --data-parallel-size 2` (issue 14): both ranks serve (the official
client works unchanged), /metrics has one series per rank (engine label), and SIGKILL of
one rank fails the requests in flight (an error, not a hang), /health stops answering 200
and the server exits by itself (as vLLM's does when an engine dies), leaving no engine."""
from __future__ import annotations

import concurrent.futures
import os
import signal

import httpx
import psutil
import pytest

from tests.e2e.e2e_utils import RemoteServer


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir):
    srv = RemoteServer(["--model", tiny_model_dir, "--served-model-name", "tiny", "--dtype", "float32",
                        "--kv-cache-memory", "32MiB", "--data-parallel-size", "2"])
    yield srv
    srv.stop()


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
