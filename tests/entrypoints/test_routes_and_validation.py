"""Issue 10: routes users expect (``GET /v1/models/{id}``, SageMaker's ``/invocations``),
validation error bodies (vLLM's location format, small, no echo of the body), no 5xx
for unsupported features. The app runs over the scripted engine stub of test_app."""
from __future__ import annotations

import importlib
import json
import re

from test_app import CHAT, _output, app_and_engine  # noqa: F401 (fixture)


def test_retrieve_model(app_and_engine):  # noqa: F811
    client, _ = app_and_engine()
    card = client.get("/v1/models/m").json()
    assert (card["id"], card["object"], card["max_model_len"]) == ("m", "model", 64)
    r = client.get("/v1/models/x")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["message"].startswith("The model `x` does not exist.")
    assert (err["type"], err["code"], err["param"]) == ("NotFoundError", 404, "model")
    assert client.get("/v1/models/org/x").status_code == 404


def test_invocations_route_by_shape(app_and_engine):  # noqa: F811
    client, engine = app_and_engine()
    engine.outputs = [_output("Hello", "stop")]
    chat = client.post("/invocations", json=CHAT).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == "Hello"
    assert engine.prompts[-1]["prompt"].startswith("<|im_start|>")  # through the chat template
    cmpl = client.post("/invocations", json={"prompt": "hi", "max_tokens": 3}).json()
    assert cmpl["object"] == "text_completion" and cmpl["choices"][0]["text"] == "Hello"
    assert engine.prompts[-1]["prompt"] == "hi"
    r = client.post("/invocations", json={"input": "hi"})  # embeddings: the endpoint's own answer
    assert r.status_code == client.post("/v1/embeddings", json={"input": "hi"}).status_code
    assert 400 <= r.status_code < 500
    r = client.post("/invocations", json={"messages": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/invocations", json={"foo": 1})
    assert r.status_code == 400 and "'messages' (ChatCompletionRequest)" in r.json()["error"]["message"]
    r = client.post("/invocations", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert client.get("/ping").status_code == 200


def test_validation_errors_are_small_and_never_echo_the_body(app_and_engine):  # noqa: F811
    client, _ = app_and_engine()
    # a 150 KB invalid body: 4,000 list items of the wrong type (under the 4,096-message limit)
    body = {"model": "m", "messages": [{"role": "user", "content": 12345678} for _ in range(4000)]}
    raw = json.dumps(body)
    assert len(raw) > 150_000
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert len(r.content) < 4096
    err = r.json()["error"]
    assert err["param"] == "messages.0.content"
    assert err["message"].startswith("messages.0.content: must be a string or a list of objects; "
                                     "messages.1.content: must be"), err["message"]
    assert "12345678" not in err["message"]
    assert err["message"].endswith("more errors")
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": "lots"})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "max_tokens: must be an integer, not a string",
                                 "type": "BadRequestError", "param": "max_tokens", "code": 400}


def test_logit_bias_keys_reach_the_engine_as_sent(app_and_engine):  # noqa: F811
    # The InputProcessor (tests/engine/test_logit_bias.py) names the keys that are not
    # token ids with the vocabulary size; the server clamps values and passes keys through.
    client, engine = app_and_engine()
    engine.outputs = [_output("Hi", "stop")]
    r = client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"a": 1, "5": 1e6, "b c": -300}})
    assert r.status_code == 200
    assert engine.params[-1].logit_bias == {"a": 1.0, 5: 100.0, "b c": -100.0}


def test_stream_options_without_include_usage_send_no_usage(app_and_engine):  # noqa: F811
    client, engine = app_and_engine()
    engine.outputs = [_output("Hi", "stop")]
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "m", "prompt": "x"})):
        for opts in ({}, {"continuous_usage_stats": True}):
            r = client.post(path, json={**body, "stream": True, "stream_options": opts})
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            assert events and all(e.get("usage") is None for e in events), (path, opts)
        r = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 1


def test_score_with_one_side_names_every_accepted_pairing(app_and_engine):  # noqa: F811
    """Fresh-user trial: /score with ``queries`` alone answered "`documents` is required
    with `queries`", hiding ``items``. The 400 names every field that pairs with the given
    one, then every pairing of vLLM's ScoreRequest forms (checked before any engine call)."""
    client, _ = app_and_engine()
    pairings = "`text_1`/`text_2`, `queries`/`documents`, `queries`/`items` or `data_1`/`data_2`"
    for body, param, partners in (({"queries": "q"}, "documents", "`documents` or `items`"),
                                  ({"items": ["a"]}, "queries", "`queries`"),
                                  ({"text_1": "a"}, "text_2", "`text_2`"),
                                  ({"data_2": ["b"]}, "data_1", "`data_1`")):
        r = client.post("/score", json={"model": "m", **body})
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["param"] == param, (body, err)
        given = next(iter(body))
        assert f"`{given}` needs the other side, {partners}:" in err["message"], err
        assert pairings in err["message"], err
    none = client.post("/v1/score", json={"model": "m"}).json()["error"]
    assert none["param"] == "text_1" and pairings in none["message"]


# pydantic-core's names for union members and schemas, which a client never wrote
PYDANTIC_TOKENS = re.compile(r"constrained-|function-(after|before|wrap|plain)|tagged-union|union\[|json-or-python|"
                             r"lax-or-strict|nullable\[|literal\[|(list|dict|set|tuple)\[|is-instance|Value error")
ROUTE_MODELS = {  # route: (its pydantic request model, a valid body)
    "/v1/chat/completions": ("llmserve.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest", CHAT),
    "/v1/completions": ("llmserve.entrypoints.openai.completion.protocol:CompletionRequest",
                        {"model": "m", "prompt": "hi", "max_tokens": 3}),
    "/v1/responses": ("llmserve.entrypoints.openai.responses.protocol:ResponsesRequest",
                      {"model": "m", "input": "hi", "max_output_tokens": 3}),
    "/v1/embeddings": ("llmserve.entrypoints.openai.embeddings.protocol:EmbeddingRequest", {"model": "m", "input": "hi"}),
    "/v1/messages": ("llmserve.entrypoints.anthropic.protocol:AnthropicMessagesRequest",
                     {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}),
}


def _request_model(spec):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _message(r):
    err = r.json()["error"]
    return err["message"], err.get("param")


def test_validation_errors_name_the_field_as_sent_and_say_what_it_accepts(app_and_engine):  # noqa: F811
    """No pydantic union-member label (``stop.constrained-str``, ``list[...]``, a tag) in
    a message or param: the field as the client wrote it, the problem of the member that
    matched best, or what the field accepts when none did."""
    client, engine = app_and_engine()
    cases = [  # (route, field, value, param, message)
        ("/v1/chat/completions", "stop", "y" * 2000, "stop", "stop: string should have at most 1024 characters"),
        ("/v1/completions", "stop", 5, "stop", "stop: must be a string or a list of strings"),
        ("/v1/responses", "stop", ["ok", 5], "stop.1", "stop.1: must be a string, not an integer"),
        ("/v1/chat/completions", "messages", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                              {"role": "user", "content": 12}],
         "messages.2.content", "messages.2.content: must be a string or a list of objects"),
        ("/v1/completions", "prompt", {"a": 1}, "prompt",
         "prompt: must be a list of integers, a list of lists of integers, a string or a list of strings"),
        ("/v1/chat/completions", "early_stopping", "soon", "early_stopping", "early_stopping: must be a boolean or 'never'"),
        ("/v1/embeddings", "input", True, "input", "input: must be a string, a list of strings, a list of integers "
                                                   "or a list of lists of integers"),
        ("/v1/messages", "system", 5, None, "system: must be a string or a list of objects"),
    ]
    for route, field, value, param, message in cases:
        r = client.post(route, json={**ROUTE_MODELS[route][1], field: value})
        assert r.status_code == 400 and _message(r) == (message, param), (route, r.text)
    # every top-level field of each route, sent with values of the wrong shape
    engine.outputs = [_output("x", "stop")]  # for the values a field accepts
    for route, (spec, body) in ROUTE_MODELS.items():
        model = _request_model(spec)
        for name, info in model.model_fields.items():
            for value in (123456789, [{"x": 1}]):
                r = client.post(route, json={**body, info.alias or name: value})
                assert r.status_code in (200, 400, 404), (route, name, r.status_code)
                if r.status_code == 400:
                    message, param = _message(r)
                    assert not PYDANTIC_TOKENS.search(message + str(param)), (route, name, value, message, param)


def test_a_list_of_a_union_names_each_member_in_the_plural():
    """Fresh-user trial: ``{"prompt": 5}`` on llama-server's /completion was told it "must be
    a string or a list of integer, a string or a list of integer or a stringss" (the plural
    of the phrase "an integer or a string"). Each member of a union inside a list is made
    plural on its own."""
    import pytest
    from pydantic import ValidationError

    from llmserve.entrypoints.openai.infill.protocol import InfillRequest, LlamaCompletionRequest
    from llmserve.entrypoints.openai.validation_errors import problems_of, resolve_unions

    cases = [(LlamaCompletionRequest, {"prompt": 5}, "must be a string or a list of integers, strings or lists of "
              "integers or strings"),
             (LlamaCompletionRequest, {"prompt": [1.5, 2]}, "must be an integer, a string or a list of integers or "
              "strings"),
             (InfillRequest, {"input_prefix": 5, "input_suffix": "x"}, "must be a string or a list of integers or "
              "strings")]
    for cls, body, message in cases:
        with pytest.raises(ValidationError) as e:
            cls.model_validate(body)
        assert [p.msg for p in resolve_unions(problems_of(e.value.errors(), body))] == [message]


def test_a_json_body_sent_as_text_is_told_the_content_type(app_and_engine):  # noqa: F811
    """Fresh-user trial: valid chat JSON sent with ``Content-Type: text/plain`` got pydantic's
    "valid dictionary" message. The 400 says the body must be sent as application/json and
    names the type received; Ollama's routes read JSON from any content type, as Ollama does."""
    client, engine = app_and_engine()
    raw = json.dumps(CHAT)
    for headers, received in (({"content-type": "text/plain"}, "(the Content-Type received: `text/plain`)"),
                              ({}, "(the Content-Type received: none)")):
        r = client.post("/v1/chat/completions", content=raw, headers=headers)
        assert r.status_code == 400, r.text
        message, param = _message(r)
        assert message == ("The request body must be JSON sent with `Content-Type: application/json` "
                           + received + "."), message
        assert param is None
    engine.outputs = [_output("Hi", "stop")]
    ollama = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    r = client.post("/api/chat", content=json.dumps(ollama), headers={"content-type": "text/plain"})
    assert r.status_code == 200 and r.json()["message"]["content"] == "Hi", r.text


def test_a_body_that_is_not_utf8_is_told_so(app_and_engine):  # noqa: F811
    """Fresh-user trial: a chat body with the bytes ``\\xff\\xfe`` in a message answered
    FastAPI's bare "There was an error parsing the body" (on /v1 and /v1/messages). The 400
    names the bad byte and its offset, in each API's error body, and nothing reaches the engine."""
    client, engine = app_and_engine()
    head = b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"'
    raw = head + b'\xff\xfe"}]}'
    expected = (f"The request body is not valid UTF-8: byte 0xff at offset {len(head)} "
                "(invalid start byte); send JSON encoded as UTF-8.")
    seen = len(engine.prompts)
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and _message(r) == (expected, None), r.text
    r = client.post("/v1/messages", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"] == {
        "type": "invalid_request_error", "message": expected}, r.text
    assert len(engine.prompts) == seen
    # a body opening with \xff\xfe (UTF-16's byte-order mark): json.loads read it as UTF-16
    # and the 400 named byte 0x38 at offset 10; the UTF-8 fault is the first byte
    for route in ("/v1/completions", "/v1/messages", "/tokenize"):
        r = client.post(route, content=b"\xff\xfe not utf8", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "byte 0xff at offset 0 (invalid start byte)" in r.text, (route, r.text)


def test_chat_fields_of_the_wrong_kind_are_400s_naming_them(app_and_engine):  # noqa: F811
    """Fresh-user trial: each of these was a 200 (an unknown effort passed on, a string of
    tool calls dropped, ``true`` read as 1, a role that is not OpenAI's rendered as vLLM's
    custom roles are). An integral number is an integer (``2.0``, as vLLM reads it)."""
    client, engine = app_and_engine()
    cases = [  # (route, changes to the route's body, param, message)
        ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort",
         "reasoning_effort: must be 'none', 'minimal', 'low', 'medium', 'high' or 'xhigh'"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages.0.tool_calls",
         "messages.0.tool_calls: must be a valid list"),
        ("/v1/chat/completions", {"max_tokens": True}, "max_tokens", "max_tokens: must be an integer, not a boolean"),
        ("/v1/chat/completions", {"max_completion_tokens": True}, "max_completion_tokens", None),
        ("/v1/chat/completions", {"n": True}, "n", None),
        ("/v1/chat/completions", {"seed": False}, "seed", None),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": True}, "top_logprobs", None),
        ("/v1/chat/completions", {"stop_token_ids": [2, True]}, "stop_token_ids.1", None),
        ("/v1/completions", {"logprobs": True}, "logprobs", "logprobs: must be an integer, not a boolean"),
        ("/v1/responses", {"max_output_tokens": True}, "max_output_tokens", None),
        ("/v1/embeddings", {"dimensions": True}, "dimensions", None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]},
         "messages.1.role", "messages.1.role: must be 'system', 'developer', 'user', 'assistant', 'tool' or 'function', "
         "or a custom role the model's chat template names (it names no 'wizard')."),
        ("/v1/chat/completions", {"messages": [{"role": "ipython", "content": "42"}]}, "messages.0.role",
         "messages.0.role: must be 'system', 'developer', 'user', 'assistant', 'tool' or 'function', "
         "or a custom role the model's chat template names (it names no 'ipython')."),
    ]
    for route, changes, param, message in cases:
        r = client.post(route, json={**ROUTE_MODELS[route][1], **changes})
        assert r.status_code == 400, (changes, r.text)
        got_message, got_param = _message(r)
        assert got_param == param and got_message == (message or f"{param}: must be an integer, not a boolean"), \
            (changes, got_message, got_param)
    assert engine.prompts == []
    roles = [{"role": r, "content": r} for r in ("system", "developer", "user", "assistant", "function")]
    for changes in ({"reasoning_effort": "xhigh"}, {"max_tokens": 2.0}, {"messages": roles}):
        engine.outputs = [_output("Hi", "stop")]
        r = client.post("/v1/chat/completions", json={**CHAT, **changes})
        assert r.status_code == 200, (changes, r.text)
    assert engine.params[1].max_tokens == 2
    assert "<|im_start|>function\nfunction<|im_end|>" in engine.prompts[2]["prompt"]


def test_a_value_of_the_wrong_json_type_is_a_400_naming_it_on_every_route(app_and_engine):  # noqa: F811
    """Fresh-user trial: ``"max_tokens": "5"`` was a 200 on chat (pydantic's lax mode read
    it as 5; ``"temperature": "1"``, ``"include_usage": "true"`` and ``"strict": 1``
    likewise), where OpenAI answers 400 naming the parameter. The request models and the
    objects inside them are strict: a string is not a number or a boolean, a number is
    not a boolean, on every route and at every depth, in each API's error body; an
    integer is still a number (``"temperature": 1``, the official client sends it)."""
    client, engine = app_and_engine()
    integer, number, boolean = "must be an integer, not a string", "must be a number, not a string", \
        "must be a boolean, not a string"
    cases = [  # (route, changes to the route's body, param, problem)
        ("/v1/chat/completions", {"max_tokens": "5"}, "max_tokens", integer),
        ("/v1/chat/completions", {"max_completion_tokens": "5"}, "max_completion_tokens", integer),
        ("/v1/chat/completions", {"seed": "1"}, "seed", integer),
        ("/v1/chat/completions", {"temperature": "1"}, "temperature", number),
        ("/v1/chat/completions", {"logit_bias": {"5": "1"}}, "logit_bias.5", number),
        ("/v1/chat/completions", {"stream": "true"}, "stream", boolean),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "must be a boolean, not an integer"),
        ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "true"}},
         "stream_options.include_usage", boolean),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {}, "strict": "true"}}}, "response_format.json_schema.strict", boolean),
        ("/v1/chat/completions", {"max_tokens": 5.5}, "max_tokens",
         "must be an integer, not a number with a fractional part"),
        ("/v1/completions", {"max_tokens": "5"}, "max_tokens", integer),
        ("/v1/completions", {"echo": 1}, "echo", "must be a boolean, not an integer"),
        ("/v1/responses", {"max_output_tokens": "5"}, "max_output_tokens", integer),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": 1}}},
         "text.format.strict", "must be a boolean, not an integer"),
        ("/v1/embeddings", {"dimensions": "3"}, "dimensions", integer),
        ("/v1/messages", {"max_tokens": "5"}, "max_tokens", integer),
        ("/v1/messages", {"temperature": "0.5"}, "temperature", number),
        ("/v1/messages", {"tools": [{"name": 5}]}, "tools.0.name", "must be a string, not an integer"),
    ]
    for route, changes, param, problem in cases:
        r = client.post(route, json={**ROUTE_MODELS[route][1], **changes})
        assert r.status_code == 400, (changes, r.text)
        if route == "/v1/messages":  # Anthropic's error body: no param
            assert r.json()["error"] == {"type": "invalid_request_error", "message": f"{param}: {problem}"}, r.text
        else:
            assert _message(r) == (f"{param}: {problem}", param), (changes, r.text)
    for route, body, param in (("/tokenize", {"model": "m", "prompt": "hi", "add_special_tokens": 1},
                                "add_special_tokens"),
                               ("/infill", {"model": "m", "input_prefix": "a", "n_predict": "3"}, "n_predict")):
        r = client.post(route, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert engine.prompts == []
    engine.outputs = [_output("Hi", "stop")]
    r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 1, "top_p": 1, "max_tokens": 3.0,
                                                  "logit_bias": {"5": 1}, "stream_options": None})
    assert r.status_code == 200, r.text
    assert (engine.params[-1].temperature, engine.params[-1].max_tokens) == (1.0, 3)


def test_content_parts_and_tool_calls_name_the_field_that_is_wrong(app_and_engine):  # noqa: F811
    """Fresh-user trial: a text part whose ``text`` was an object was told "the text is
    missing", with param ``messages``. Each problem now says what is wrong and names the
    part's own field."""
    client, engine = app_and_engine()
    cases = [  # (the message's changes, param, message)
        ({"content": [{"type": "text", "text": {"nested": 1}}]}, "messages.0.content.0.text",
         "messages.0.content.0.text: must be a string, not an object."),
        ({"content": [{"type": "text"}]}, "messages.0.content.0.text",
         "messages.0.content.0: a content part of type 'text' needs a `text` field (a string)."),
        ({"content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": None}]},
         "messages.0.content.1.refusal", "messages.0.content.1.refusal: must be a string, not null."),
        ({"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, "messages.0.content.0.type",
         "messages.0.content.0: content part of type 'image_url' is not supported (this model takes text only)."),
        ({"content": [{"text": "hi"}]}, "messages.0.content.0.type",
         'messages.0.content.0: a content part needs a `type` ("text").'),
        ({"content": [{"type": ["text"], "text": "hi"}]}, "messages.0.content.0.type",
         'messages.0.content.0.type: must be a string ("text"), not a list.'),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": "f"}]},
         "messages.0.tool_calls.0.function", "messages.0.tool_calls.0: each call needs a 'function' object."),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
         "messages.0.tool_calls.0.function.arguments", "messages.0.tool_calls.0.function.arguments: not valid JSON (Expecting property name enclosed in double quotes "
         "at character 1)."),  # the text is not quoted back
        # a call's id, name and arguments of the wrong JSON type reached the template as they were
        ({"role": "assistant", "content": None, "tool_calls": [{"id": 5, "function": {"name": "f"}}]},
         "messages.0.tool_calls.0.id", "messages.0.tool_calls.0.id: must be a string, not a number."),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": True}}]},
         "messages.0.tool_calls.0.function.name", "messages.0.tool_calls.0.function.name: must be a string, "
                                                  "not a boolean."),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 5}}]},
         "messages.0.tool_calls.0.function.arguments", "messages.0.tool_calls.0.function.arguments: must be a "
                                                       "string or an object, not a number."),
        # a call's type, a missing name and arguments that are JSON text of no object were taken (200)
        ({"role": "assistant", "content": None, "tool_calls": [{"type": "bogus", "function": {"name": "f"}}]},
         "messages.0.tool_calls.0.type", "messages.0.tool_calls.0.type: must be 'function'."),
        ({"role": "assistant", "content": None, "tool_calls": [{"type": 5, "function": {"name": "f"}}]},
         "messages.0.tool_calls.0.type", "messages.0.tool_calls.0.type: must be a string, not a number."),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
         "messages.0.tool_calls.0.function.name", "messages.0.tool_calls.0.function.name: a call needs its "
                                                  "function's name (a string)."),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1,2]"}}]},
         "messages.0.tool_calls.0.function.arguments", "messages.0.tool_calls.0.function.arguments: must be the "
                                                       "JSON text of an object, not of a list."),
    ]
    for changes, param, message in cases:
        r = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", **changes}]})
        assert r.status_code == 400 and _message(r) == (message, param), (changes, r.text)
    assert engine.prompts == []
    engine.outputs = [_output("Hi", "stop")]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]})
    assert r.status_code == 200, r.text  # arguments as an object: still taken (vLLM's clients send it)


def test_wrong_values_are_named_by_their_kind_never_echoed(app_and_engine):  # noqa: F811
    """Fresh-user trial: ``max_tokens: 1e400`` (read as infinity) was "a number with a
    fractional part"; chat's tool_choice echoed the whole value ("Invalid value for
    `tool_choice`: {'type': 5, ...}") under param ``tool_choice``; /invocations said
    "must be a valid integer" (its errors came without their inputs), not the words every
    other route says."""
    client, engine = app_and_engine()
    r = client.post("/v1/chat/completions", headers={"content-type": "application/json"},
                    content=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}')
    assert r.status_code == 400 and _message(r) == (
        "max_tokens: must be an integer, not a number too large to represent (it reads as infinity)", "max_tokens")
    tools = [{"type": "function", "function": {"name": "f"}}]
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    for choice, param, words in (
            ({"type": 5, "function": {"name": "secret"}}, "tool_choice.type", "tool_choice.type: must be 'function'."),
            ({"type": "function", "function": "secret"}, "tool_choice.function",
             "tool_choice.function: must be an object, not a string."),
            ({"type": "function", "function": {"name": 7}}, "tool_choice.function.name",
             "tool_choice.function.name: must be the name of one of `tools` (got a number)."),
            ("secret", "tool_choice", 'tool_choice: must be "none", "auto", "required" or a named tool.')):
        r = client.post("/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": choice})
        assert r.status_code == 400 and _message(r) == (f"{words} {usage}", param), r.text
        assert "secret" not in r.text and "'type'" not in r.text
    r = client.post("/invocations", json={**CHAT, "max_tokens": "5"})
    assert r.status_code == 400 and _message(r) == ("max_tokens: must be an integer, not a string", "max_tokens")
    assert engine.prompts == []


def test_booleans_are_not_numbers_in_token_id_lists_or_number_fields(app_and_engine):  # noqa: F811
    """Last review: ``prompt: [true]`` ran as token id 1 (pydantic's lax int), and
    ``temperature: true`` / a ``logit_bias`` value of ``true`` were 1.0. Each is a 400
    naming the item; token ids as numbers, and integral numbers as integers, still run.
    Numeric strings are refused like booleans (strict request models; OpenAI's answer)."""
    client, engine = app_and_engine()
    integer, number = "must be an integer, not a boolean", "must be a number, not a boolean"
    cases = [  # (route, changes to the route's body, param, problem)
        ("/v1/completions", {"prompt": [True]}, "prompt.0", integer),
        ("/v1/completions", {"prompt": [1, False]}, "prompt.1", integer),
        ("/v1/completions", {"prompt": [[1, 2], [3, True]]}, "prompt.1.1", integer),
        ("/v1/embeddings", {"input": [True]}, "input.0", integer),
        ("/v1/embeddings", {"input": [[5, True]]}, "input.0.1", integer),
        ("/v1/chat/completions", {"allowed_token_ids": [1, True]}, "allowed_token_ids.1", integer),
        ("/v1/chat/completions", {"logit_bias": {"5": True}}, "logit_bias.5", number),
        ("/v1/chat/completions", {"temperature": True}, "temperature", number),
        ("/v1/completions", {"top_p": False}, "top_p", number),
        ("/v1/responses", {"temperature": True}, "temperature", number),
        ("/v1/messages", {"top_p": True}, "top_p", number),
    ]
    for route, changes, param, problem in cases:
        r = client.post(route, json={**ROUTE_MODELS[route][1], **changes})
        assert r.status_code == 400, (changes, r.text)
        if route == "/v1/messages":  # Anthropic's error body: no param
            assert r.json()["error"]["message"] == f"{param}: {problem}", r.text
        else:
            assert _message(r) == (f"{param}: {problem}", param), (changes, r.text)
    assert engine.prompts == []
    for prompt in ([1, 2], [[1, 2]]):
        engine.outputs = [_output("Hi", "stop")]
        r = client.post("/v1/completions", json={**ROUTE_MODELS["/v1/completions"][1], "prompt": prompt})
        assert r.status_code == 200, (prompt, r.text)
    assert [p.get("prompt_token_ids") for p in engine.prompts] == [[1, 2], [1, 2]]
    engine.outputs = [_output("Hi", "stop")]
    r = client.post("/v1/chat/completions", json={**CHAT, "stop_token_ids": [5.0], "temperature": 1})
    assert r.status_code == 200, r.text  # an integral number is an integer, an integer a number
    assert (engine.params[-1].stop_token_ids, engine.params[-1].temperature) == ([5], 1.0)
    r = client.post("/v1/chat/completions", json={**CHAT, "stop_token_ids": ["5"], "temperature": "0.5"})
    assert _message(r) == ("temperature: must be a number, not a string; stop_token_ids.0: must be an integer, "
                           "not a string", "temperature"), r.text


def test_a_lone_surrogate_is_named_at_the_clients_field_and_position(app_and_engine):  # noqa: F811
    """Last review: a lone surrogate in a chat message was told at position 115 of the
    rendered prompt, with param ``messages`` (``input`` on /v1/responses, whose message
    said ``messages``); stop strings got pydantic's "unable to parse raw data" wording.
    Each route now names the client's own field and the position within its string."""
    client, engine = app_and_engine()
    surrogate = "ab\\ud800c"  # U+D800 at position 2 of the field's string, as JSON escapes it
    said = "the text contains a lone surrogate code point U+D800 at position 2, which is not valid Unicode; " \
           "send UTF-8 text."
    cases = [  # (route, the body's fields as JSON text, param)
        ("/v1/chat/completions", '"messages":[{"role":"system","content":"s"},{"role":"user","content":"%s"}]',
         "messages.1.content"),
        ("/v1/chat/completions", '"messages":[{"role":"user","content":[{"type":"text","text":"%s"}]}]',
         "messages.0.content.0.text"),
        ("/v1/chat/completions", '"messages":[{"role":"user","content":"hi"}],"stop":["x","%s"]', "stop.1"),
        ("/v1/completions", '"prompt":["x","%s"]', "prompt.1"),
        ("/v1/completions", '"prompt":"hi","stop":"%s"', "stop"),
        ("/v1/responses", '"input":"%s"', "input"),
        ("/v1/responses", '"input":[{"role":"user","content":[{"type":"input_text","text":"%s"}]}]',
         "input.0.content.0.text"),
        ("/v1/responses", '"input":"hi","instructions":"%s"', "instructions"),
        ("/tokenize", '"messages":[{"role":"user","content":"%s"}]', "messages.0.content"),
    ]
    for route, fields, param in cases:
        body = '{"model":"m","max_tokens":2,%s}' % (fields % surrogate)
        r = client.post(route, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and _message(r) == (f"{param}: {said}", param), (route, fields, r.text)
    for fields, field in (('"messages":[{"role":"user","content":"%s"}]', "messages.0.content"),
                          ('"messages":[{"role":"user","content":"hi"}],"stop_sequences":["%s"]', "stop_sequences.0")):
        body = '{"model":"m","max_tokens":2,%s}' % (fields % surrogate)
        r = client.post("/v1/messages", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"] == f"{field}: {said}", r.text
    assert engine.prompts == []


def test_an_unknown_model_name_with_a_lone_surrogate_is_a_clean_404(app_and_engine):  # noqa: F811
    """Fresh-user trial: ``"model": "\\ud800x"`` on the OpenAI routes was a 400 whose message
    was pydantic's "Error serializing to JSON: UnicodeEncodeError: 'utf-8' codec can't
    encode character..." with param null: the 404 naming the unknown model could not be
    written. Now the 404 naming ``model``, as for any unknown name, its text valid Unicode."""
    client, engine = app_and_engine()
    for route, fields in (("/v1/chat/completions", '"messages":[{"role":"user","content":"hi"}]'),
                          ("/v1/completions", '"prompt":"hi"'), ("/v1/responses", '"input":"hi"'),
                          ("/v1/embeddings", '"input":"hi"'), ("/tokenize", '"prompt":"hi"')):
        body = '{"model":"a\\ud800b","max_tokens":2,%s}' % fields
        r = client.post(route, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 404, (route, r.text)
        err = r.json()["error"]
        assert (err["param"], err["type"]) == ("model", "NotFoundError") and "serializ" not in err["message"], r.text
    assert engine.prompts == []


def test_a_tool_message_without_tool_call_id_is_a_400_naming_it(app_and_engine):  # noqa: F811
    """OpenAI answers 400 "Missing required parameter: 'messages[2].tool_call_id'"; it was a
    200 here (vLLM's lenience), the result reaching the template unpaired with its call."""
    client, engine = app_and_engine()
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    for extra in ({}, {"tool_call_id": None}):
        messages = [{"role": "user", "content": "hi"}, call, {"role": "tool", "content": "42", **extra}]
        r = client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages.2.tool_call_id" and "field required" in err["message"], err
    assert engine.prompts == []
    engine.outputs = [_output("ok", "stop")]
    messages[2]["tool_call_id"] = "call_1"
    assert client.post("/v1/chat/completions", json={**CHAT, "messages": messages}).status_code == 200
