"""Scale-out front ends (issue 14), on the tiny checkpoint:

* ``--data-parallel-external-lb``: two ``llmserve serve`` processes, ranks 0 and 1 of
  DP=2, each runs its own rank's engine (a DPAsyncMPClient), answers chat, and labels its
  /metrics ``engine="<rank>"`` (gauges refreshed from its engine by a utility call).
* ``--api-server-count 2``: two API servers on one port over one engine: many requests
  all answered, both processes served some (X-API-Server-Index), /metrics sums them (the
  same totals whichever process answers the scrape); SIGTERM (twice) to the launcher stops
  both API servers and the engine and removes the socket dir.
* ``--api-server-count 2 --data-parallel-size 2``: the launcher starts both engines; each
  API server balances over both; both servers and both engines serve some; SIGTERM stops all;
  SIGKILL of one engine makes everything exit with code 1.
"""
from __future__ import annotations

import collections
import concurrent.futures
import os
import re
import signal

import httpx
import psutil
import pytest

from tests.e2e.e2e_utils import SERVE_CLI, RemoteServer

# Two API servers over one engine (--api-server-count): own servers, ~12 s; `make test-all` runs it (make test keeps under 15 minutes)
pytestmark = pytest.mark.slow

TINY = ["--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory", "32MiB"]


def _metric(text: str, name: str, **labels: str) -> list[float]:
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


@pytest.fixture(scope="module")
def external_lb_pair(tiny_model_dir):
    servers = []
    try:
        for rank in (0, 1):
            servers.append(RemoteServer(["--model", tiny_model_dir, *TINY, "--data-parallel-size", "2",
                                         "--data-parallel-rank", str(rank), "--data-parallel-external-lb"],
                                        entrypoint=SERVE_CLI))
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.mark.slow  # two servers (~26 s); DP ranks per engine client: tests/engine/test_data_parallel.py; `make test-all`
def test_external_lb_each_server_owns_its_rank(external_lb_pair):
    for rank, srv in enumerate(external_lb_pair):
        kids = [p for p in psutil.Process(srv.proc.pid).children()
                if "llmserve.engine.core" in " ".join(p.cmdline())]
        assert len(kids) == 1  # its own rank's engine only
        chat = srv.client(timeout=60).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"hi rank {rank}"}], max_tokens=3,
            extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3
        metrics = srv.http.get("/metrics").text
        assert _metric(metrics, "vllm:request_success_total", engine=str(rank), finished_reason="length") == [1.0]
        assert {m for m in re.findall(r'engine="(\d+)"', metrics)} == {str(rank)}
        # a utility call reaches this rank's engine: the scrape refreshed the gauges from it
        assert _metric(metrics, "vllm:num_requests_running", engine=str(rank)) == [0.0]


@pytest.fixture(scope="module")
def two_api_servers(tiny_model_dir):
    srv = RemoteServer(["--model", tiny_model_dir, *TINY, "--api-server-count", "2"], entrypoint=SERVE_CLI)
    yield srv
    srv.stop()


def test_two_api_servers_share_the_engine_and_metrics(two_api_servers):
    srv = two_api_servers
    launcher = psutil.Process(srv.proc.pid)
    kids = launcher.children()
    api = [p for p in kids if "multi_api_server" in " ".join(p.cmdline())]
    engines = [p for p in kids if "llmserve.engine.core" in " ".join(p.cmdline())]
    assert len(api) == 2 and len(engines) == 1
    n = 40
    body = {"model": "tiny", "max_tokens": 3, "ignore_eos": True}

    def one(i: int) -> tuple[int, str, int]:
        # a fresh connection each: the kernel picks the accepting process
        r = httpx.post(srv.url_for("v1/chat/completions"), headers={"Authorization": f"Bearer {srv.api_key}"},
                       json={**body, "messages": [{"role": "user", "content": f"q{i}"}]}, timeout=120)
        return r.status_code, r.headers.get("x-api-server-index"), r.json()["usage"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(n)))
    assert [(s, t) for s, _, t in results] == [(200, 3)] * n
    # SO_REUSEPORT hashes each new connection to one of the two: both answer a fair share
    # (fewer than 5 of 40 on one side has probability ~1e-7)
    shares = collections.Counter(idx for _, idx, _ in results)
    assert set(shares) == {"0", "1"} and min(shares.values()) >= 5, shares
    for _ in range(4):  # every scrape, whichever process answers it, sums both
        metrics = srv.http.get("/metrics").text
        assert _metric(metrics, "vllm:request_success_total", finished_reason="length") == [float(n)]
        assert _metric(metrics, "vllm:generation_tokens_total") == [3.0 * n]
        assert _metric(metrics, "vllm:num_requests_running") == [0.0]

    # SIGTERM to the launcher: both API servers and the engine stop, the socket dir goes.
    pids = [p.pid for p in kids]
    with open(srv.log.name, errors="replace") as f:
        sock_dirs = set(re.findall(r"socket dir (\S+)", f.read()))
    srv.http.close()
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.send_signal(signal.SIGTERM)  # a second one (a supervisor's) does not cut the cleanup short
    assert srv.proc.wait(60) == 0
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert sock_dirs and not any(os.path.exists(d) for d in sock_dirs)


@pytest.mark.slow  # ~22 s; its halves run in make test: test_two_api_servers_share_the_engine_and_metrics, test_data_parallel_server.py
def test_two_api_servers_over_two_dp_engines(tiny_model_dir):
    """--api-server-count 2 --data-parallel-size 2: the launcher starts both engines, each
    API server balances over both (attached DPLBAsyncMPClient); SIGTERM stops everything."""
    srv = RemoteServer(["--model", tiny_model_dir, *TINY, "--api-server-count", "2", "--data-parallel-size", "2"],
                       entrypoint=SERVE_CLI)
    try:
        kids = psutil.Process(srv.proc.pid).children()
        api = [p for p in kids if "multi_api_server" in " ".join(p.cmdline())]
        engines = [p for p in kids if "llmserve.engine.core" in " ".join(p.cmdline())]
        assert len(api) == 2 and len(engines) == 2
        n = 24
        body = {"model": "tiny", "max_tokens": 4, "ignore_eos": True}

        def one(i: int) -> tuple[int, str, int]:
            r = httpx.post(srv.url_for("v1/chat/completions"), headers={"Authorization": f"Bearer {srv.api_key}"},
                           json={**body, "messages": [{"role": "user", "content": f"q{i}"}]}, timeout=120)
            return r.status_code, r.headers.get("x-api-server-index"), r.json()["usage"]["completion_tokens"]

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, range(n)))
        assert [(s, t) for s, _, t in results] == [(200, 4)] * n
        shares = collections.Counter(idx for _, idx, _ in results)  # SO_REUSEPORT: both get some
        assert set(shares) == {"0", "1"}, shares
        metrics = srv.http.get("/metrics").text
        served = {e: sum(_metric(metrics, "vllm:request_success_total", engine=e)) for e in ("0", "1")}
        assert all(served.values()), served  # both engines served some
        assert sum(served.values()) == n

        pids = [p.pid for p in kids]
        with open(srv.log.name, errors="replace") as f:
            sock_dirs = set(re.findall(r"socket dir (\S+)", f.read()))
        srv.http.close()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert sock_dirs and not any(os.path.exists(d) for d in sock_dirs)
    finally:
        srv.stop()


@pytest.mark.slow  # a dead DP rank: test_data_parallel_server.py (fails fast) and test_shutdown.py (exit code) cover it; `make test-all`
def test_two_api_servers_over_two_dp_engines_exit_when_an_engine_dies(tiny_model_dir):
    """SIGKILL of one of the two DP engines: both API servers and the launcher exit with
    code 1, the other engine stops, the socket dir is removed."""
    srv = RemoteServer(["--model", tiny_model_dir, *TINY, "--api-server-count", "2", "--data-parallel-size", "2"],
                       entrypoint=SERVE_CLI)
    try:
        kids = psutil.Process(srv.proc.pid).children()
        engines = [p for p in kids if "llmserve.engine.core" in " ".join(p.cmdline())]
        assert len(engines) == 2
        with open(srv.log.name, errors="replace") as f:
            sock_dirs = set(re.findall(r"socket dir (\S+)", f.read()))
        srv.http.close()
        engines[1].send_signal(signal.SIGKILL)
        assert srv.proc.wait(60) == 1
        assert not [p.pid for p in kids if psutil.pid_exists(p.pid) and p.status() != psutil.STATUS_ZOMBIE]
        assert sock_dirs and not any(os.path.exists(d) for d in sock_dirs)
    finally:
        srv.stop()
