"""vLLM's frontend flags on the app, with the scripted engine of test_app.py (no model):
usage options, /load and /tokenizer_info when off, a function --middleware, the chat
role of a continued message, token-id logprob tokens, and the uvicorn arguments."""
from __future__ import annotations

import argparse
import asyncio
import ssl
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from llmserve.entrypoints.openai.api_server import build_app, init_app_state
from llmserve.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from llmserve.entrypoints.openai.common.usage import UsageOptions
from llmserve.entrypoints.openai.frontend import TokenIdFormatter, uvicorn_kwargs
from llmserve.outputs import CompletionOutput, RequestOutput
from test_app import ScriptedEngine

SEEN = []


async def record_path(request, call_next):
    """A function --middleware (vLLM: app.middleware("http"))."""
    SEEN.append(request.url.path)
    response = await call_next(request)
    response.headers["X-Seen"] = "1"
    return response


def _args(*flags):
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(list(flags))
    validate_parsed_serve_args(args)
    return args


@pytest.fixture
def make_app(smol_tokenizer):
    def make(*flags):
        args = _args(*flags)
        engine = ScriptedEngine(smol_tokenizer)
        app = build_app(args)
        asyncio.run(init_app_state(engine, app.state, args))
        return TestClient(app), engine
    return make


def _out(text, finish="stop", cached=0):
    return RequestOutput("r", None, list(range(40)), None, [CompletionOutput(0, text, [5], None, None, finish)],
                         finish is not None, num_cached_tokens=cached)


def test_usage_options():
    assert UsageOptions().stream_usage(None) == (False, False)
    assert UsageOptions(enable_force_include_usage=True).stream_usage(None) == (True, False)
    opts = SimpleNamespace(include_usage=False, continuous_usage_stats=True)
    assert UsageOptions().stream_usage(opts) == (False, False)
    assert UsageOptions(enable_force_include_usage=True).stream_usage(opts) == (True, True)
    assert UsageOptions().usage(10, 3, 8).prompt_tokens_details is None
    u = UsageOptions(enable_prompt_tokens_details=True).usage(10, 3, 8)
    assert (u.total_tokens, u.prompt_tokens_details.cached_tokens) == (13, 8)


def test_flags_off_by_default(make_app):
    client, engine = make_app()
    engine.outputs = [_out("ok", cached=32)]
    body = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}).json()
    assert body["usage"].get("prompt_tokens_details") is None
    assert client.get("/tokenizer_info").status_code == 404
    assert client.get("/load").json() == {"server_load": 0}
    assert client.get("/openapi.json").status_code == 200


def test_cached_tokens_sum_over_prompts(make_app):
    client, engine = make_app("--enable-prompt-tokens-details")
    engine.outputs = [_out("ok", cached=32)]
    body = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "max_tokens": 2}).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}


def test_function_middleware_and_bad_middleware(make_app):
    SEEN.clear()
    client, _ = make_app("--middleware", f"{__name__}.record_path")
    r = client.get("/version")
    assert r.headers["x-seen"] == "1" and SEEN == ["/version"]
    with pytest.raises(ValueError, match="--middleware: cannot import 'nowhere.thing'"):
        make_app("--middleware", "nowhere.thing")


def test_response_role_keeps_a_continued_messages_role(make_app):
    client, engine = make_app("--response-role", "bot")
    engine.outputs = [_out("ok")]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    body = client.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 2,
                                                     "add_generation_prompt": False,
                                                     "continue_final_message": True}).json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    body = client.post("/v1/chat/completions", json={"model": "m", "messages": msgs[:1], "max_tokens": 2}).json()
    assert body["choices"][0]["message"]["role"] == "bot"


def test_token_id_formatter(smol_tokenizer):
    fmt = TokenIdFormatter(smol_tokenizer)
    assert fmt.text(42) == "token_id:42"


def test_uvicorn_kwargs_of_ssl_uds_and_h11(tmp_path):
    # defaults: uvicorn's keep-alive (5 s) and its h11 protocol with the 30 s header deadline
    kw = uvicorn_kwargs(_args())
    assert kw.pop("timeout_keep_alive") == 5.0 and kw.pop("http").__name__ == "HeaderTimeoutH11Protocol"
    assert kw == {}
    assert uvicorn_kwargs(_args("--timeout-request-headers", "0", "--timeout-keep-alive", "2",
                                "--max-connections-per-client", "0")) == {"timeout_keep_alive": 2.0}
    # the per-address connection bound alone also needs the protocol
    assert uvicorn_kwargs(_args("--timeout-request-headers", "0"))["http"].__name__ == "HeaderTimeoutH11Protocol"
    kw = uvicorn_kwargs(_args("--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-ca-certs", "ca.pem",
                              "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)), "--uds", str(tmp_path / "s.sock"),
                              "--h11-max-incomplete-event-size", "1000", "--timeout-request-headers", "0",
                              "--max-connections-per-client", "0"))
    assert kw == {"ssl_keyfile": "k.pem", "ssl_certfile": "c.pem", "ssl_ca_certs": "ca.pem",
                  "ssl_cert_reqs": int(ssl.CERT_REQUIRED), "uds": str(tmp_path / "s.sock"), "http": "h11",
                  "h11_max_incomplete_event_size": 1000, "timeout_keep_alive": 5.0}


def test_several_api_keys(make_app):
    client, engine = make_app("--api-key", "k1", "k2")
    for key, status in (("k1", 200), ("k2", 200), ("k3", 401)):
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == status
    assert _args("--api-key", "only").api_key == "only"
