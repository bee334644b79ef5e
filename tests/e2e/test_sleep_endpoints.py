"""vLLM's sleep-mode dev endpoints on the shared ``tiny_server`` (--enable-sleep-mode,
VLLM_SERVER_DEV_MODE=1): POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping;
/health and /metrics answer without waking the engine; the next completion wakes it and
its greedy text is the same as before the sleep; bad level/tags are 400s; the routes need
the API key like every engine route."""
from __future__ import annotations

import httpx
import pytest

GREEDY = dict(model="tiny", prompt="The sleepy cat", max_tokens=6, temperature=0.0,
              extra_body={"ignore_eos": True})


def _asleep(srv) -> bool:
    r = srv.http.get("/is_sleeping")
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_request_wakes(tiny_server, level):
    client = tiny_server.client()
    before = client.completions.create(**GREEDY).choices[0].text
    assert not _asleep(tiny_server)
    assert tiny_server.http.post(f"/sleep?level={level}").status_code == 200
    assert _asleep(tiny_server)
    assert tiny_server.http.get("/health").status_code == 200
    assert tiny_server.http.get("/metrics").status_code == 200
    assert _asleep(tiny_server)  # neither woke it
    after = client.completions.create(**GREEDY).choices[0].text
    assert after == before and len(after) > 0
    assert not _asleep(tiny_server)


def test_wake_up_endpoint_and_bad_input(tiny_server):
    http = tiny_server.http
    assert http.post("/sleep").status_code == 200  # level 1 by default
    assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert _asleep(tiny_server)  # the KV cache still sleeps
    assert http.post("/wake_up", params=[("tags", "kv_cache")]).status_code == 200
    assert not _asleep(tiny_server)
    for path, param in (("/sleep?level=3", "level"), ("/sleep?level=deep", "level"),
                        ("/wake_up?tags=activations", "tags")):
        r = http.post(path)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["code"] == 400 and r.json()["error"]["param"] == param
    assert httpx.post(tiny_server.url_for("sleep")).status_code == 401  # no API key
    assert not _asleep(tiny_server)
