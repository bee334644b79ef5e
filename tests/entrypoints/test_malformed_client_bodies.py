"""Malformed bodies that the official clients' APIs answer with a 400 in their own error
shape, found by probing the running server field by field (helper h62, 2026-12-06):
before these fixes each was a 500 ``api_error`` with Python's exception text.

In process: the app over the scripted engine of test_app.py (no model runs); after every
refused body the same client is served normally, so a fault never leaves the server
unable to answer."""
from __future__ import annotations

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
