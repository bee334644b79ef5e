"""Issue 26 item 2 against the shared ``server`` (it has an API key): every operation of
the real server's /openapi.json refuses a request without the key (401) unless its path
is on the public list, ``/invocations`` included (it served chat and completions to
anyone), and the key works as ``x-api-key`` as well as ``Authorization: Bearer``; a 405
lists every method of its path."""
from __future__ import annotations

import re

import httpx

from e2e_utils import MODEL

from llmserve.entrypoints.openai.server_utils import PUBLIC_PATHS

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2, "temperature": 0}


def test_every_documented_operation_needs_the_key_unless_public(server):
    doc = server.http.get("/openapi.json").json()
    anonymous = httpx.Client(base_url=server.url_root, timeout=60)
    unprotected, checked = [], 0
    for path, item in doc["paths"].items():
        for method in item:
            r = anonymous.request(method.upper(), re.sub(r"\{[^}]+\}", "x", path), json={})
            checked += 1
            if path in PUBLIC_PATHS:
                assert r.status_code != 401, (method, path)
            elif r.status_code != 401:
                unprotected.append(f"{method.upper()} {path} -> {r.status_code}")
    assert checked >= 30 and not unprotected, unprotected
    anonymous.close()


def test_invocations_needs_the_key_and_takes_it_as_x_api_key(server):
    url = server.url_for("invocations")
    r = httpx.post(url, json=CHAT, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.post(url, json=CHAT, headers={"x-api-key": "wrong"}, timeout=60).status_code == 401
    ok = httpx.post(url, json=CHAT, headers={"x-api-key": server.api_key}, timeout=120)
    assert ok.status_code == 200 and ok.json()["object"] == "chat.completion", ok.text
    assert server.post("/invocations", CHAT).status_code == 200  # Bearer
    assert httpx.get(server.url_for("ping"), timeout=60).status_code == 200  # the probes stay open


def test_405_allow_names_delete_too(server):
    r = server.http.put("/v1/responses/resp_x")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers
