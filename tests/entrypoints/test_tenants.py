"""Tenants over the built app (a scripted engine, the real SmolLM2 tokenizer; issue 34):
named keys from --api-keys-file reach the engine as the request's tenant, SIGHUP reloads
the keys with requests in flight (none dropped), per-tenant quotas answer 429 +
Retry-After naming the limit to that tenant only, allowed_models, bounded /metrics
labels, timing-safe key matching, and every route that returns stored data is scoped to
its tenant (another tenant gets the same 404 as an unknown id)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import time
from types import SimpleNamespace

import httpx
from prometheus_client import CollectorRegistry, generate_latest
import pytest
from fastapi.routing import iter_route_contexts

from llmserve.engine.tenant_context import tenant_fields
from llmserve.entrypoints.openai import tenants as tenants_mod
from llmserve.entrypoints.openai.api_server import build_app, init_app_state
from llmserve.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from llmserve.entrypoints.openai.tenant_quotas import TenantQuotas, request_cost
from llmserve.entrypoints.openai.tenants import KeyRing, Tenant
from llmserve.outputs import CompletionOutput, RequestOutput

KEYS = [
    {"key": "key-a", "tenant": "alice", "weight": 3},
    {"key": "key-a2", "tenant": "alice", "weight": 3},
    {"key": "key-b", "tenant": "bob", "max_concurrent_requests": 1},
    {"key": "key-c", "tenant": "carol", "allowed_models": ["other"]},
]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


class _Engine:
    """Engine stub: records the tenant each request reached the engine with; a request
    waits for ``gate`` (when set) before answering "ok"."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=64, vocab_size=49152, served_model_name=("m",), model="m")
        self.generation_config_defaults = {}
        self.errored = False
        self.tenants = []
        self.gate = None
        self.started = 0

    async def check_health(self):
        return None

    async def abort(self, request_id, *args, **kwargs):
        return None

    async def generate(self, prompt, params, request_id, priority=0, **kwargs):
        self.tenants.append(tenant_fields())
        self.started += 1
        if self.gate is not None:
            await self.gate.wait()
        yield RequestOutput(request_id, None, [1], None, [CompletionOutput(0, "ok", [5], None, None, "stop")], True)


def _app(tokenizer, tmp_path, entries=KEYS):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--api-keys-file", str(path)])
    validate_parsed_serve_args(args)
    app = build_app(args)
    engine = _Engine(tokenizer)
    registry = CollectorRegistry()  # the /metrics registry (a real engine's PrometheusStatLogger has one)
    stat_logger = SimpleNamespace(registry=registry, render=lambda: generate_latest(registry),
                                  record_rejection=lambda reason: None, content_type="text/plain")
    asyncio.run(init_app_state(engine, app.state, args, stat_logger=stat_logger))
    return app, engine, path


def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30)


def test_named_keys_reach_the_engine_as_the_tenant_and_label_metrics(smol_tokenizer, tmp_path):
    app, engine, _ = _app(smol_tokenizer, tmp_path)

    async def run():
        async with _client(app) as c:
            for key in ("key-a", "key-a2", "key-b"):
                assert (await c.post("/v1/chat/completions", json=CHAT, headers=_auth(key))).status_code == 200
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=_auth("key-z"))).status_code == 401
            return (await c.get("/metrics")).text
    metrics = asyncio.run(run())
    assert engine.tenants == [("alice", 3.0), ("alice", 3.0), ("bob", 1.0)]
    assert re.search(r'vllm:tenant_requests_total\{outcome="admitted",tenant="alice"\} 2\.0', metrics)
    assert 'tenant="bob"' in metrics and "key-a" not in metrics and "key-b" not in metrics


def test_a_request_the_global_admission_refuses_counts_under_its_reason_for_its_tenant(smol_tokenizer, tmp_path):
    """A request under its tenant's quotas that the global admission refuses (429
    queue_delay: --max-num-seqs full) is counted for its tenant under that reason, not
    "admitted" (a trial: 16 admitted for 8 served, no refusal for the tenant)."""
    from llmserve.entrypoints.openai.admission import Rejection

    app, _, _ = _app(smol_tokenizer, tmp_path)
    controller, calls = app.state.admission, []
    admit = controller.admit

    def refuse_every_second(*args, **kwargs):
        calls.append(1)
        if len(calls) % 2 == 0:
            return Rejection("queue_delay", 429, 1, "The queue is too long. Retry later.")
        return admit(*args, **kwargs)
    controller.admit = refuse_every_second

    async def run():
        async with _client(app) as c:
            codes = [(await c.post("/v1/chat/completions", json=CHAT, headers=_auth("key-a"))).status_code
                     for _ in range(4)]
            return codes, (await c.get("/metrics")).text
    codes, metrics = asyncio.run(run())
    assert codes == [200, 429, 200, 429]
    assert re.search(r'vllm:tenant_requests_total\{outcome="admitted",tenant="alice"\} 2\.0', metrics), metrics
    assert re.search(r'vllm:tenant_requests_total\{outcome="queue_delay",tenant="alice"\} 2\.0', metrics), metrics
    assert re.search(r'vllm:tenant_in_flight_requests\{tenant="alice"\} 0\.0', metrics)


def test_quota_429_names_the_limit_for_that_tenant_only_and_allowed_models(smol_tokenizer, tmp_path):
    app, engine, _ = _app(smol_tokenizer, tmp_path)
    engine.gate = asyncio.Event()

    async def run():
        async with _client(app) as c:
            first = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT, headers=_auth("key-b")))
            while engine.started < 1:
                await asyncio.sleep(0.01)
            over = await c.post("/v1/chat/completions", json=CHAT, headers=_auth("key-b"))
            # validation first: over the quota, a malformed request gets its own 400
            bad = await c.post("/v1/chat/completions", json={**CHAT, "messages": "x"}, headers=_auth("key-b"))
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages", bad.text
            other = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT, headers=_auth("key-a")))
            while engine.started < 2:  # alice is admitted while bob is at his limit
                await asyncio.sleep(0.01)
            engine.gate.set()
            wrong_model = await c.post("/v1/chat/completions", json=CHAT, headers=_auth("key-c"))
            return over, (await first).status_code, (await other).status_code, wrong_model
    over, first, other, wrong_model = asyncio.run(run())
    assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1
    err = over.json()["error"]
    assert err["param"] == "tenant_max_concurrent_requests" and "max_concurrent_requests 1" in err["message"]
    assert err["type"] == "RateLimitError" and err["code"] == 429
    assert first == other == 200
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["param"] == "model"


def test_allowed_models_cannot_be_bypassed_by_leaving_model_out_or_an_empty_list(smol_tokenizer, tmp_path):
    """Trial of stop 42: a request without ``model`` went to the default model whatever the
    key's allowed_models, and ``allowed_models: []`` allowed every model. Now a request
    without a model runs only when the key may call the default model, an empty list
    allows nothing, and a 404 lists only served names the key may call."""
    entries = [{"key": "key-c", "tenant": "carol", "allowed_models": ["other"]},
               {"key": "key-m", "tenant": "mia", "allowed_models": ["m"]},
               {"key": "key-n", "tenant": "nobody", "allowed_models": []}]
    app, engine, _ = _app(smol_tokenizer, tmp_path, entries)
    no_model = {k: v for k, v in CHAT.items() if k != "model"}
    empty_model = {**CHAT, "model": ""}

    async def run():
        async with _client(app) as c:
            post = lambda body, key, url="/v1/chat/completions": c.post(url, json=body, headers=_auth(key))
            return {"carol none": await post(no_model, "key-c"), "carol empty": await post(empty_model, "key-c"),
                    "carol completions": await post({"prompt": "hi", "max_tokens": 2}, "key-c", "/v1/completions"),
                    "carol infill": await post({"input_prefix": "def f(", "input_suffix": ")"}, "key-c", "/infill"),
                    "carol m": await post(CHAT, "key-c"), "mia none": await post(no_model, "key-m"),
                    "nobody m": await post(CHAT, "key-n"), "nobody none": await post(no_model, "key-n"),
                    "nobody models": await c.get("/v1/models", headers=_auth("key-n"))}
    r = asyncio.run(run())
    for name in ("carol none", "carol empty", "carol completions", "carol infill", "nobody none"):
        assert r[name].status_code == 400, (name, r[name].text)
        assert r[name].json()["error"]["param"] == "model"
    for name in ("carol none", "carol empty", "carol completions", "carol infill"):
        assert "none of the models served here" in r[name].json()["error"]["message"], r[name].text
    assert "none of the models served here" in r["nobody none"].json()["error"]["message"]
    assert r["carol m"].status_code == 404 and "No model served here can be called" in r["carol m"].text
    assert "`other`" not in r["carol m"].text  # allowed but not served: never listed as served
    assert r["nobody m"].status_code == 404
    assert r["mia none"].status_code == 200
    assert r["nobody models"].json()["data"] == []
    assert engine.started == 1  # only mia's request reached the engine


def test_every_route_that_names_a_model_honours_allowed_models(smol_tokenizer, tmp_path):
    """Trial of stop 42: /tokenize, /detokenize and count_tokens answered 200 on a model
    the key may not call. Every route whose body names a model (JSON ``model``, Ollama
    show's ``name``, an adapter's ``lora_name``, a multipart form's ``model``) answers
    the 404 of an unknown model, and a key allowed the model is served as before."""
    entries = [{"key": "key-c", "tenant": "carol", "allowed_models": ["other"]},
               {"key": "key-m", "tenant": "mia", "allowed_models": ["m"]}]
    app, engine, _ = _app(smol_tokenizer, tmp_path, entries)
    json_routes = {"/tokenize": {"model": "m", "prompt": "hi"}, "/detokenize": {"model": "m", "tokens": [1, 2]},
                   "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                   "/api/show": {"name": "m"}, "/v1/unload_lora_adapter": {"lora_name": "m"},
                   "/api/pull": {"model": "m", "stream": False}, "/api/copy": {"source": "m", "destination": "x"}}

    async def run():
        async with _client(app) as c:
            got = {(p, k): await c.post(p, json=body, headers=_auth(k)) for p, body in json_routes.items()
                   for k in ("key-c", "key-m")}
            got["/api/show model"] = await c.post("/api/show", json={"model": "m"}, headers=_auth("key-c"))
            form = lambda data: c.post("/v1/audio/transcriptions", data=data, headers=_auth("key-c"),
                                       files={"file": ("a.wav", b"RIFF0000WAVE", "audio/wav")})
            got["form m"], got["form none"] = await form({"model": "m"}), await form({})
            got["tokenize none"] = await c.post("/tokenize", json={"prompt": "hi"}, headers=_auth("key-c"))
            return got
    got = asyncio.run(run())
    for name in [(p, "key-c") for p in json_routes] + ["/api/show model", "form m"]:
        assert got[name].status_code == 404, (name, got[name].text)
        # Ollama's route answers Ollama's 404 body (ollama/names.py), the others OpenAI's
        want = 'model "m" not found' if name == ("/api/copy", "key-c") else "model 'm' not found" \
            if name in (("/api/show", "key-c"), "/api/show model", ("/api/pull", "key-c")) \
            else "No model served here can be called"
        error = got[name].json()["error"]  # Ollama's is the message, OpenAI's an object
        assert want in (error if isinstance(error, str) else error["message"]), (name, got[name].text)
    for name in ("form none", "tokenize none"):
        assert got[name].status_code == 400 and "none of the models served here" in got[name].text, got[name].text
    assert got[("/tokenize", "key-m")].status_code == 200 and got[("/tokenize", "key-m")].json()["count"] >= 1
    assert got[("/detokenize", "key-m")].status_code == 200
    assert got[("/v1/messages/count_tokens", "key-m")].json()["input_tokens"] >= 1
    assert got[("/api/pull", "key-m")].json() == {"status": "success"}
    assert got[("/api/copy", "key-m")].status_code == 501  # served: nothing is copied here
    assert engine.started == 0


def test_model_listings_hide_models_outside_allowed_models(smol_tokenizer, tmp_path):
    app, engine, _ = _app(smol_tokenizer, tmp_path)
    engine.model_config.model_path = str(tmp_path)  # the Ollama cards stat the weights' folder
    vars(engine.model_config).update(hf_config=SimpleNamespace(model_type="llama"), quantization=None, dtype="float32")

    async def run():
        async with _client(app) as c:
            return {k: [await c.get(p, headers=_auth(k)) for p in ("/v1/models", "/v1/models/m", "/api/tags", "/api/ps")]
                    for k in ("key-a", "key-c")}
    got = asyncio.run(run())
    listed = {k: ([m["id"] for m in r[0].json()["data"]], [m["name"] for m in r[2].json()["models"]],
                  [m["name"] for m in r[3].json()["models"]]) for k, r in got.items()}
    assert listed["key-a"] == (["m"], ["m:latest"], ["m:latest"]) and got["key-a"][1].json()["id"] == "m"
    assert listed["key-c"] == ([], [], [])  # carol may call only "other"
    hidden = got["key-c"][1]
    # The 404 lists the served names carol may call: none ("other" is allowed but not
    # served, "m" served but not allowed; the list named "other" as served before stop 42).
    message = hidden.json()["error"]["message"]
    assert hidden.status_code == 404 and "`other`" not in message and "No model served here can be called" in message


def test_an_ollama_latest_tag_is_allowed_as_its_model(smol_tokenizer, tmp_path):
    """A key allowed "m" may call "m:latest" (and "M") on Ollama's routes, where that name serves
    "m" (the fresh-user trial: a key allowed only a LoRA adapter got 404 for
    "sql:latest" while "sql" worked), and "m:latest" on the OpenAI routes, which serve it as
    "m" (/api/tags lists "m:latest"; VS Code Copilot Chat sends that name to /v1); case
    still counts there."""
    app, engine, _ = _app(smol_tokenizer, tmp_path, KEYS + [{"key": "key-m", "tenant": "mallory",
                                                             "allowed_models": ["m"]}])
    engine.model_config.__dict__.update(model_path=str(tmp_path), gguf_file=None, quantization=None,
                                        dtype="bfloat16", hf_config=SimpleNamespace(model_type="llama"))  # what /api/tags reads

    async def run():
        async with _client(app) as c:
            gen = await c.post("/api/generate", json={"model": "m:latest", "prompt": "hi", "stream": False,
                                                      "options": {"num_predict": 2}}, headers=_auth("key-m"))
            other = await c.post("/api/generate", json={"model": "other:latest", "prompt": "hi", "stream": False},
                                 headers=_auth("key-m"))
            upper = await c.post("/api/generate", json={"model": "M", "prompt": "hi", "stream": False,
                                                        "options": {"num_predict": 2}}, headers=_auth("key-m"))
            openai = await c.post("/v1/chat/completions", json={**CHAT, "model": "m:latest"}, headers=_auth("key-m"))
            cased = await c.post("/v1/chat/completions", json={**CHAT, "model": "M"}, headers=_auth("key-m"))
            tags = await c.get("/api/tags", headers=_auth("key-m"))
            return gen, other, openai, upper, cased, tags
    gen, other, openai, upper, cased, tags = asyncio.run(run())
    assert cased.status_code == 404 and [m["name"] for m in tags.json()["models"]] == ["m:latest"], tags.text
    assert gen.status_code == 200 and gen.json()["response"] == "ok", gen.text
    assert upper.status_code == 200 and upper.json()["model"] == "M", upper.text  # Ollama ignores case
    assert other.status_code == 404 and other.json() == {"error": "model 'other:latest' not found"}
    assert openai.status_code == 200 and openai.json()["model"] == "m", openai.text
    assert engine.started == 3


def test_request_list_shows_only_the_engines_of_the_keys_models(smol_tokenizer, tmp_path):
    """GET /v1/requests: the ``engine`` state is that of the engines serving a model the
    key may use, as /v1/models and /api/ps list only those models; a key allowed no model
    served here (carol) gets the sum over no engine (all 0), not the server-wide totals
    (the fresh-user trial saw them with a key allowed no model)."""
    from llmserve.engine.request_timeline import RequestTimelines
    from llmserve.metrics.stats import SchedulerStats

    entries = KEYS + [{"key": "key-m", "tenant": "mallory", "allowed_models": ["m"]},
                      {"key": "key-e", "tenant": "erin", "allowed_models": []}]
    app, engine, _ = _app(smol_tokenizer, tmp_path, entries)
    store = engine.request_timelines = RequestTimelines(default_model="m")
    store.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.5), None)
    store.prompt_tokens_total, store.generation_tokens_total = 1234, 567  # other tenants' work

    async def run():
        async with _client(app) as c:
            return {k: (await c.get("/v1/requests", headers=_auth(k))).json()["engine"]
                    for k in ("key-a", "key-m", "key-c", "key-e")}
    seen = asyncio.run(run())
    for key in ("key-a", "key-m"):  # every model, or "m" by name: m's engine
        assert seen[key]["prompt_tokens_total"] == 1234 and seen[key]["generation_tokens_total"] == 567
        assert seen[key]["kv_cache_usage"] == 0.5
    for key in ("key-c", "key-e"):  # only a model not served here, or none at all
        hidden = seen[key]
        assert {k: v for k, v in hidden.items() if k != "time"} == {
            "num_running": 0, "num_waiting": 0, "batch_size": 0, "prompt_tokens_total": 0,
            "generation_tokens_total": 0, "kv_cache_usage": 0.0}
        assert hidden["time"] > 0  # the same shape, so a client (the live view) still reads it


def test_request_list_engines_of_a_multi_model_server_follow_allowed_models():
    """On an --extra-model server each model's engine is shown to the keys that may use
    that model, by any served name or one of its LoRA adapters."""
    from llmserve.entrypoints.openai.request_timelines.api_router import _visible_stores
    from llmserve.entrypoints.openai.tenants import TENANT_SCOPE_KEY

    def model(store, names, adapters=()):
        serving = SimpleNamespace(model_names=list(names), lora_names=list(adapters))
        return SimpleNamespace(engine_client=SimpleNamespace(request_timelines=store),
                               state=SimpleNamespace(openai_serving_models=serving))
    state = SimpleNamespace(model_registry=SimpleNamespace(models=[
        model("chat-store", ["chat", "chat-alias"], ["sql-adapter"]), model("embed-store", ["embed"])]))

    def seen(allowed):
        request = SimpleNamespace(app=SimpleNamespace(state=state),
                                  scope={"state": {TENANT_SCOPE_KEY: Tenant("t", allowed_models=allowed)}})
        return _visible_stores(request)
    assert seen(None) == ["chat-store", "embed-store"]
    assert seen(("chat-alias",)) == ["chat-store"] and seen(("sql-adapter",)) == ["chat-store"]
    assert seen(("embed", "other")) == ["embed-store"] and seen(()) == []


def test_concurrency_retry_after_counts_the_tenants_busy_time_only():
    """A tenant's requests ended 2 per busy second, then it idled 25 s: one of its
    requests ends in about 0.5 s, not 30 s / 5 (its idle time counted as draining)."""
    now = [0.0]
    quotas = TenantQuotas(clock=lambda: now[0])
    t = Tenant("t", max_concurrent_requests=1)
    for _ in range(5):
        assert quotas.check(t, 1) is None
        now[0] += 0.5
        quotas.release(t)
    now[0] += 25.0
    assert quotas.check(t, 1) is None
    reason, retry, _ = quotas.check(t, 1)
    assert reason == "tenant_max_concurrent_requests" and retry == 1  # was 6 (5 in the 30 s window)


def test_token_rate_bucket_retry_after_is_the_tenants_own_refill_time():
    now = [0.0]
    quotas = TenantQuotas(clock=lambda: now[0])
    t = Tenant("t", max_tokens_per_second=100.0, burst_tokens=100)
    other = Tenant("u", max_tokens_per_second=100.0)
    assert quotas.check(t, 350) is None  # a full bucket admits, into debt (100 - 350 = -250)
    reason, retry, message = quotas.check(t, 10)
    assert reason == "tenant_max_tokens_per_second" and retry == 3 and "max_tokens_per_second 100" in message
    assert quotas.check(other, 10) is None  # another tenant's bucket is its own
    now[0] = 2.6  # refilled 260 tokens: back above zero
    assert quotas.check(t, 10) is None
    body = json.dumps({"max_tokens": 50, "prompt": "x" * 400}).encode()
    assert request_cost(body) == 50 + len(body) // 4  # its output limit + a prompt estimate
    assert request_cost(b'{"prompt": "hi"}') == 256 + 4
    fanned = json.dumps({"max_tokens": 8, "prompt": ["hello"] * 1024, "n": 16}).encode()
    assert request_cost(fanned, "/v1/completions") == 8 * 16384 + len(fanned) // 4  # each sequence may write 8


def test_api_key_repeatable_and_keys_file_checked_at_start(tmp_path):
    parse = make_arg_parser(argparse.ArgumentParser()).parse_args
    args = parse(["--api-key", "a", "b", "--api-key", "c"])
    validate_parsed_serve_args(args)
    assert args.api_key == ["a", "b", "c"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"key": "x", "tenant": "t", "weight": 0}]))
    with pytest.raises(ValueError, match="weight must be > 0"):
        validate_parsed_serve_args(parse(["--api-keys-file", str(bad)]))
    bad.write_text(json.dumps([{"key": "x", "tenant": "t", "rate": 3}]))
    with pytest.raises(ValueError, match="unknown fields"):
        validate_parsed_serve_args(parse(["--api-keys-file", str(bad)]))
    # One key naming two tenants (or listed twice) is refused: which one wins is not the order of lines.
    bad.write_text(json.dumps([{"key": "x", "tenant": "t"}, {"key": "y", "tenant": "u"}, {"key": "x", "tenant": "u"}]))
    with pytest.raises(ValueError, match="entry 2: the same key as entry 0"):
        validate_parsed_serve_args(parse(["--api-keys-file", str(bad)]))
    # Wrong-typed values name the field (a string allowed_models was split into characters).
    for entry, field in (({"allowed_models": "SmolLM2-135M-Instruct"}, "allowed_models"),
                         ({"max_concurrent_requests": "x"}, "max_concurrent_requests"),
                         ({"weight": True}, "weight")):
        bad.write_text(json.dumps([{"key": "x", "tenant": "t", **entry}]))
        with pytest.raises(ValueError, match=f"entry 0: '{field}' must be"):
            validate_parsed_serve_args(parse(["--api-keys-file", str(bad)]))
    # Trial of stop 42: an infinite weight, a fractional count and a null tenant are refused
    # naming the field; a missing file is a clean error, not a traceback.
    for entry, field in (({"weight": float("inf")}, "weight"), ({"max_concurrent_requests": 1.5}, "max_concurrent_requests"),
                         ({"burst_tokens": 2.5}, "burst_tokens"), ({"tenant": None}, "tenant"),
                         ({"max_concurrent_requests": float("inf")}, "max_concurrent_requests"),
                         ({"burst_tokens": float("nan")}, "burst_tokens")):
        bad.write_text(json.dumps([{"key": "x", "tenant": "t", **entry}]))
        with pytest.raises(ValueError, match=f"entry 0: '{field}' must be"):
            validate_parsed_serve_args(parse(["--api-keys-file", str(bad)]))
    with pytest.raises(ValueError, match="cannot be read"):
        validate_parsed_serve_args(parse(["--api-keys-file", str(tmp_path / "missing.json")]))
    # An entry without a tenant belongs to the default tenant (README).
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"key": "x"}, {"key": "y", "tenant": "u"}]))
    assert sorted(KeyRing([], str(good)).tenant_names()) == ["default", "u"]


def test_key_match_is_constant_time_in_which_key_matched(monkeypatch):
    ring = KeyRing(["k0", "k1", "k2"])
    calls = []
    real = tenants_mod.hmac.compare_digest
    monkeypatch.setattr(tenants_mod.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for given in (["k0"], ["k2"], ["nope"], ["k0", "nope"]):
        calls.clear()
        found = ring.match(given)
        assert len(calls) == 3 * len(given)  # every key compared, whichever (if any) matched
        assert (found is None) == (given == ["nope"])


def test_sighup_reload_under_load_drops_no_request(smol_tokenizer, tmp_path):
    app, engine, path = _app(smol_tokenizer, tmp_path)
    engine.gate = asyncio.Event()

    async def run():
        async with _client(app) as c:
            inflight = [asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT, headers=_auth("key-a")))
                        for _ in range(6)]
            while engine.started < 6:
                await asyncio.sleep(0.01)
            path.write_text(json.dumps([{"key": "key-new", "tenant": "alice"}, {"key": "key-b", "tenant": "bob"}]))
            os.kill(os.getpid(), signal.SIGHUP)
            await asyncio.sleep(0.05)  # the handler runs in the main thread between bytecodes
            old = await c.post("/v1/chat/completions", json=CHAT, headers=_auth("key-a"))
            engine.gate.set()
            new = await c.post("/v1/chat/completions", json=CHAT, headers=_auth("key-new"))
            return [(await f).status_code for f in inflight], old.status_code, new.status_code
    done, old, new = asyncio.run(run())
    assert done == [200] * 6  # admitted before the reload: all answered
    assert old == 401 and new == 200
    path.write_text("not json")  # a bad file keeps the keys in use
    os.kill(os.getpid(), signal.SIGHUP)
    assert asyncio.run(_status(app, "key-new")) == 200


async def _status(app, key):
    async with _client(app) as c:
        return (await c.post("/v1/chat/completions", json=CHAT, headers=_auth(key))).status_code


# Routes with an id in the path that return stored per-request data, and how this test
# checks each; a new such route must be added here (and scoped), or the test fails.
NOT_STORED_DATA = {"/v1/models/{model_id:path}",  # the served models: the same for everyone
                   "/api/blobs/{digest}",  # Ollama's model upload: refused (400), nothing stored
                   "/v1/messages/batches/{rest:path}",  # Anthropic's Message Batches: not served (404)
                   "/slots/{id_slot}",  # llama-server's slot save/restore/erase: not served (501)
                   # OpenAI's stored chat completions: nothing is stored, one 404 for all (chat_completion/stored.py)
                   "/v1/chat/completions/{completion_id}", "/v1/chat/completions/{completion_id}/messages"}


def test_every_stored_data_route_is_scoped_to_its_tenant(smol_tokenizer, tmp_path):
    app, engine, _ = _app(smol_tokenizer, tmp_path)
    routes = {c.path for c in iter_route_contexts(app.routes) if "{" in c.path} - NOT_STORED_DATA

    async def run():
        async with _client(app) as c:
            a, b = _auth("key-a"), _auth("key-b")
            made = (await c.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 3},
                                 headers=a)).json()
            rid = made["id"]
            bg = (await c.post("/v1/responses", json={"model": "m", "input": "hi", "background": True,
                                                      "max_output_tokens": 3}, headers=a)).json()["id"]
            checks = {
                "/v1/responses/{response_id}": ("GET", f"/v1/responses/{rid}", None),
                "/v1/responses/{response_id}/input_items": ("GET", f"/v1/responses/{rid}/input_items", None),
                "/v1/responses/{response_id}/cancel": ("POST", f"/v1/responses/{bg}/cancel", None),
            }
            seen = {}
            for route, (method, url, body) in checks.items():
                seen[route] = ((await c.request(method, url, headers=b)).status_code,
                               (await c.request(method, url, headers=a)).status_code)
            follow = {"model": "m", "input": "more", "previous_response_id": rid, "max_output_tokens": 3}
            seen["previous_response_id"] = ((await c.post("/v1/responses", json=follow, headers=b)).status_code,
                                            (await c.post("/v1/responses", json=follow, headers=a)).status_code)
            unknown = await c.get("/v1/responses/resp_" + "0" * 48, headers=b)
            other = await c.get(f"/v1/responses/{rid}", headers=b)
            deleted = ((await c.delete(f"/v1/responses/{rid}", headers=b)).status_code,
                       (await c.delete(f"/v1/responses/{rid}", headers=a)).status_code)
            seen["/v1/responses/{response_id}" + " DELETE"] = deleted
            timeline = "/v1/requests/{request_id}/timeline"
            if timeline in routes:  # issue 33's route: another tenant's request id is a 404
                await c.post("/v1/chat/completions", json=CHAT, headers={**a, "X-Request-Id": "mine"})
                seen[timeline] = ((await c.get("/v1/requests/mine/timeline", headers=b)).status_code, None)
            return seen, unknown, other
    seen, unknown, other = asyncio.run(run())
    assert routes <= set(seen), f"stored-data routes without an isolation check: {routes - set(seen)}"
    for route, (as_other, as_owner) in seen.items():
        assert as_other == 404, (route, as_other)
        assert as_owner in (200, None), (route, as_owner)
    # another tenant's id answers exactly as an unknown one (nothing says it exists)
    assert other.json()["error"] == {**unknown.json()["error"], "message": other.json()["error"]["message"]}
    assert other.json()["error"]["message"].replace(other.url.path.split("/")[-1], "ID") == \
        unknown.json()["error"]["message"].replace(unknown.url.path.split("/")[-1], "ID")


def test_tenant_metrics_reach_a_multi_model_servers_merged_metrics():
    """With --extra-model the server's /metrics is MergedStatLoggers: the tenants' families
    register in its registry and are rendered (they were missing)."""
    from llmserve.entrypoints.openai.multi_model import MergedStatLoggers

    engines = [SimpleNamespace(registry=CollectorRegistry(), content_type="text/plain") for _ in range(2)]
    merged = MergedStatLoggers(engines)
    quotas = TenantQuotas(merged.registry)
    assert quotas.check(Tenant("alice", max_concurrent_requests=4), 10) is None
    text = merged.render().decode()
    assert re.search(r'vllm:tenant_requests_total\{outcome="admitted",tenant="alice"\} 1\.0', text), text
    assert 'vllm:tenant_in_flight_requests{tenant="alice"}' in text


def test_an_allowed_name_latest_counts_as_served():
    """allowed_models ["m:latest"] on a server of "m" calls "m" (served_names.latest_match),
    so it is not warned about as a model the server does not serve; "m:1b" still is."""
    from llmserve.entrypoints.openai.tenants import unknown_allowed_models
    tenants = [Tenant("t", allowed_models=("m:latest", "m:1b")), Tenant("u", allowed_models=("n",))]
    assert unknown_allowed_models(tenants, ["m", "n:latest"]) == {"t": ["m:1b"]}


def _unknown_model_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "does not serve" in r.getMessage()]


def _sighup_and_wait(caplog, count):
    """Send SIGHUP to this process and wait (the handler runs in the main thread between
    bytecodes) until ``count`` reloads have been logged."""
    os.kill(os.getpid(), signal.SIGHUP)
    deadline = time.monotonic() + 5
    while sum("Reloaded" in r.getMessage() for r in caplog.records) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_allowed_models_not_served_are_warned_at_start_and_on_each_reload(smol_tokenizer, tmp_path, caplog):
    """Fresh-user trial: carol's allowed_models ["other"] on a server of "m" was accepted
    silently and every request of hers got 404. A warning, not an error (a LoRA adapter of
    that name may be loaded later), naming the tenant, the unknown names and the served ones."""
    with caplog.at_level(logging.INFO, logger="llmserve.entrypoints.openai.tenants"):
        app, _, path = _app(smol_tokenizer, tmp_path)
        start = _unknown_model_warnings(caplog)
        assert len(start) == 1 and "'carol'" in start[0] and ": other (served: m)" in start[0], start
        caplog.clear()
        path.write_text(json.dumps([{"key": "key-a", "tenant": "alice", "allowed_models": ["m", "gone", "also-gone"]},
                                    {"key": "key-c", "tenant": "carol", "allowed_models": ["m"]}]))
        _sighup_and_wait(caplog, 1)
        reload_1 = _unknown_model_warnings(caplog)
        assert len(reload_1) == 1 and "'alice'" in reload_1[0] and ": also-gone, gone (served: m)" in reload_1[0]
        # An adapter loaded at run time (/v1/load_lora_adapter) counts as served at the next reload.
        app.state.openai_serving_models.lora.append(SimpleNamespace(lora_requests={"gone": None, "also-gone": None}))
        caplog.clear()
        _sighup_and_wait(caplog, 1)
        assert _unknown_model_warnings(caplog) == []
        assert sum("Reloaded" in r.getMessage() for r in caplog.records) == 1


def test_allowed_models_are_checked_against_every_model_of_a_multi_model_server(tmp_path, caplog):
    """With --extra-model each model's state is built without the keyring; the check runs
    once on the merged names (an allowed name of the extra model is served, not warned)."""
    from llmserve.entrypoints.openai.models.serving import BaseModelPath, OpenAIServingModels
    from llmserve.entrypoints.openai.multi_model import init_multi_model_state

    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": "k", "tenant": "t", "allowed_models": ["extra", "typo"]}]))

    async def fake_init_app_state(engine_client, ns, args):
        ns.openai_serving_models = OpenAIServingModels([BaseModelPath(args.name, args.name)], 64)
        ns.openai_serving_render, ns.lora_adapters = None, None
        ns.stat_logger = SimpleNamespace(content_type="text/plain")
        ns.admission = SimpleNamespace(config=None)

    engines = [(SimpleNamespace(), SimpleNamespace(name=n)) for n in ("main", "extra")]
    state = SimpleNamespace(keyring=KeyRing([], str(path)))
    with caplog.at_level(logging.WARNING, logger="llmserve.entrypoints.openai.tenants"):
        asyncio.run(init_multi_model_state(engines, state, fake_init_app_state))
    warned = _unknown_model_warnings(caplog)
    assert len(warned) == 1 and "'t'" in warned[0] and ": typo (served: extra, main)" in warned[0], warned


def test_a_request_without_model_on_a_multi_model_server_needs_every_model_allowed():
    """On an --extra-model server a request without ``model`` goes to the first model that
    can serve its endpoint, which the middleware cannot know: it runs only for a key that
    may call every model (by any of its names); others must name one (400, param model)."""
    from llmserve.entrypoints.openai.models.serving import BaseModelPath, OpenAIServingModels
    from llmserve.entrypoints.openai.tenant_quotas import model_refusal

    serving = OpenAIServingModels([BaseModelPath("chat", "chat"), BaseModelPath("chat-alias", "chat"),
                                   BaseModelPath("embed", "embed")], 64)
    state = SimpleNamespace(openai_serving_models=serving,
                            model_registry=SimpleNamespace(models=[SimpleNamespace(names=["chat", "chat-alias"]),
                                                                   SimpleNamespace(names=["embed"])]))
    both = Tenant("both", allowed_models=("chat-alias", "embed"))
    chat_only = Tenant("chat", allowed_models=("chat",))
    assert model_refusal(both, None, state) is None and model_refusal(both, "embed", state) is None
    refused = model_refusal(chat_only, None, state)
    assert refused.param == "model" and "`chat`" in str(refused) and "`embed`" not in str(refused)
    assert "Models served here: `chat`." in str(model_refusal(chat_only, "embed", state))
    assert model_refusal(Tenant("all"), None, state) is None
