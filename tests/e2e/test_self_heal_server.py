"""``llmserve serve`` heals its engine (``--restart-engine-on-failure``, on by default):
a SIGKILL of the EngineCore under streaming chat and completion requests from the
official openai client restarts it in place; every stream completes with exactly the text
of an undisturbed greedy run (no duplicated or missing token), the server never exits,
``/metrics`` counts the restart, and later requests are served. A restart budget of 0
gives up at once: the server exits non-zero as without the flag."""
from __future__ import annotations

import pytest
import re
import threading
import time

import psutil

from e2e_utils import MODEL, SERVE_CLI, RemoteServer

_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "128MiB",
         "--timeout-graceful-shutdown", "1"]


def _engine_pid(server: RemoteServer) -> int:
    kids = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "llmserve.engine.core" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE]
    assert len(kids) == 1, kids
    return kids[0].pid


def _run_streams(server: RemoteServer, progress: list[int]) -> list[tuple[str, list[str], str]]:
    """Two chat and two completion streams (greedy, 48 tokens each), in threads; returns
    per stream (text, chunks' texts, finish_reason). ``progress[i]``: chunks so far."""
    client = server.client()
    results: list = [None] * 4

    def chat(i: int) -> None:
        parts, finish = [], None
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me a story about a {['cat', 'ship'][i]}."}],
            max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
                progress[i] += 1
        results[i] = ("".join(parts), parts, finish)

    def completion(i: int) -> None:
        parts, finish = [], None
        stream = client.completions.create(model=MODEL, prompt=["The history of Rome", "Water boils at"][i - 2],
                                           max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                progress[i] += 1
        results[i] = ("".join(parts), parts, finish)

    threads = [threading.Thread(target=chat if i < 2 else completion, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    return threads, results


def _restarts(server: RemoteServer) -> float:
    text = server.http.get("/metrics").text
    m = re.search(r"^vllm:engine_restarts_total\{[^}]*\} ([0-9.]+)$", text, re.M)
    assert m, text[-2000:]
    return float(m.group(1))


@pytest.mark.slow  # tests/engine/test_self_heal.py::test_sigkill_during_streams_resumes_identically covers it in process; `make test-all`
def test_sigkill_under_streams_heals_with_identical_text():
    server = RemoteServer(_ARGS, entrypoint=SERVE_CLI)
    try:
        progress = [0] * 4
        threads, ref = _run_streams(server, progress)
        for t in threads:
            t.join(240)
        assert _restarts(server) == 0
        progress = [0] * 4
        threads, got = _run_streams(server, progress)
        t_end = time.monotonic() + 120
        while min(progress) < 6 and time.monotonic() < t_end:
            time.sleep(0.01)
        old_pid = _engine_pid(server)
        psutil.Process(old_pid).kill()
        for t in threads:
            t.join(240)
        assert server.proc.poll() is None, server.logs()
        for r, g in zip(ref, got):
            assert g is not None and g[0] == r[0] and g[2] == r[2] == "length", (r, g, server.logs())
        assert _restarts(server) == 1
        assert _engine_pid(server) != old_pid
        server.assert_healthy()
        assert "EngineCore restarted" in server.logs()
    finally:
        server.stop()


@pytest.mark.slow  # tests/engine/test_self_heal.py::test_restart_loop_gives_up covers the budget in process; `make test-all`
def test_restart_budget_spent_exits_nonzero():
    server = RemoteServer(_ARGS + ["--max-engine-restarts", "0"], entrypoint=SERVE_CLI)
    try:
        psutil.Process(_engine_pid(server)).kill()
        server.proc.wait(60)
        assert server.proc.returncode == 1, server.logs()
        assert "giving up" in server.logs()
    finally:
        server.stop()
