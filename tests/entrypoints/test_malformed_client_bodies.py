"""Malformed bodies that the official clients' APIs answer with a 400 in their own error
shape, found by probing the running server field by field (helper h62, 2026-12-06):
before these fixes each was a 500 ``api_error`` with Python's exception text.

In process: the app over the scripted engine of test_app.py (no model runs); after every
refused body the same client is served normally, so a fault never leaves the server
unable to answer."""
from __future__ import annotations

import re

import pytest
from test_app import _output, app_and_engine  # noqa: F401  (fixture)

ANTHROPIC = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
# every value a JSON block can take that is not an object, and objects whose `type` is
# not a string (lists and objects are unhashable: they broke the `in frozenset` lookups)
NOT_A_BLOCK = [None, True, 0, -1, 1.5, "", "text", [], [1, "a"]]
BAD_TYPE = [None, True, 0, 1.5, [], ["text"], {}, {"a": 1}]


def _anthropic_error(r, param_words):
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert param_words in body["error"]["message"], body
    return body


def _tool_turns(result_content):
    """A tool round trip whose tool_result carries ``result_content``."""
    return [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result_content}]}]


def _placements(block):
    """``(path, body)``: ``block`` in every place a content block may stand."""
    return [
        ("messages.0.content.0", {**ANTHROPIC, "messages": [{"role": "user", "content": [block]}]}),
        ("messages.1.content.0", {**ANTHROPIC, "messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": [block]}]}),
        ("system.0", {**ANTHROPIC, "system": [block]}),
        ("messages.0.content.0", {**ANTHROPIC, "messages": [{"role": "system", "content": [block]},
                                                            {"role": "user", "content": "hi"}]}),
        ("messages.2.content.0.content.0", {**ANTHROPIC, "messages": _tool_turns([block])}),
    ]


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("kind", BAD_TYPE)
def test_a_block_type_that_is_not_a_string_is_a_400_naming_it(app_and_engine, route, kind):  # noqa: F811
    client, engine = app_and_engine()
    block = {"text": "hi"} if kind is None else {"type": kind, "text": "hi"}
    for path, body in _placements(block):
        _anthropic_error(client.post(route, json=body), f"{path}.type")
    assert engine.prompts == []
    engine.outputs = [_output("ok", "stop")]
    assert client.post(route, json=ANTHROPIC).status_code == 200


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("item", NOT_A_BLOCK)
def test_a_tool_result_content_item_that_is_not_a_block_is_a_400(app_and_engine, route, item):  # noqa: F811
    client, engine = app_and_engine()
    r = client.post(route, json={**ANTHROPIC, "messages": _tool_turns([{"type": "text", "text": "ok"}, item])})
    _anthropic_error(r, "messages.2.content.0.content.1")
    assert engine.prompts == []
    engine.outputs = [_output("ok", "stop")]
    assert client.post(route, json=ANTHROPIC).status_code == 200


RESPONSES = {"model": "m", "input": "hi", "max_output_tokens": 3}


def _openai_error(r, words, param="input"):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err) and err["param"] == param, err
    assert words in err["message"], err
    return err


@pytest.mark.parametrize("kind", [[], ["input_text"], {}, {"a": 1}])
def test_responses_input_part_type_or_role_that_is_unhashable_is_a_400(app_and_engine, kind):  # noqa: F811
    client, engine = app_and_engine()
    part = {**RESPONSES, "input": [{"role": "user", "content": [{"type": kind, "text": "hi"}]}]}
    _openai_error(client.post("/v1/responses", json=part), "input[0].content[0]", "input[0].content[0].type")
    role = {**RESPONSES, "input": [{"role": kind, "content": "hi"}]}
    # a role that is no string is named by the item's field since input items' fields are
    # type-checked (input_items.ITEM_FIELD_TYPES)
    _openai_error(client.post("/v1/responses", json=role), "input.0.role: must be a string", "input.0.role")
    assert engine.prompts == []
    engine.outputs = [_output("ok", "stop")]
    assert client.post("/v1/responses", json=RESPONSES).status_code == 200


@pytest.mark.parametrize("kind", [["input_text"], {"a": "SECRET"}, "SECRET-" + "x" * 5000])
def test_an_unsupported_part_type_is_not_quoted_back(app_and_engine, kind):  # noqa: F811
    """A content part type the model cannot take is a 400 naming the field, on chat and on
    Responses, without the client's value in the message (it may be anything, of any size);
    a part type the OpenAI APIs define (image_url) is still named."""
    client, engine = app_and_engine()
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": kind, "text": "hi"}]}], "max_tokens": 3}
    resp = {**RESPONSES, "input": [{"role": "user", "content": [{"type": kind, "text": "hi"}]}]}
    for path, body in (("/v1/chat/completions", chat), ("/v1/responses", resp)):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"].endswith(".type"), r.text
        assert "SECRET" not in r.text and len(r.text) < 1000, r.text[:300]
    known = {**chat, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert "'image_url'" in client.post("/v1/chat/completions", json=known).json()["error"]["message"]
    assert engine.prompts == []


# h11's field-value grammar (RFC 9110 field-content): visible ASCII, inner spaces/tabs
# only, and obs-text bytes; uvicorn refuses to send anything else and drops the connection
FIELD_VALUE = re.compile(r"([\x21-\x7e](?:[ \t]*[\x21-\x7e])*)?")
HOSTILE_LABELS = ["a\nb", "x\r\nSet-Cookie: s=1", "\x00\x1b[31m", "中文", "trailing ", "a,b", "100%", "é", ""]


@pytest.mark.parametrize("stream", [False, True])
def test_dropped_tools_header_carries_any_tool_name_and_the_answer_arrives(app_and_engine, stream):  # noqa: F811
    from urllib.parse import unquote

    client, engine = app_and_engine()
    tools = [{"type": "web_search", "name": name} for name in HOSTILE_LABELS] + [{"type": "a\nb"}]
    engine.outputs = [_output("ok", "stop")]
    r = client.post("/v1/responses", json={**RESPONSES, "tools": tools, "stream": stream})
    assert r.status_code == 200, r.text
    value = r.headers["x-llmserve-dropped-tools"]
    assert FIELD_VALUE.fullmatch(value), value
    want = [f"web_search:{name}" if name else "web_search" for name in HOSTILE_LABELS] + ["a\nb"]
    assert [unquote(label) for label in value.split(",")] == want
    assert "ok" in r.text


def test_dropped_tools_header_is_bounded_without_cutting_an_escape():
    from urllib.parse import unquote

    from llmserve.entrypoints.openai.responses.serving import MAX_DROPPED_TOOLS_HEADER_CHARS, dropped_tools_header

    for pad in range(3):  # the limit falls on each byte of a %XX escape in turn
        value = dropped_tools_header(["a" * (MAX_DROPPED_TOOLS_HEADER_CHARS - 2 + pad) + "\n" * 10])
        assert len(value) <= MAX_DROPPED_TOOLS_HEADER_CHARS and FIELD_VALUE.fullmatch(value)
        assert re.fullmatch(r"a+(%0A)*", value) and unquote(value).startswith("a")


def test_anthropic_sdk_lists_and_retrieves_models_with_every_required_field(app_and_engine):  # noqa: F811
    # the SDK's ModelInfo requires type, id, display_name and created_at (a datetime);
    # OpenAI's model list had none but id, so they came back None (constructed unvalidated)
    import datetime

    import anthropic
    import openai

    client, _ = app_and_engine()
    sdk = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=client, max_retries=0)
    page = sdk.models.list()
    assert [m.id for m in page.data] == ["m"] and page.has_more is False
    assert page.first_id == page.last_id == "m"
    for info in (page.data[0], sdk.models.retrieve("m")):
        assert info.type == "model" and info.display_name == "m"
        assert isinstance(info.created_at, datetime.datetime) and info.created_at.tzinfo is not None
        anthropic.types.ModelInfo.model_validate(info.model_dump())  # validated, not just constructed
    # the same body still parses as OpenAI's list, with the same creation time
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
    card = oa.models.list().data[0]
    assert card.id == "m" and card.object == "model"
    assert datetime.datetime.fromtimestamp(card.created, datetime.timezone.utc) == page.data[0].created_at


OLLAMA_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}


@pytest.mark.parametrize("stop,words", [
    (["y" * 1025], "at most 1024 characters"),  # a list: was "Input should be a valid string"
    (["ok", "y" * 5000], "at most 1024 characters"),
    ("y" * 1025, "at most 1024 characters"),
    (["s"] * 65, "at most 64 items"),  # was "Input should be a valid string" too
])
@pytest.mark.parametrize("route", ["/api/chat", "/api/generate"])
def test_ollama_stop_errors_say_why_not_the_other_union_branch(app_and_engine, route, stop, words):  # noqa: F811
    client, engine = app_and_engine()
    body = OLLAMA_CHAT if route == "/api/chat" else {"model": "m", "prompt": "hi", "stream": False}
    r = client.post(route, json={**body, "options": {"num_predict": 3, "stop": stop}})
    assert r.status_code == 400 and list(r.json()) == ["error"], r.text
    message = r.json()["error"]
    assert message.startswith("options.stop: ") and words in message, message
    assert "valid string" not in message
    assert engine.prompts == []
    engine.outputs = [_output("ok", "stop")]
    assert client.post(route, json={**body, "options": {"num_predict": 3, "stop": ["y" * 1024]}}).status_code == 200


@pytest.mark.parametrize("route,body,message_of", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, lambda j: j["error"]["message"]),
    ("/v1/completions", {"prompt": "hi"}, lambda j: j["error"]["message"]),
    ("/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
     lambda j: j["error"]["message"]),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, lambda j: j["error"]),
    ("/api/show", {}, lambda j: j["error"]),
])
def test_an_unknown_model_name_is_echoed_bounded(app_and_engine, route, body, message_of):  # noqa: F811
    client, _ = app_and_engine()
    r = client.post(route, json={**body, "model": "q" * 100_000})
    assert r.status_code == 404, r.text[:300]
    message = message_of(r.json())
    assert len(r.content) < 2000 and "q" * 256 + "... (100000 characters)" in message, message[:400]
    short = client.post(route, json={**body, "model": "nope:\u202e\n"})  # a short name is echoed whole
    quoted = "'nope:\u202e\n'" if route.startswith("/api/") else "`nope:\u202e\n`"  # Ollama's quotes
    assert short.status_code == 404 and quoted in message_of(short.json())


def _surrogate_placements(bad):
    """``(path, body)``: the text ``bad`` in every kind of text field of a messages
    request (contents as strings and blocks, a mid-conversation system message, system,
    a tool_use input, a tool_result, a tool's description)."""
    user = {"role": "user", "content": "hi"}
    turns = _tool_turns("sunny")
    use_input = [turns[0], {**turns[1], "content": [{**turns[1]["content"][0], "input": {"q": bad}}]}, turns[2]]
    return [
        ("messages.0.content", {**ANTHROPIC, "messages": [{"role": "user", "content": bad}]}),
        ("messages.0.content.1.text", {**ANTHROPIC, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "ok"}, {"type": "text", "text": bad}]}]}),
        ("system", {**ANTHROPIC, "system": bad}),
        ("system.0.text", {**ANTHROPIC, "system": [{"type": "text", "text": bad}]}),
        ("messages.1.content", {**ANTHROPIC, "messages": [user, {"role": "system", "content": bad}, user]}),
        ("messages.1.content.0.input.q", {**ANTHROPIC, "messages": use_input}),
        ("messages.2.content.0.content", {**ANTHROPIC, "messages": _tool_turns(bad)}),
        ("tools.0.description", {**ANTHROPIC, "tools": [
            {"name": "w", "description": bad, "input_schema": {"type": "object"}}]}),
    ]


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_lone_surrogate_is_a_400_naming_its_field_in_the_openai_routes_words(app_and_engine, route):  # noqa: F811
    # JSON's "\ud800" escape is valid JSON but no tokenizer can encode it: the 400 was
    # Python's "'utf-8' codec can't encode character '\ud800' ... surrogates not allowed",
    # naming no field (the prompt's byte bound encoded the whole request). Raw bodies: the
    # anthropic SDK cannot send such text (its JSON encoder raises UnicodeEncodeError).
    import json

    client, engine = app_and_engine()
    bad = "ab\ud800x"
    for path, body in _surrogate_placements(bad):
        r = client.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        message = _anthropic_error(r, path)["error"]["message"]
        assert message == (f"{path}: the text contains a lone surrogate code point U+D800 at position 2, "
                           "which is not valid Unicode; send UTF-8 text."), message
    assert engine.prompts == []
    engine.outputs = [_output("ok", "stop")]
    assert client.post(route, json=ANTHROPIC).status_code == 200


@pytest.mark.parametrize("route,fields", [
    ("/v1/messages", "model: field required; messages: field required; max_tokens: field required"),
    ("/v1/messages/count_tokens", "model: field required; messages: field required"),
    ("/v1/chat/completions", "messages: field required"),  # `model` may be left out here (vLLM's rule)
])
def test_an_empty_object_body_names_each_missing_field_and_nothing_else(app_and_engine, route, fields):  # noqa: F811
    # `{}` was "The request body must be a JSON object with the request fields (Field
    # required).; messages: ...": the missing `model` looked like pydantic's "model" label
    client, _ = app_and_engine()
    r = client.post(route, json={})
    assert r.status_code == 400, r.text
    body = r.json()
    message = body["error"]["message"]
    assert message == fields, message
    if route.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["param"] == "messages"
    # a body that is not an object still says so
    for not_object in ([], "x", 3):
        r = client.post(route, json=not_object)
        assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route,required", [
    ("/v1/chat/completions", ["messages"]), ("/v1/completions", ["prompt"]), ("/v1/responses", ["input"]),
    ("/v1/embeddings", ["input"]), ("/v1/messages", ["model", "messages", "max_tokens"]),
])
def test_a_body_that_is_empty_or_not_an_object_names_the_required_fields(app_and_engine, route, required):  # noqa: F811
    """An empty body, ``null``, ``[]`` or ``"x"`` said "...request fields (Field required)."
    or "(Input should be a valid dictionary...)": which fields were missing went unsaid. Now
    each names the route's required fields, in the route's own error body, and ``param``
    is the first, as for ``{}``."""
    client, engine = app_and_engine()
    names = ", ".join(f"`{n}`" for n in required)
    for raw, what in ((b"", "is empty: send a JSON object with the request fields"),
                      (b"null", "must be a JSON object with the request fields, not null"),
                      (b"[]", "must be a JSON object with the request fields, not an array"),
                      (b'"x"', "must be a JSON object with the request fields, not a string")):
        r = client.post(route, content=raw, headers={"content-type": "application/json"})
        expected = f"The request body {what} (required: {names})."
        if route == "/v1/messages":
            assert _anthropic_error(r, expected)["error"]["message"] == expected
        else:
            assert r.status_code == 400 and r.json()["error"]["message"] == expected, r.text
            assert r.json()["error"]["param"] == required[0]
    assert engine.prompts == []
