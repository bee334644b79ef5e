"""Context-length handling on a server with ``--max-model-len 512`` and a KV cache that
cannot hold 8 full-length sequences at once (cases C12, C13), then a graceful SIGTERM."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import ollama
import psutil

from e2e_utils import MODEL, no_nonfinite

MAXLEN = 512


def _err(r, status=400):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = no_nonfinite(r.text)["error"]
    assert err["message"] and err["code"] == status
    return err


def test_max_tokens_vs_context_c12(server_512):
    s = server_512
    assert s.model_id() == MODEL and s.tok("Hi")["max_model_len"] == MAXLEN
    x1 = _err(s.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": MAXLEN + 100}))
    assert str(MAXLEN) in x1["message"] and str(MAXLEN + 100) in x1["message"]
    s.assert_healthy()
    n_hi = s.tok("Hi")["count"]
    x2 = {"model": MODEL, "prompt": "Hi", "max_tokens": MAXLEN - n_hi, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:  # X2 and X3 side by side (two sequences fit in the cache)
        f3 = pool.submit(s.post, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}, timeout=900)
        r2 = s.post("/v1/completions", x2, timeout=900).json()
        r3 = f3.result()
    assert r2["choices"][0]["finish_reason"] == "length"
    assert r2["usage"]["completion_tokens"] == MAXLEN - r2["usage"]["prompt_tokens"]
    s.assert_healthy()
    assert r3.status_code == 200, r3.text
    u3 = r3.json()["usage"]
    assert u3["prompt_tokens"] + u3["completion_tokens"] == MAXLEN
    assert r3.json()["choices"][0]["finish_reason"] == "length"
    s.assert_healthy()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: s.post("/v1/completions", x2, timeout=1200), range(8)))
    for r in outs:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"] == r2["usage"] and body["choices"][0]["finish_reason"] == "length"
    s.assert_healthy()
    x5 = s.post("/v1/completions", {"model": MODEL, "prompt": "Hi"})
    assert x5.status_code == 200 and x5.json()["usage"]["completion_tokens"] <= 16
    s.assert_healthy()


def test_prompt_too_long_c13(server_512):
    s = server_512
    long = "hello " * (MAXLEN + 50)
    n_long = s.tok(long)["count"]
    n_chat = s.post("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": long}]}).json()["count"]
    for path, body, count in (
            ("/v1/completions", {"prompt": long, "max_tokens": 5}, n_long),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}], "max_tokens": 5}, n_chat),
            ("/v1/responses", {"input": long, "max_output_tokens": 5}, None)):
        err = _err(s.post(path, {"model": MODEL, **body}))
        assert str(MAXLEN) in err["message"]
        if count is not None:
            assert str(count) in err["message"]
        assert not re.search(r"-\d", err["message"]), err["message"]
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": long}))
    with s.http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": long, "max_tokens": 5,
                                                          "stream": True}) as r:
        r.read()
    _err(r)
    h = s.tok("hello")["tokens"][0]
    ok = s.post("/v1/completions", {"model": MODEL, "prompt": [h] * (MAXLEN - 1), "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    _err(s.post("/v1/completions", {"model": MODEL, "prompt": [h] * MAXLEN, "max_tokens": 1}))
    assert n_long > MAXLEN
    s.assert_healthy()


def test_ollama_over_long_prompts_are_shortened_unless_truncate_false(server_512):
    """Ollama's routes answer a prompt longer than the context as Ollama does (``truncate``
    defaults to true): /api/chat drops the oldest whole turns (system and the current turn
    stay; a tool round trip keeps its call), /api/generate keeps the last half context of
    tokens (templated and raw); ``truncate: false`` is Ollama's 400 instead."""
    s = server_512
    words = "apple " * 150
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(4):
        msgs += [{"role": "user", "content": f"{i} {words}"}, {"role": "assistant", "content": f"{i} {words}"}]
    msgs.append({"role": "user", "content": "Say yes."})
    opts = {"temperature": 0, "num_predict": 4}
    chat = s.post("/api/chat", {"model": MODEL, "messages": msgs, "stream": False, "options": opts})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["done"] and 0 < body["prompt_eval_count"] < MAXLEN and body["eval_count"] >= 1, body
    refused = s.post("/api/chat", {"model": MODEL, "messages": msgs, "stream": False, "truncate": False})
    assert refused.status_code == 400 and set(refused.json()) == {"error"}, refused.text
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    trip = msgs[:-1] + [{"role": "user", "content": "Weather in Paris?"}, call,
                        {"role": "tool", "content": "Sunny, 21 C."}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    tool = s.post("/api/chat", {"model": MODEL, "messages": trip, "tools": tools, "stream": False, "options": opts})
    assert tool.status_code == 200 and tool.json()["prompt_eval_count"] < MAXLEN, tool.text
    long = "apple " * (2 * MAXLEN)
    for extra in ({}, {"raw": True}):
        gen = s.post("/api/generate", {"model": MODEL, "prompt": long, "stream": False, "options": opts, **extra})
        assert gen.status_code == 200, gen.text
        assert 0 < gen.json()["prompt_eval_count"] <= MAXLEN // 2 and gen.json()["done"], gen.json()
        refused = s.post("/api/generate", {"model": MODEL, "prompt": long, "truncate": False, **extra})
        assert refused.status_code == 400 and set(refused.json()) == {"error"}, refused.text
    with s.http.stream("POST", "/api/chat", json={"model": MODEL, "messages": msgs, "options": opts}) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert r.status_code == 200 and lines[-1]["done"] and "error" not in lines[-1], lines[-1]
    s.assert_healthy()


def test_ollama_num_ctx_is_the_context_of_the_request(server_512):
    """``options.num_ctx`` is the request's context, as in Ollama, capped by the server's:
    the answer stops where prompt + answer fill it (``done_reason`` "length", with or
    without ``num_predict``), an over-long chat drops its oldest turns to fit it and
    ``truncate: false`` is a 400 naming it; below 4 it is 4 (Ollama's scheduler), above
    the server's context the server's; not an integer, a 400 naming it."""
    s = server_512
    client = ollama.Client(host=s.url_root, headers={"Authorization": f"Bearer {s.api_key}"}, timeout=300)
    count = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
    ctx = s.tok(count)["count"] + 3
    raw = client.generate(MODEL, prompt=count, raw=True, options={"num_ctx": ctx, "num_predict": 50, "temperature": 0})
    assert raw.prompt_eval_count + raw.eval_count == ctx and raw.done_reason == "length", raw
    ask = [{"role": "user", "content": "Count from 1 to 50, separated by commas."}]
    ctx = s.post("/tokenize", {"model": MODEL, "messages": ask, "add_generation_prompt": True}).json()["count"] + 3
    chat = client.chat(MODEL, messages=ask, options={"num_ctx": ctx, "temperature": 0})  # no num_predict
    assert chat.prompt_eval_count + chat.eval_count == ctx and chat.done_reason == "length", chat
    words = "apple " * 30
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(3):
        msgs += [{"role": "user", "content": f"{i} {words}"}, {"role": "assistant", "content": f"{i} {words}"}]
    msgs.append({"role": "user", "content": "Say yes."})
    opts = {"num_ctx": 96, "num_predict": 2, "temperature": 0}
    fitted = client.chat(MODEL, messages=msgs, options=opts)
    assert 0 < fitted.prompt_eval_count < 96 and fitted.done, fitted
    refused = s.post("/api/chat", {"model": MODEL, "messages": msgs, "options": opts, "truncate": False})
    assert refused.status_code == 400 and "options.num_ctx" in refused.json()["error"], refused.text
    tiny = client.generate(MODEL, prompt="Hello there", options={"num_ctx": 0, "temperature": 0})
    assert tiny.prompt_eval_count == 2 and tiny.eval_count <= 2, tiny
    wide = client.chat(MODEL, messages=ask, options={"num_ctx": 10 ** 9, "num_predict": 1})
    assert wide.eval_count == 1
    bad = s.post("/api/chat", {"model": MODEL, "messages": ask, "options": {"num_ctx": "big"}})
    assert bad.status_code == 400 and "options.num_ctx" in bad.json()["error"], bad.text
    s.assert_healthy()


def test_sigterm_finishes_or_aborts_in_flight_and_stops_engine(server_512):
    """Graceful shutdown: SIGTERM with a stream in flight; the server exits 0 and the
    engine process is gone. (Runs last in this module: it stops the module's server.)"""
    s = server_512
    children = psutil.Process(s.proc.pid).children(recursive=True)
    assert children, "the engine runs in a child process"
    got_first = threading.Event()
    result = {}

    def stream():
        try:
            with s.http.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got_first.set()
                        result["last"] = line
        except Exception as e:  # the connection may be cut when the grace period ends
            result["error"] = repr(e)
        got_first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert got_first.wait(120)
    s.proc.send_signal(signal.SIGTERM)
    try:
        code = s.proc.wait(60)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        raise AssertionError(f"server did not exit after SIGTERM:\n{s.logs()}")
    t.join(30)
    assert code == 0, s.logs()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"engine processes still alive after shutdown: {alive}"
