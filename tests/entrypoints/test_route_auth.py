"""Issue 26 item 2 and item 7's small ones, over the built app (a scripted engine, the
real SmolLM2 tokenizer): one route table decides authentication (every route of the app
needs the API key unless it is on ``PUBLIC_PATHS``, ``/invocations`` included; the key
is accepted as ``Authorization: Bearer`` and as Anthropic's ``x-api-key``, from the real
``anthropic`` client too); a 405 lists every method of its path in ``Allow``; and
``/openapi.json`` shows the server's limits."""
from __future__ import annotations

import argparse
import asyncio
import re
from types import SimpleNamespace

import pytest
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient

from llmserve.entrypoints.openai.api_server import build_app, init_app_state
from llmserve.entrypoints.openai.cli_args import make_arg_parser
from llmserve.entrypoints.openai.server_utils import PUBLIC_PATHS
from llmserve.outputs import CompletionOutput, RequestOutput

KEY = "sekret-key"
# Every optional route on, so the table covers them too.
FLAGS = ("--api-key", KEY, "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class _Engine:
    """Engine stub: every request answers "ok" (finish_reason stop)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=64, vocab_size=49152, served_model_name=("m",), model="m")
        self.generation_config_defaults = {}
        self.errored = False

    async def check_health(self):
        return None

    async def generate(self, prompt, params, request_id, priority=0, **kwargs):
        yield RequestOutput(request_id, None, [1], None, [CompletionOutput(0, "ok", [5], None, None, "stop")], True)


def _client(tokenizer, *flags) -> TestClient:
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(list(flags))
    app = build_app(args)
    asyncio.run(init_app_state(_Engine(tokenizer), app.state, args))
    return TestClient(app)


@pytest.fixture(scope="module")
def client(smol_tokenizer):
    return _client(smol_tokenizer, *FLAGS)


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def test_every_route_needs_the_key_unless_it_is_on_the_public_list(client):
    """The route table: each route and method of the built app, without a key, is a 401
    with the OpenAI body, unless its path is on PUBLIC_PATHS (then it answers)."""
    routes = [(c.path, sorted(c.methods)) for c in iter_route_contexts(client.app.routes) if c.methods]
    assert len(routes) >= 30 and any(p == "/invocations" for p, _ in routes)
    unprotected, public_refused = [], []
    for path, methods in routes:
        for method in methods:
            r = client.request(method, _concrete(path), json={})
            if path in PUBLIC_PATHS:
                if r.status_code == 401:
                    public_refused.append(f"{method} {path}")
            elif r.status_code != 401 or r.headers.get("WWW-Authenticate") != "Bearer":  # (the body: each API's shape)
                unprotected.append(f"{method} {path} -> {r.status_code}")
    assert not unprotected, f"routes answering without the API key, not on PUBLIC_PATHS: {unprotected}"
    assert not public_refused, public_refused
    # protected by default: paths no route serves yet (the Anthropic and Ollama front doors,
    # /infill, a typo) are refused before routing, so a route added there is covered
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/api/chat", "/api/generate", "/api/tags",
                 "/infill", "/v1/nothing", "/health/", "//health", "/Health"):
        assert client.post(path, json={}).status_code == 401, path


def test_invocations_refuses_without_a_key(client):
    """/invocations served chat and completions to anyone (issue 26 item 2)."""
    r = client.post("/invocations", json=CHAT)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert client.post("/invocations", json=CHAT, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/invocations", json=CHAT, headers={"x-api-key": "wrong"}).status_code == 401
    assert client.post("/invocations", json=CHAT, headers={"Authorization": KEY}).status_code == 401  # no scheme
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY},
                    {"Authorization": "Bearer wrong", "x-api-key": KEY}):
        ok = client.post("/invocations", json=CHAT, headers=headers)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok", headers
    assert client.get("/ping").status_code == 200  # SageMaker's health check stays open


def test_several_keys_each_work(smol_tokenizer):
    c = _client(smol_tokenizer, "--api-key", "k1", "k2")
    for key in ("k1", "k2"):
        assert c.post("/tokenize", json={"prompt": "x"}, headers={"x-api-key": key}).status_code == 200
        assert c.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": f"bearer {key}"}).status_code == 200
    assert c.post("/tokenize", json={"prompt": "x"}, headers={"x-api-key": "k1k2"}).status_code == 401


def test_the_anthropic_client_authenticates_with_x_api_key(client):
    """The real anthropic SDK, with its key as ``x-api-key`` (Anthropic's own header, which
    its earlier releases send for ``api_key``) or as it sends ``api_key`` now (Bearer): accepted;
    a wrong key is its AuthenticationError (401)."""
    import anthropic

    def sdk(**kw):
        return anthropic.Anthropic(base_url="http://testserver", http_client=client, max_retries=0, **kw)

    for ok in (sdk(api_key=None, auth_token=None, default_headers={"x-api-key": KEY}), sdk(api_key=KEY)):
        assert ok.get("/v1/models", cast_to=object)["data"][0]["id"] == "m"
    for bad in (sdk(api_key=None, auth_token=None, default_headers={"x-api-key": "wrong"}), sdk(api_key="wrong")):
        with pytest.raises(anthropic.AuthenticationError):
            bad.get("/v1/models", cast_to=object)


def test_anthropic_clients_get_anthropics_error_body_on_shared_routes(client):
    """``/v1/models`` is both APIs' route: a request with ``anthropic-version`` (every
    ``anthropic`` SDK call) gets Anthropic's error body there (and on unknown paths), so
    ``models.retrieve`` of an unknown id raises the SDK's NotFoundError with the message
    (it was OpenAI's body: the SDK showed the raw JSON); OpenAI clients keep OpenAI's."""
    import anthropic

    sdk = anthropic.Anthropic(base_url="http://testserver", http_client=client, max_retries=0, api_key=KEY)
    assert sdk.models.retrieve("m").id == "m"
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.models.retrieve("no-such-model")
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        anthropic.Anthropic(base_url="http://testserver", http_client=client, max_retries=0,
                            api_key="wrong").models.list()
    assert unauthorized.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as bad_page:
        sdk.models.list(limit=0)
    assert bad_page.value.body["error"]["type"] == "invalid_request_error"
    head = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    for method, path in (("GET", "/v1/no-such-route"), ("POST", "/v1/models/m")):
        r = client.request(method, path, headers=head)
        assert r.status_code in (404, 405) and r.json()["type"] == "error", r.text
    openai_style = client.get("/v1/models/no-such-model", headers={"Authorization": f"Bearer {KEY}"})
    assert openai_style.status_code == 404 and openai_style.json()["error"]["code"] == 404


def test_405_allow_lists_every_method_of_the_path(client):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = client.post("/v1/responses/resp_x", headers=auth)
    assert r.status_code == 405 and r.headers["Allow"] == "DELETE, GET"
    err = r.json()["error"]
    assert err["code"] == 405 and "DELETE, GET" in err["message"] and "POST" in err["message"]
    assert client.put("/v1/responses/resp_x", headers=auth).headers["Allow"] == "DELETE, GET"
    # GET is the stored-completions list, a 404 (chat_completion/stored.py)
    assert client.put("/v1/chat/completions", headers=auth).headers["Allow"] == "GET, POST"
    assert client.post("/v1/models/m", headers=auth).headers["Allow"] == "GET"
    assert client.delete("/health").headers["Allow"] == "GET"


def test_openapi_shows_the_server_limits(smol_tokenizer):
    c = _client(smol_tokenizer, "--max-request-body-bytes", "123456", "--timeout-request-body", "7",
                "--max-waiting-requests", "9")
    doc = c.get("/openapi.json").json()
    limits = doc["info"]["x-llmserve-limits"]
    assert limits["max_request_body_bytes"] == {"value": 123456, "unit": "bytes", "flag": "--max-request-body-bytes",
                                                "description": limits["max_request_body_bytes"]["description"]}
    assert limits["timeout_request_body"]["value"] == 7.0 and limits["timeout_request_body"]["unit"] == "seconds"
    assert limits["max_waiting_requests"]["value"] == 9
    assert limits["max_queue_delay"]["value"] == 1.0  # the default, as the admission controller applies it
    assert limits["max_model_len"]["value"] == 64  # the served context, from the app state
    assert limits["max_prompt_chars"]["value"] >= 64 and limits["max_prompts_per_request"]["value"] == 1024
    assert limits["max_request_timeout"]["unit"] == "seconds"
    description = doc["info"]["description"]
    assert "123456 bytes (`--max-request-body-bytes`)" in description and "max_prompt_chars" in description
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert "123456 bytes" in chat["responses"]["413"]["description"]
    assert "7 seconds" in chat["responses"]["408"]["description"]
    header = next(p for p in chat["parameters"] if p["name"] == "X-Request-Timeout")
    assert header["in"] == "header" and header["schema"]["maximum"] == 86400
    assert "parameters" not in doc["paths"]["/tokenize"]["post"]  # not a deadline route


def test_deep_json_to_invocations_is_a_400(client):
    """A body nested ~450 levels deep to /invocations was a 500 (RecursionError); the one
    depth guard (json_depth.JsonDepthMiddleware) answers it, after authentication."""
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    deep = '{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + "[" * 450 + "]" * 450 + "}"
    assert client.post("/invocations", content=deep, headers={"Content-Type": "application/json"}).status_code == 401
    for body in (deep, "[" * 5000 + "]" * 5000, '{"prompt": ' + '{"a": ' * 2000 + "1" + "}" * 2000 + "}"):
        r = client.post("/invocations", content=body, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text[:300]
        assert "nested too deeply" in r.json()["error"]["message"], r.text[:300]


def test_openapi_documents_each_front_doors_own_error_body(client):
    """Anthropic's and Ollama's routes answer their own error bodies (ErrorShapeMiddleware):
    the document says so, and a real 400 there matches the documented schema."""
    import jsonschema

    doc = client.get("/openapi.json").json()
    auth = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/messages", {"model": "m", "max_tokens": "x", "messages": []}),
                       ("/api/chat", {"model": "m", "messages": "x"})):
        responses = doc["paths"][path]["post"]["responses"]
        schema = responses["400"]["content"]["application/json"]["schema"]
        assert "$ref" not in schema and "OpenAI" not in responses["400"]["description"]
        r = client.post(path, json=body, headers=auth)
        assert r.status_code == 400, r.text
        jsonschema.validate(r.json(), schema)
        with pytest.raises(jsonschema.ValidationError):  # the OpenAI body would not match
            jsonschema.validate({"error": {"message": "m", "type": "t", "param": None, "code": 400}}, schema)
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]["content"]["application/json"]
    assert chat["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}


def test_a_websocket_without_the_key_is_closed_before_it_is_accepted(client):
    from starlette.websockets import WebSocketDisconnect

    with pytest.raises(WebSocketDisconnect) as refused:
        with client.websocket_connect("/v1/realtime"):
            pass
    assert refused.value.code == 1008  # policy violation: the auth middleware's answer
    with pytest.raises(WebSocketDisconnect) as unrouted:
        with client.websocket_connect("/v1/realtime", headers={"x-api-key": KEY}):
            pass
    assert unrouted.value.code != 1008  # with the key it reaches the router (no such route)
