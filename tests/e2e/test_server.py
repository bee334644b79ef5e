"""Server-level behaviour on the real server: /v1/models (C33), /tokenize and /detokenize,
/health, /version, /metrics, X-Request-Id, CORS, and client disconnects aborting their
requests (no running request and no used KV block left, seen on /metrics)."""
from __future__ import annotations

import json
import re
import socket
import time

import httpx

from e2e_utils import MODEL


def metric(text: str, name: str, **labels: str) -> float:
    """Value of one sample in the Prometheus text (labels must all match)."""
    total = None
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        m = re.match(r"^(\S+?)(\{.*\})?\s+(\S+)$", line)
        if m.group(1) != name:
            continue
        if all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total = (total or 0.0) + float(m.group(3))
    assert total is not None, f"{name} {labels} not in /metrics"
    return total


def scrape(server) -> str:
    r = httpx.get(server.url_for("metrics"), timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def test_models_endpoint_c33(server):
    r = server.http.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and len(body["data"]) >= 1
    now = time.time()
    for m in body["data"]:
        assert isinstance(m["id"], str) and m["id"] and m["object"] == "model"
        assert isinstance(m["created"], int) and 1.6e9 < m["created"] <= now + 60
        assert isinstance(m["owned_by"], str)
    m0 = body["data"][0]
    assert m0["id"] == MODEL
    assert isinstance(m0["max_model_len"], int) and m0["max_model_len"] == server.tok("hi")["max_model_len"] > 0
    chat = server.post("/v1/chat/completions", {"model": m0["id"], "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == m0["id"]
    listed = server.client().models.list()
    assert [m.id for m in listed.data] == [m["id"] for m in body["data"]]


def test_tokenize_and_detokenize(server):
    t = server.tok("Hello world")
    assert t["tokens"] == [19556, 905] and t["count"] == 2 and t["max_model_len"] == 2048
    d = server.post("/detokenize", {"model": MODEL, "tokens": t["tokens"]}).json()
    assert d == {"prompt": "Hello world", "content": "Hello world"}  # vLLM's key and llama-server's
    strs = server.post("/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["Hello", " world"]
    # /tokenize only counts: no context limit (C13 A5 on the default server)
    long = server.tok("hello " * 2100)
    assert long["count"] > long["max_model_len"]
    assert server.post("/detokenize", {"model": MODEL, "tokens": [49152]}).status_code == 400
    both = server.post("/tokenize", {"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "a"}]})
    assert both.status_code == 400


def test_health_version_request_id_cors(server):
    assert httpx.get(server.url_for("health")).status_code == 200
    v = httpx.get(server.url_for("version")).json()
    assert isinstance(v["version"], str) and v["version"]
    r = server.http.get("/v1/models", headers={"X-Request-Id": "my-req-42"})
    assert r.headers["x-request-id"] == "my-req-42"
    # the same X-Request-Id on two concurrent requests: both are served
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: server.post("/v1/completions", body, headers={"X-Request-Id": "same"}), range(2)))
    assert [o.status_code for o in outs] == [200, 200] and all(o.json()["id"] == "cmpl-same" for o in outs)
    generated = server.http.get("/v1/models").headers["x-request-id"]
    assert generated and generated != "my-req-42"
    pre = httpx.options(server.url_for("v1/chat/completions"), headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", "http://example.com")


def test_metrics_count_requests_and_tokens(server):
    before = scrape(server)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3,
                                        "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200
    after = scrape(server)
    lab = {"model_name": MODEL}
    assert metric(after, "vllm:request_success_total", finished_reason="length", **lab) == \
        metric(before, "vllm:request_success_total", finished_reason="length", **lab) + 1
    assert metric(after, "vllm:generation_tokens_total", **lab) - \
        metric(before, "vllm:generation_tokens_total", **lab) == 3
    assert metric(after, "vllm:prompt_tokens_total", **lab) - metric(before, "vllm:prompt_tokens_total",
                                                                          **lab) == r.json()["usage"]["prompt_tokens"]
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds",
                 "time_per_output_token_seconds"):
        assert metric(after, f"vllm:{hist}_count", **lab) > metric(before, f"vllm:{hist}_count", **lab)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(after, f"vllm:{gauge}", **lab) == 0


def _wait_idle(server, timeout: float = 60.0) -> str:
    deadline = time.time() + timeout
    while True:
        text = scrape(server)
        idle = (metric(text, "vllm:num_requests_running") == 0
                and metric(text, "vllm:num_requests_waiting") == 0
                and metric(text, "vllm:kv_cache_usage_perc") == 0)
        if idle or time.time() > deadline:
            return text
        time.sleep(0.2)


def _raw_post(server, path: str, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_client_disconnect_aborts_request(server):
    """Must show: a client that disconnects mid-stream leaves no running request and no
    used KV block; the same for a non-streaming request whose client goes away."""
    lab = {"model_name": MODEL}
    aborts0 = metric(scrape(server), "vllm:request_success_total", finished_reason="abort", **lab)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    sock = _raw_post(server, "/v1/chat/completions", body)
    received = b""
    while received.count(b"data: ") < 4:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    assert b" 200 OK" in received.split(b"\r\n", 1)[0]
    mid = scrape(server)
    assert metric(mid, "vllm:num_requests_running", **lab) >= 1 or \
        metric(mid, "vllm:num_requests_waiting", **lab) >= 1
    sock.close()
    text = _wait_idle(server)
    assert metric(text, "vllm:num_requests_running", **lab) == 0
    assert metric(text, "vllm:kv_cache_usage_perc", **lab) == 0
    gen1 = metric(text, "vllm:generation_tokens_total", **lab)
    time.sleep(1.0)
    assert metric(scrape(server), "vllm:generation_tokens_total", **lab) == gen1  # nothing still generating
    # non-streaming: the client gives up before the answer
    sock = _raw_post(server, "/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 1500,
                                                 "ignore_eos": True})
    deadline = time.time() + 30
    while time.time() < deadline:
        t = scrape(server)
        if metric(t, "vllm:num_requests_running", **lab) >= 1:
            break
        time.sleep(0.1)
    sock.close()
    text = _wait_idle(server)
    assert metric(text, "vllm:num_requests_running", **lab) == 0
    assert metric(text, "vllm:kv_cache_usage_perc", **lab) == 0
    # both disconnects are counted as finished with reason "abort"
    assert metric(text, "vllm:request_success_total", finished_reason="abort", **lab) == aborts0 + 2
    server.assert_healthy()
