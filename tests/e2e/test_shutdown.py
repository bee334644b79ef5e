"""Stopping ``llmserve serve``: on SIGTERM/SIGINT the server ends its in-flight requests
(here aborted after ``--timeout-graceful-shutdown 1``: the stream gets a last chunk with
finish_reason "abort" and ``[DONE]``), shuts the engine process down and
exits 0, all within a few seconds; when the server is SIGKILLed, the engine process
notices (it watches its parent) and exits within about a second; when the engine
process dies, the requests in flight get their error, /health turns 503 and the server
exits by itself with code 1."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

from e2e_utils import MODEL, SERVE_CLI, RemoteServer

_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--timeout-graceful-shutdown", "1"]
# vLLM's behaviour on engine death (the server exits for a supervisor to restart it); with
# the default --restart-engine-on-failure the engine heals instead (tests/e2e/test_self_heal.py).
_NO_RESTART = _ARGS + ["--no-restart-engine-on-failure"]


def _engine_pid(server: RemoteServer) -> int:
    kids = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "llmserve.engine.core" in " ".join(p.cmdline())]
    assert len(kids) == 1, kids
    return kids[0].pid


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for a reaper counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(server: RemoteServer, engine_pid: int, t0: float, limit_s: float) -> tuple[float, float]:
    """Seconds from ``t0`` until the server, and the engine, were gone (inf: not within limit_s)."""
    server_t = engine_t = float("inf")
    while time.monotonic() - t0 < limit_s and (server_t == float("inf") or engine_t == float("inf")):
        if server_t == float("inf") and server.proc.poll() is not None:
            server_t = time.monotonic() - t0
        if engine_t == float("inf") and _gone(engine_pid):
            engine_t = time.monotonic() - t0
        time.sleep(0.05)
    return server_t, engine_t


def _start_stream(server: RemoteServer) -> tuple[threading.Thread, threading.Event, list, list]:
    """A long streaming completion in a thread; the event is set at its first chunk.
    Returns (thread, event, result, SSE lines received)."""
    first_chunk = threading.Event()
    result: list = []
    lines: list = []

    def run() -> None:
        body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 480, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", server.url_for("v1/completions"), json=body, timeout=60,
                              headers={"Authorization": f"Bearer {server.api_key}"}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first_chunk.set()
            result.append("finished")
        except httpx.HTTPError as e:  # cut off when the server aborts it
            result.append(type(e).__name__)
        first_chunk.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, first_chunk, result, lines


# SIGINT takes SIGTERM's path (one handler, launcher.serve_http): a `make test-all` run
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_stops_server_and_engine_promptly(sig):
    server = RemoteServer(_ARGS, entrypoint=SERVE_CLI)
    try:
        engine_pid = _engine_pid(server)
        thread, first_chunk, result, lines = _start_stream(server)
        assert first_chunk.wait(60), server.logs()
        t0 = time.monotonic()
        server.proc.send_signal(sig)
        server_t, engine_t = _wait_gone(server, engine_pid, t0, 15)
        thread.join(10)
        assert result == ["finished"], (result, server.logs())
        # Not cut off: the stream ends with a last chunk saying "abort", then [DONE].
        data = [ln for ln in lines if ln.startswith("data: ")]
        assert data[-1] == "data: [DONE]", data[-3:]
        assert '"finish_reason":"abort"' in data[-2].replace(" ", ""), data[-3:]
        assert "Exception in ASGI application" not in server.logs()
        # 1 s of grace for the stream, then the engine's shutdown and the server's exit.
        assert engine_t < 5 and server_t < 5, (engine_t, server_t, server.logs())
        assert server.proc.returncode == 0, server.logs()
        assert "Engine shut down." in server.logs()
    finally:
        server.stop()


@pytest.mark.slow  # the DP drain: the single-engine SIGTERM drain above is the make-test case; `make test-all`
def test_sigterm_to_the_process_group_drains_a_dp_server_and_exits_0():
    """``kill -TERM -PGID`` (a supervisor's stop-as-group, ``timeout``): the engines run in
    their own process group, so only the server gets it; its in-flight stream is drained
    (finishes on its token budget, not aborted, with --timeout-graceful-shutdown 30), the
    engines are stopped after it, and the exit code is 0 with no engine-death report."""
    import os

    server = RemoteServer(["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--data-parallel-size", "2",
                           "--timeout-graceful-shutdown", "30"], entrypoint=SERVE_CLI, new_session=True)
    try:
        engines = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                   if "llmserve.engine.core" in " ".join(p.cmdline())]
        assert len(engines) == 2 and all(os.getpgid(p.pid) != server.proc.pid for p in engines)
        body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 48, "ignore_eos": True}
        thread, result = _post_in_thread(server, body, "drained")
        # In flight: its first token observed (a fixed 0.5 s sleep could signal before a
        # loaded machine had even delivered the request).
        _wait_timeline_event(server, "drained", "first_token")
        os.killpg(server.proc.pid, signal.SIGTERM)
        thread.join(60)
        assert result and result[0].status_code == 200, (result, server.logs())
        assert result[0].json()["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0, server.logs()
        assert "EngineCore died" not in server.logs() and "the engine died" not in server.logs()
        deadline = time.monotonic() + 10
        while not all(_gone(p.pid) for p in engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p.pid) for p in engines)
    finally:
        server.stop()


@pytest.mark.slow  # the engine's parent-death watch; tests/engine/test_async_llm.py covers the engine side in process; `make test-all`
def test_sigkilled_server_takes_its_engine_along():
    server = RemoteServer(_ARGS, entrypoint=SERVE_CLI)
    try:
        engine_pid = _engine_pid(server)
        thread, first_chunk, _, _ = _start_stream(server)  # the engine is busy when its parent dies
        assert first_chunk.wait(60), server.logs()
        t0 = time.monotonic()
        server.proc.kill()
        _, engine_t = _wait_gone(server, engine_pid, t0, 10)
        thread.join(10)
        assert engine_t < 3, (engine_t, server.logs())
    finally:
        server.stop()


def _wait_timeline_event(server: RemoteServer, request_id: str, event: str, limit_s: float = 60) -> None:
    """Wait (up to ``limit_s``) until the request known by ``request_id`` (its X-Request-Id)
    shows ``event`` in its GET /v1/requests timeline: the request is observed in flight, not
    assumed to be after a fixed sleep."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        r = server.http.get(f"/v1/requests/{request_id}/timeline")
        if r.status_code == 200 and event in [e["event"] for e in r.json()["events"]]:
            return
        time.sleep(0.02)
    raise AssertionError(f"{request_id}: no {event!r} within {limit_s} s\n{server.logs()}")


def _post_in_thread(server: RemoteServer, body: dict, request_id: str = "") -> tuple[threading.Thread, list]:
    """A non-streaming completion in a thread (sent with ``request_id`` as its X-Request-Id
    when given); the list gets its httpx.Response (or the name of the httpx error)."""
    result: list = []
    headers = {"Authorization": f"Bearer {server.api_key}"}
    if request_id:
        headers["X-Request-Id"] = request_id

    def run() -> None:
        try:
            result.append(httpx.post(server.url_for("v1/completions"), json=body, timeout=30, headers=headers))
        except httpx.HTTPError as e:
            result.append(type(e).__name__)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_engine_death_fails_requests_and_exits_nonzero():
    """When the EngineCore process dies (SIGKILL here), the requests in flight get their
    error (a stream: an in-band EngineDeadError chunk and [DONE]; a plain request: 503
    with the OpenAI error body), requests that come right after get 503 or find the port
    closed, never a hang, and the server shuts itself down and exits non-zero within a
    few seconds, so that a supervisor restarts it (vLLM's behaviour)."""
    server = RemoteServer(_NO_RESTART, entrypoint=SERVE_CLI)
    try:
        engine_pid = _engine_pid(server)
        stream_thread, first_chunk, stream_result, lines = _start_stream(server)
        assert first_chunk.wait(60), server.logs()
        post_thread, post_result = _post_in_thread(
            server, {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 480, "ignore_eos": True},
            "plain")
        # The plain request in the engine: its first token observed (a fixed 0.3 s sleep could
        # kill the engine before a loaded machine had delivered it).
        _wait_timeline_event(server, "plain", "first_token")
        t0 = time.monotonic()
        psutil.Process(engine_pid).kill()
        # Right after: 503 while the server is still up, or a refused connection once it is down.
        try:
            late = httpx.post(server.url_for("v1/completions"), json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                              headers={"Authorization": f"Bearer {server.api_key}"}, timeout=10)
            late_status = late.status_code
        except httpx.ConnectError:
            late_status = "refused"
        assert late_status in (503, "refused"), (late_status, server.logs())
        server_t, engine_t = _wait_gone(server, engine_pid, t0, 15)
        stream_thread.join(10)
        post_thread.join(10)
        logs = server.logs()
        # (a) the in-flight requests got the error, not a hang or a cut connection
        assert stream_result == ["finished"], (stream_result, logs)
        data = [ln for ln in lines if ln.startswith("data: ")]
        assert data[-1] == "data: [DONE]", data[-3:]
        assert '"type":"EngineDeadError"' in data[-2].replace(" ", ""), data[-3:]
        assert len(post_result) == 1 and not isinstance(post_result[0], str), (post_result, logs)
        resp = post_result[0]
        assert resp.status_code == 503, (resp.status_code, resp.text)
        assert resp.json()["error"]["type"] == "EngineDeadError" and resp.json()["error"]["code"] == 503
        # (b) the server shut itself down and exited non-zero, soon
        assert engine_t < 2, (engine_t, logs)
        assert server_t < 8, (server_t, logs)
        assert server.proc.returncode == 1, (server.proc.returncode, logs)
        assert "shutting down the API server" in logs and "EngineCore died" in logs, logs
        assert "Engine shut down." in logs
    finally:
        server.stop()


@pytest.mark.slow  # the same exit path as test_engine_death_fails_requests_and_exits_nonzero, with no request; `make test-all`
def test_engine_death_while_idle_exits_nonzero(tiny_model_dir):
    """No request in flight: the death is still noticed (/health turns 503 or the port
    closes) and the server exits non-zero by itself. No request, so the tiny model (which
    starts in a fraction of the time) serves as well as the real one."""
    server = RemoteServer(_NO_RESTART + ["--model", tiny_model_dir], entrypoint=SERVE_CLI)
    try:
        engine_pid = _engine_pid(server)
        t0 = time.monotonic()
        psutil.Process(engine_pid).kill()
        health: list = []  # /health until the server is gone: 200 only before the death is noticed
        while server.proc.poll() is None and time.monotonic() - t0 < 15:
            try:
                health.append(httpx.get(server.url_for("health"), timeout=5).status_code)
            except httpx.HTTPError:
                health.append("refused")
            time.sleep(0.02)
        server_t, _ = _wait_gone(server, engine_pid, t0, 15)
        # Once the death shows (a 503, or the port already closed: the server may shut
        # down before a poll lands in the short 503 window, or even exit between two
        # polls), /health never says 200 again.
        first = next((i for i, h in enumerate(health) if h != 200), len(health))
        assert set(health[first:]) <= {503, "refused"}, health
        assert server_t < 8, (server_t, server.logs())
        assert server.proc.returncode == 1, (server.proc.returncode, server.logs())
        assert "shutting down the API server" in server.logs()
    finally:
        server.stop()
