"""vLLM's sleep-mode dev endpoints on the shared ``tiny_server`` (--enable-sleep-mode,
VLLM_SERVER_DEV_MODE=1): POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping;
/health and /metrics answer without waking the engine; the next completion wakes it and
its greedy text is the same as before the sleep; level 1 keeps the engine process, level
2 ends it (llmserve/engine/sleep_process.py) and the wake starts a new one; bad
level/tags are 400s; the routes need the API key like every engine route."""
from __future__ import annotations

import httpx
import psutil
import pytest

GREEDY = dict(model="tiny", prompt="The sleepy cat", max_tokens=6, temperature=0.0,
              extra_body={"ignore_eos": True})


def _asleep(srv) -> bool:
    r = srv.http.get("/is_sleeping")
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


def _engine_pids(srv) -> set[int]:
    """The server's engine processes (its descendants running llmserve.engine.core)."""
    pids = set()
    for p in psutil.Process(srv.proc.pid).children(recursive=True):
        try:
            if "llmserve.engine.core" in " ".join(p.cmdline()):
                pids.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_request_wakes(tiny_server, level):
    client = tiny_server.client()
    before = client.completions.create(**GREEDY).choices[0].text
    assert not _asleep(tiny_server)
    engines = _engine_pids(tiny_server)
    assert len(engines) == 1
    assert tiny_server.http.post(f"/sleep?level={level}").status_code == 200
    assert _asleep(tiny_server)
    assert _engine_pids(tiny_server) == (engines if level == 1 else set())  # level 2: the process ended
    assert tiny_server.http.get("/health").status_code == 200
    assert tiny_server.http.get("/metrics").status_code == 200
    assert _asleep(tiny_server)  # neither woke it
    assert tiny_server.http.post(f"/sleep?level={level}").status_code == 200  # asleep already: a no-op
    after = client.completions.create(**GREEDY).choices[0].text
    assert after == before and len(after) > 0
    assert not _asleep(tiny_server)
    woken = _engine_pids(tiny_server)
    assert len(woken) == 1 and (woken == engines) == (level == 1)


def test_wake_up_endpoint_starts_an_ended_engine(tiny_server):
    """POST /wake_up after a level-2 sleep starts the engine (any tags: it starts whole)."""
    http = tiny_server.http
    before = tiny_server.client().completions.create(**GREEDY).choices[0].text
    assert http.post("/sleep?level=2").status_code == 200
    assert _engine_pids(tiny_server) == set()
    assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert not _asleep(tiny_server) and len(_engine_pids(tiny_server)) == 1
    assert tiny_server.client().completions.create(**GREEDY).choices[0].text == before


def test_wake_up_endpoint_and_bad_input(tiny_server):
    http = tiny_server.http
    assert http.post("/sleep").status_code == 200  # level 1 by default
    assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert _asleep(tiny_server)  # the KV cache still sleeps
    assert http.post("/wake_up", params=[("tags", "kv_cache")]).status_code == 200
    assert not _asleep(tiny_server)
    for path, param in (("/sleep?level=3", "level"), ("/sleep?level=deepXQ", "level"),
                        ("/wake_up?tags=activationsXQ", "tags")):
        r = http.post(path)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["code"] == 400 and r.json()["error"]["param"] == param
        assert "XQ" not in r.text  # the client's value is not echoed
    assert httpx.post(tiny_server.url_for("sleep")).status_code == 401  # no API key
    assert not _asleep(tiny_server)


@pytest.mark.slow  # ~13 s (a failed wake, then the model reloaded); sleep/wake levels: the other tests here; `make test-all`
def test_failed_start_after_level_2_is_503_until_the_model_is_back(tiny_server, tiny_model_dir):
    """An ended engine whose model is gone cannot start: every route answers 503 with
    Retry-After, in its API's error shape, naming the cause; /health and /ready answer 503
    meanwhile; once the model is back the next /wake_up starts it and all is 200 again."""
    import os

    http = tiny_server.http
    moved = tiny_model_dir + ".moved"
    assert http.post("/sleep?level=2").status_code == 200
    os.rename(tiny_model_dir, moved)
    try:
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503, chat.text
        assert chat.headers["Retry-After"] == "10"
        err = chat.json()["error"]
        assert err["type"] == "EngineStartError" and err["code"] == 503
        assert "could not be started again after sleep level 2" in err["message"], err
        ollama = http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False})
        assert ollama.status_code == 503 and "sleep level 2" in ollama.json()["error"], ollama.text
        anthropic = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        assert anthropic.status_code == 503, anthropic.text
        assert anthropic.json()["type"] == "error" and "sleep level 2" in anthropic.json()["error"]["message"]
        wake = http.post("/wake_up")
        assert wake.status_code == 503 and wake.headers["Retry-After"] == "10", wake.text
        for probe in ("/health", "/ready"):
            r = http.get(probe)
            assert r.status_code == 503 and r.headers["Retry-After"] == "10", (probe, r.text)
            assert "sleep level 2" in r.json()["error"]["message"], (probe, r.text)
        assert _engine_pids(tiny_server) == set()
    finally:
        os.rename(moved, tiny_model_dir)
    assert http.post("/wake_up").status_code == 200
    assert http.get("/health").status_code == 200 and http.get("/ready").status_code == 200
    assert len(tiny_server.client().completions.create(**GREEDY).choices[0].text) > 0


def _prefix_hits(srv) -> float:
    """vllm:prefix_cache_hits_total (prompt tokens found cached), summed over its labels."""
    import re
    text = srv.http.get("/metrics").text
    return sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))


def test_reset_prefix_cache_dev_endpoint(tiny_server):
    """vLLM's dev-mode POST /reset_prefix_cache (a trial found it 404): the next identical
    prompt finds no cached tokens."""
    client = tiny_server.client()
    prompt = "The sleepy cat sat on the warm mat by the door and purred for a while " * 3
    kw = dict(model="tiny", prompt=prompt, max_tokens=1, temperature=0.0)
    client.completions.create(**kw)
    hits = _prefix_hits(tiny_server)
    client.completions.create(**kw)
    assert _prefix_hits(tiny_server) > hits  # cached
    r = tiny_server.http.post("/reset_prefix_cache")
    assert r.status_code == 200, r.text
    hits = _prefix_hits(tiny_server)
    client.completions.create(**kw)
    assert _prefix_hits(tiny_server) == hits  # forgotten
