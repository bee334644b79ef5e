"""Issue 17 points 1-2 in process (the app over the scripted engine of test_app.py): the
body limit (413 JSON, Content-Length and chunked), the documented request limits (400
naming the field), the prompt-length check before tokenizing, strict booleans, text
parts without text, the JSON answer for whatever escapes a route (cancellation, a bug),
/health's JSON body and an OpenAPI document without 422."""
from __future__ import annotations

import asyncio
import logging

import pytest

from llmserve.entrypoints.openai.common import limits
from test_app import CHAT, _output, app_and_engine  # noqa: F401  (fixture)

COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 3}


def _error(r, status=400):
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.headers.get("x-request-id")
    return r.json()["error"]


def test_body_limit_answers_413_json_before_parsing(app_and_engine):  # noqa: F811
    client, engine = app_and_engine("--max-request-body-bytes", "2000")
    engine.outputs = [_output("ok", "stop")]
    big = {**COMPLETION, "prompt": "x" * 5000}
    err = _error(client.post("/v1/completions", json=big, headers={"X-Request-Id": "big-1"}), 413)
    assert err["code"] == 413 and err["type"] == "RequestTooLargeError" and "2000 bytes" in err["message"]

    def chunks():  # no Content-Length: counted as it streams in
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'
    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    err = _error(r, 413)
    assert "--max-request-body-bytes" in err["message"]
    assert engine.prompts == []  # nothing reached the engine
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200  # under the limit


@pytest.mark.parametrize("field,value", [
    ("n", limits.MAX_N + 1),
    ("n", 512),  # case C31: a documented limit, answered at once
    ("stop", ["s"] * (limits.MAX_STOP_STRINGS + 1)),
    ("stop", ["x" * (limits.MAX_STOP_STRING_CHARS + 1)]),
    ("stop", "x" * (limits.MAX_STOP_STRING_CHARS + 1)),
    ("logit_bias", {str(i): 1.0 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES + 1)}),
    ("stop_token_ids", [1] * (limits.MAX_TOKEN_ID_LIST_ITEMS + 1)),
    ("bad_words", ["w"] * (limits.MAX_TOKEN_ID_LIST_ITEMS + 1)),
    ("allowed_token_ids", [1] * (limits.MAX_ALLOWED_TOKEN_IDS + 1)),
])
def test_each_list_limit_is_a_400_naming_the_field(app_and_engine, field, value):  # noqa: F811
    client, engine = app_and_engine()
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        err = _error(client.post(path, json={**body, field: value}))
        # the field as sent: an over-long string inside the stop list is stop.0
        assert err["param"] == (f"{field}.0" if isinstance(value, list) and len(value) == 1 else field), err
    assert engine.prompts == []


def test_prompt_message_and_part_counts_are_limited(app_and_engine):  # noqa: F811
    client, _ = app_and_engine()
    err = _error(client.post("/v1/completions", json={**COMPLETION,
                                                       "prompt": ["a"] * (limits.MAX_PROMPTS_PER_REQUEST + 1)}))
    assert err["param"] == "prompt" and str(limits.MAX_PROMPTS_PER_REQUEST) in err["message"]
    err = _error(client.post("/v1/completions", json={**COMPLETION, "prompt": [1] * (limits.MAX_PROMPT_TOKEN_IDS + 1)}))
    assert err["param"] == "prompt" and str(limits.MAX_PROMPT_TOKEN_IDS) in err["message"]
    many = [{"role": "user", "content": "hi"}] * (limits.MAX_MESSAGES + 1)
    err = _error(client.post("/v1/chat/completions", json={**CHAT, "messages": many}))
    assert err["param"] == "messages" and str(limits.MAX_MESSAGES) in err["message"]
    err = _error(client.post("/tokenize", json={"model": "m", "messages": many}))
    assert err["param"] == "messages"
    parts = [{"type": "text", "text": "a"}] * (limits.MAX_CONTENT_PARTS + 1)
    err = _error(client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": parts}]}))
    assert err["param"] == "messages.0.content" and str(limits.MAX_CONTENT_PARTS) in err["message"]


def test_over_long_prompt_is_refused_before_tokenizing(app_and_engine, monkeypatch):  # noqa: F811
    client, engine = app_and_engine()  # max_model_len 64
    renderer = client.app.state.openai_serving_render.renderer
    calls = []
    real_encode = renderer.tokenizer.encode
    monkeypatch.setattr(renderer.tokenizer, "encode",
                        lambda text, **k: calls.append(len(text)) or real_encode(text, **k), raising=False)
    limit = renderer.prompt_limit.limit
    assert renderer.prompt_limit.max_token_chars == 81  # SmolLM2's longest token: a newline and 80 spaces
    long = "word " * (limit // 4 + 10)
    for path, body, param in (("/v1/completions", {**COMPLETION, "prompt": long}, "prompt"),
                              ("/v1/completions", {**COMPLETION, "prompt": ["hi", long]}, "prompt"),
                              ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": long}]},
                               "messages"),
                              ("/v1/chat/completions", {**CHAT, "stream": True,
                                                        "messages": [{"role": "user", "content": long}]}, "messages"),
                              ("/tokenize", {"model": "m", "prompt": long}, "prompt"),
                              ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": [
                                  {"type": "text", "text": long}]}]}, "messages")):
        err = _error(client.post(path, json=body))
        assert err["param"] == param and "64" in err["message"] and "cannot fit" in err["message"], err
    assert all(n < 1000 for n in calls), calls  # "hi" of the batch may be tokenized; the long ones never
    assert not any(len(p.get("prompt", "")) > 1000 for p in engine.prompts)
    # whitespace counts (issue 26 point 4): runs of every kind, in every route that
    # tokenizes user text, are refused without tokenizing
    calls.clear()
    for ws in (" ", "\n", "\t", "\u3000"):
        pad = "a" + ws * (limit + 10)
        for path, body, param in (("/v1/completions", {**COMPLETION, "prompt": pad}, "prompt"),
                                  ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user",
                                                                                  "content": "a" + pad}]}, "messages"),
                                  ("/tokenize", {"model": "m", "prompt": pad}, "prompt"),
                                  ("/v1/responses", {"model": "m", "input": pad}, "input")):
            err = _error(client.post(path, json=body))
            assert err["param"] == param and "cannot fit" in err["message"], (path, err)
    assert calls == []
    # a run of whitespace that fits is still tokenized: the bound never refuses a fitting prompt
    r = client.post("/tokenize", json={"model": "m", "prompt": "a" + " " * 2000})
    assert r.status_code == 200 and 0 < r.json()["count"] < 64
    # leading/trailing whitespace of a message (often trimmed by templates) is not held against it
    r = client.post("/tokenize", json={"model": "m", "messages": [{"role": "user", "content": " " * (limit + 10)
                                                                   + "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"  # template keeps it: rendered text checked
    # a prompt under the always-tokenized floor gets the engine's exact count (here: /tokenize counts)
    r = client.post("/tokenize", json={"model": "m", "prompt": "hello " * 500})
    assert r.status_code == 200 and r.json()["count"] >= 500


def test_prompt_char_limit_bound():
    lim = limits.PromptCharLimit(max_model_len=8192, max_token_chars=80)
    assert lim.limit == 8192 * 80
    lim.check(["x" * lim.limit], "prompt")
    with pytest.raises(ValueError):  # whitespace counts: the tokenizer sees it
        lim.check([" " * (lim.limit + 1)], "prompt")
    collapsing = limits.PromptCharLimit(max_model_len=8192, max_token_chars=80, count_whitespace=False)
    collapsing.check([" " * (lim.limit * 2)], "prompt")  # free only where the tokenizer drops it
    with pytest.raises(ValueError) as e:
        lim.check(["x" * (lim.limit + 1)], "prompt")
    assert e.value.param == "prompt" and "8192" in str(e.value)
    assert limits.non_whitespace_chars("a\u3000b\n c\xa0") == 3
    with pytest.raises(ValueError):
        limits.PromptCharLimit(0, 80)


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", CHAT, "stream"),
    ("/v1/chat/completions", CHAT, "logprobs"),
    ("/v1/completions", COMPLETION, "echo"),
    ("/v1/completions", COMPLETION, "ignore_eos"),
    ("/tokenize", {"model": "m", "prompt": "hi"}, "add_special_tokens"),
])
@pytest.mark.parametrize("value", ["yes", "true", 1, 0])
def test_booleans_are_strict(app_and_engine, path, body, field, value):  # noqa: F811
    client, _ = app_and_engine()
    err = _error(client.post(path, json={**body, field: value}))
    assert err["param"] == field and "boolean" in err["message"]


def test_text_part_without_a_string_text_names_the_text(app_and_engine):  # noqa: F811
    client, _ = app_and_engine()
    for part, words in (({"type": "text"}, "needs a `text` field"), ({"type": "text", "text": None}, "not null"),
                        ({"type": "text", "text": 5}, "must be a string, not a number")):
        for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", {"model": "m"})):
            err = _error(client.post(path, json={**body, "messages": [{"role": "user", "content": [part]}]}))
            assert err["param"] == "messages.0.content.0.text" and words in err["message"], err
            assert "not supported" not in err["message"] and "missing" not in err["message"]
    err = _error(client.post("/v1/chat/completions", json={**CHAT, "messages": [
        {"role": "user", "content": [{"type": "bogus"}]}]}))
    # an unknown part type is named by its field, not quoted back (5875630)
    assert err["param"] == "messages.0.content.0.type" and "bogus" not in err["message"], err
    assert "content part of this type is not supported" in err["message"], err


def test_unknown_fields_are_ignored_and_logged_once_per_name(app_and_engine, caplog):  # noqa: F811
    client, engine = app_and_engine()
    engine.outputs = [_output("ok", "stop")]
    with caplog.at_level(logging.WARNING, logger="llmserve.entrypoints.openai"):
        for _ in range(3):
            assert client.post("/v1/chat/completions", json={**CHAT, "zz_unknown_field_a": 1}).status_code == 200
        assert client.post("/v1/chat/completions", json={**CHAT, "zz_unknown_field_b": 1}).status_code == 200
    logged = [r.getMessage() for r in caplog.records if "zz_unknown_field" in r.getMessage()]
    assert len([m for m in logged if "zz_unknown_field_a" in m]) == 1
    assert len([m for m in logged if "zz_unknown_field_b" in m]) == 1


def test_whatever_escapes_a_route_is_json_with_the_request_id(app_and_engine, caplog):  # noqa: F811
    client, engine = app_and_engine()
    engine.fail_before = asyncio.CancelledError()  # what uvicorn does when the graceful shutdown runs out
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "cut-1"})
    err = _error(r, 503)
    assert r.headers["x-request-id"] == "cut-1" and "shutting down" in err["message"]
    engine.fail_before = RuntimeError("boom")  # a bug: 500 JSON, not plain text
    r = client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "bug-1"})
    err = _error(r, 500)
    assert r.headers["x-request-id"] == "bug-1" and "boom" in err["message"]
    engine.fail_before = None
    engine.outputs = [_output("ok", "stop")]
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_health_has_a_json_body(app_and_engine):  # noqa: F811
    client, engine = app_and_engine()
    r = client.get("/health")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json" and r.json() == {"status": "ok"}
    engine.dead = True
    assert _error(client.get("/health"), 503)["type"] == "EngineDeadError"


def test_openapi_documents_400_not_422_and_the_role_set(app_and_engine):  # noqa: F811
    client, _ = app_and_engine()
    doc = client.get("/openapi.json").json()
    from llmserve.entrypoints.openai.api_server import ERROR_SHAPES

    def error_schema_ok(schema: dict, path: str) -> bool:
        if any(shape.covers(path) for shape in ERROR_SHAPES):  # Anthropic's / Ollama's own body
            return "error" in schema.get("required", ())
        return schema["$ref"].endswith("/ErrorResponse")

    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (path, method)
            assert error_schema_ok(op["responses"]["default"]["content"]["application/json"]["schema"], path)
            if method == "post":
                for code in ("400", "413"):
                    assert error_schema_ok(op["responses"][code]["content"]["application/json"]["schema"],
                                           path), (path, code)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    health = doc["paths"]["/health"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert health["$ref"].endswith("/HealthResponse")
    role = doc["components"]["schemas"]["ChatMessageParam"]["properties"]["role"]
    # OpenAI's six, or a plain custom name that the model's chat template must name (checked at render)
    enums = [s.get("enum") for s in role["anyOf"] if "enum" in s]
    assert set(enums[0]) == {"system", "developer", "user", "assistant", "tool", "function"}, role
    assert any(s.get("pattern") for s in role["anyOf"]), role
    stop = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["stop"]
    assert f'"maxItems": {limits.MAX_STOP_STRINGS}' in __import__("json").dumps(stop)
    chat_ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert "text/event-stream" in chat_ok


def test_vocabulary_pass_decodes_each_token_as_transformers_does():
    """The start-up vocabulary pass decodes all ids in the Rust backend in one call; its
    texts equal transformers' ``batch_decode`` of each id (SmolLM2's 49k tokens), and a
    tokenizer without a backend takes transformers' path."""
    from llmserve.model_loader import resolve_model
    from llmserve.tokenizer import get_tokenizer

    r = resolve_model("SmolLM2-135M-Instruct")
    tok = get_tokenizer(r.path, r.gguf_file)
    ids = sorted(set(tok.get_vocab().values()))
    expected = tok.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert limits._decode_each(tok, ids) == expected

    class NoBackend:
        def batch_decode(self, seqs, **kw):
            return [f"<{s[0]}>" for s in seqs]

    assert limits._decode_each(NoBackend(), [3, 10]) == ["<3>", "<10>"]
    assert limits.longest_token_chars(tok) == 81  # a newline and 80 spaces
