"""The FastAPI app's wiring with a scripted engine stub (no model): auth, error bodies,
engine death (503), errors before vs after the SSE stream starts, X-Request-Id, CORS.
The real-engine behaviour is covered by tests/e2e."""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from llmserve.engine.exceptions import EngineDeadError
from llmserve.entrypoints.openai.api_server import build_app, init_app_state
from llmserve.entrypoints.openai.cli_args import make_arg_parser
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParamsError


class ScriptedEngine:
    """Engine stub: ``generate`` raises ``fail_before`` before any output, else yields
    ``outputs`` and then raises ``fail_after`` (if set)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=64, vocab_size=49152, served_model_name=("m",), model="m")
        self.generation_config_defaults = {}
        self.dead = False
        self.fail_before = None
        self.fail_after = None
        self.outputs = []
        self.closed = []
        self.prompts = []
        self.params = []

    @property
    def errored(self):
        return self.dead

    async def check_health(self):
        if self.dead:
            raise EngineDeadError()

    async def generate(self, prompt, params, request_id, priority=0, **kwargs):
        self.prompts.append(prompt)
        self.params.append(params)
        try:
            if self.dead:
                raise EngineDeadError()
            if self.fail_before:
                raise self.fail_before
            for out in self.outputs:
                yield out
            if self.fail_after:
                raise self.fail_after
        finally:
            self.closed.append(request_id)


def _output(text, finish=None):
    return RequestOutput("r", None, [1], None, [CompletionOutput(0, text, [5], None, None, finish)], finish is not None)


@pytest.fixture
def app_and_engine(smol_tokenizer):
    def make(*flags):
        args = make_arg_parser(argparse.ArgumentParser()).parse_args(list(flags))
        engine = ScriptedEngine(smol_tokenizer)
        app = build_app(args)
        import asyncio

        asyncio.run(init_app_state(engine, app.state, args))
        return TestClient(app), engine
    return make


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_api_key_auth(app_and_engine):
    client, engine = app_and_engine("--api-key", "sekret")
    engine.outputs = [_output("ok", "stop")]
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401 and r.json()["error"]["type"]
    assert client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
    ok = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"
    assert client.get("/health").status_code == 200 and client.get("/version").status_code == 200
    pre = client.options("/v1/chat/completions", headers={"Origin": "http://a.b", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("LLMSERVE_API_KEY", "from-env")
    assert make_arg_parser(argparse.ArgumentParser()).parse_args([]).api_key == "from-env"


def test_dead_engine_gives_503(app_and_engine):
    client, engine = app_and_engine()
    engine.dead = True
    h = client.get("/health")
    assert h.status_code == 503 and h.json()["error"]["code"] == 503
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["type"] == "EngineDeadError"


def test_engine_value_error_is_400_before_the_stream(app_and_engine):
    client, engine = app_and_engine()
    engine.fail_before = ValueError("token id out of vocabulary")
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
        assert "vocabulary" in r.json()["error"]["message"]
    assert len(engine.closed) == 2


def test_engine_rejections_name_the_openai_field(app_and_engine):
    """The engine's InputProcessor names its own fields (prompt, max_tokens); the chat
    handler answers with the OpenAI names (messages, max_completion_tokens when given)."""
    client, engine = app_and_engine()
    for engine_param, body, param in (
            ("prompt", {}, "messages"),
            ("max_tokens", {"max_tokens": 3}, "max_tokens"),
            ("max_tokens", {"max_completion_tokens": 3}, "max_completion_tokens"),
            ("logit_bias", {}, "logit_bias")):
        engine.fail_before = SamplingParamsError("This model's maximum context length is 64 tokens.", engine_param)
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": None, **body, "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (engine_param, body, r.text)
            assert "64" in r.json()["error"]["message"]
    engine.fail_before = SamplingParamsError("too long", "prompt")
    r = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_error_after_the_stream_started_is_an_sse_event(app_and_engine):
    client, engine = app_and_engine()
    engine.outputs = [_output("Hel")]
    engine.fail_after = EngineDeadError()
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3, "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["text"] == "Hel"
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == 503


def test_x_request_id_and_error_bodies(app_and_engine):
    client, engine = app_and_engine()
    engine.outputs = [_output("ok", "stop")]
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2},
                    headers={"X-Request-Id": "abc"})
    assert r.headers["x-request-id"] == "abc" and r.json()["id"] == "cmpl-abc"
    assert client.get("/v1/models").headers["x-request-id"]
    r = client.post("/v1/completions", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": "ten"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert client.get("/nowhere").json()["error"]["code"] == 404


def test_lone_surrogates_are_400_not_500(app_and_engine):
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"), which no tokenizer can encode:
    each endpoint answers 400 naming the field, and the connection keeps working."""
    client, engine = app_and_engine()
    engine.outputs = [_output("ok", "stop")]
    bad = '"a\\ud800b"'
    cases = [
        ("/v1/completions", '{"model": "m", "prompt": %s, "max_tokens": 2}' % bad, "prompt"),
        ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": %s}]}' % bad,
         "messages.0.content"),
        ("/tokenize", '{"model": "m", "prompt": %s}' % bad, "prompt"),
        ("/tokenize", '{"model": "m", "messages": [{"role": "user", "content": %s}]}' % bad, "messages.0.content"),
    ]
    for path, body, param in cases:
        r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "surrogate" in err["message"] and err["code"] == 400
    ok = client.post("/v1/completions", json={"model": "m", "prompt": "a\u00e9b", "max_tokens": 2})
    assert ok.status_code == 200


def test_one_renderer_for_llm_chat_the_chat_handler_and_tokenize(app_and_engine, llm_fp32):
    """The same messages give the same prompt token ids through LLM.apply_chat_template
    (what LLM.chat sends), /tokenize and the chat handler (what it sends the engine)."""
    client, engine = app_and_engine()
    engine.outputs = [_output("ok", "stop")]
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    offline = llm_fp32.apply_chat_template(msgs)
    tokenized = client.post("/tokenize", json={"model": "m", "messages": msgs}).json()["tokens"]
    assert client.post("/v1/chat/completions", json={"model": "m", "messages": msgs}).status_code == 200
    sent = engine.prompts[-1]
    assert offline == tokenized == sent["prompt_token_ids"]
    assert sent["prompt"].endswith("assistant\n") and "Hi\nthere" in sent["prompt"]
    open_turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    assert (llm_fp32.apply_chat_template(open_turn, **kw)
            == client.post("/tokenize", json={"model": "m", "messages": open_turn, **kw}).json()["tokens"])
    with pytest.raises(ValueError):
        llm_fp32.apply_chat_template(open_turn, continue_final_message=True)


def test_not_served_endpoints_answer_4xx_never_5xx(app_and_engine):
    """/v1/embeddings on a generating model: 404 for an unknown model, else a 400 (the
    openai clients retry 5xx answers); /v1/responses: 404 for an unknown model, 400s
    naming its fields."""
    client, engine = app_and_engine()
    for path, body in (("/v1/responses", {"input": "hi"}), ("/v1/embeddings", {"input": "hi"})):
        assert client.post(path, json={"model": "nope", **body}).status_code == 404
    r = client.post("/v1/embeddings", json={"model": "m", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
    r = client.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    r = client.post("/v1/responses", content='{"model": "m", "input": "a\\ud800"}'.encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_stored_chat_completion_routes_are_one_openai_404(app_and_engine):
    """vLLM keeps no chat completions: the requests of the openai SDK's chat.completions.list /
    retrieve / update / delete / messages.list all meet one 404 in OpenAI's error body saying
    so (the list was a 405 "GET is not allowed", the others Starlette's bare "Not Found");
    the id is not echoed; POST .../render is still the renderer."""
    client, _ = app_and_engine()
    calls = [("GET", "/v1/chat/completions?limit=5", None), ("GET", "/v1/chat/completions/chatcmpl-secret1", None),
             ("POST", "/v1/chat/completions/chatcmpl-secret1", {"metadata": {"k": "v"}}),
             ("DELETE", "/v1/chat/completions/chatcmpl-secret1", None),
             ("GET", "/v1/chat/completions/chatcmpl-secret1/messages", None),
             ("GET", "/v1/chat/completions/render", None)]
    for method, path, body in calls:
        r = client.request(method, path, json=body)
        error = r.json()["error"]
        assert r.status_code == 404 and "does not keep chat completions" in error["message"], (path, r.text)
        assert error["type"] == "NotFoundError" and "secret1" not in error["message"], (path, error)
    assert client.post("/v1/chat/completions/render", json=CHAT).status_code == 200
