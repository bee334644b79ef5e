"""Anthropic's Messages API (``/v1/messages``) against the shared ``server``, through the
official ``anthropic`` SDK (its types parse every answer) and raw HTTP where the wire
itself is the point (the exact stream event sequence, the error bodies).

Greedy decoding (``temperature`` 0, sent in the body: SDK 2.x has no argument for it) on
the float32 server is batch-invariant, so a streamed answer equals the same request's
whole answer, and a stop sequence taken from an answer cuts that answer there.
"""
import json
import re

import anthropic
import pytest
from pydantic import TypeAdapter

from e2e_utils import API_KEY, MODEL

GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]
WEATHER = {"name": "get_weather", "description": "The weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "cache_control": {"type": "ephemeral"}}
EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)


def prompt_of(usage) -> int:
    """The prompt's tokens: Anthropic splits them in three (read, written, the rest)."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


@pytest.fixture(scope="module")
def client(server):
    # x-api-key, as the SDK sends it; the timeout lets a non-streamed request ask for a
    # huge max_tokens (the SDK refuses one it expects to run over 10 minutes otherwise)
    return anthropic.Anthropic(base_url=server.url_root, api_key=API_KEY, max_retries=0, timeout=300)


def sse_events(server, body: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed /v1/messages answer."""
    events, kind = [], None
    with server.http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[len("data: "):])))
    return events


def test_claude_code_shaped_request_clamps_max_tokens_and_reports_cache_hits(client):
    # What Claude Code sends (?beta=true, beta flags, system blocks with cache_control,
    # a system message inside messages, thinking / context_management / output_config /
    # metadata) with a max_tokens far above the context: clamped, not a 400.
    kwargs = dict(
        model=MODEL, max_tokens=100_000, betas=["claude-code-20250219", "context-management-2025-06-27"],
        system=[{"type": "text", "text": "You are a helpful assistant."},
                {"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": HELLO[0]["content"],
                                                "cache_control": {"type": "ephemeral"}}]},
                  {"role": "system", "content": "Be friendly."}],
        metadata={"user_id": "u-1"}, thinking={"type": "adaptive"}, output_config={"effort": "high"},
        extra_body={**GREEDY, "context_management": {"edits": [{"type": "clear_thinking_20251015"}]}})
    first = client.beta.messages.create(**kwargs)
    second = client.beta.messages.create(**kwargs)
    assert first.content[0].type == "text" and first.content[0].text.strip()
    assert first.stop_reason == "end_turn" and first.model == MODEL
    assert second.content[0].text == first.content[0].text
    prompt = prompt_of(first.usage)
    assert second.usage.cache_read_input_tokens > 0  # the whole prompt was cached by the first
    assert prompt_of(second.usage) == prompt
    assert second.usage.output_tokens == first.usage.output_tokens > 0


def test_cache_writes_and_reads_add_up_to_the_prompt(client, server):
    # cache_creation_input_tokens was always 0: a request with cache_control breakpoints is
    # told the whole KV blocks it wrote to the prefix cache (streaming.usage_of), a later
    # one what it read; the three parts add up to the prompt in the message, message_start
    # and message_delta alike. Without a breakpoint nothing is reported written.
    import uuid

    system = [{"type": "text", "text": f"Session {uuid.uuid4().hex}: answer in one word.",
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    ask = dict(model=MODEL, max_tokens=1, system=system, messages=HELLO)
    prompt = client.messages.count_tokens(model=MODEL, system=system, messages=HELLO).input_tokens
    whole = (prompt // 16) * 16  # the server's KV blocks hold 16 tokens
    first = client.messages.create(**ask).usage
    assert (first.cache_read_input_tokens, first.cache_creation_input_tokens, first.input_tokens) == \
        (0, whole, prompt - whole)
    assert first.cache_creation.ephemeral_1h_input_tokens == whole
    events = sse_events(server, {**ask, "temperature": 0})
    start, delta = events[0][1]["message"]["usage"], events[-2][1]["usage"]
    assert start["cache_read_input_tokens"] > 0 and prompt_of(anthropic.types.Usage(**start)) == prompt
    parts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert [delta[k] for k in parts] == [start[k] for k in parts]
    plain = client.messages.create(**{**ask, "system": system[0]["text"]}).usage
    assert plain.cache_creation_input_tokens == 0 and prompt_of(plain) == prompt


def test_stream_equals_create_and_events_follow_anthropics_sequence(client, server):
    body = dict(model=MODEL, max_tokens=12, messages=HELLO, **GREEDY)
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY) as stream:
        texts = [event.delta.text for event in stream
                 if event.type == "content_block_delta" and event.delta.type == "text_delta"]
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    events = sse_events(server, body)
    kinds = [k for k, _ in events]
    n = len(kinds)
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[3:n - 3] == ["content_block_delta"] * (n - 6)
    assert kinds[n - 3:] == ["content_block_stop", "message_delta", "message_stop"]
    for kind, data in events:
        assert data["type"] == kind
        if kind != "ping":
            EVENT.validate_python(data)  # the SDK's own event types, validated
    assert events[-2][1]["delta"]["stop_reason"] == whole.stop_reason


def test_tool_round_trip_and_count_tokens(client, server):
    forced = dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = client.messages.create(model=MODEL, max_tokens=48, messages=ask, extra_body=GREEDY, **forced)
    assert call.stop_reason == "tool_use"
    use = call.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    assert re.fullmatch(r"toolu_01[0-9A-Za-z]{22}", use.id), use.id  # Anthropic's form, not chatcmpl-tool-<hex>
    # the same call streamed: input_json_delta fragments that join to the same input
    events = sse_events(server, dict(model=MODEL, max_tokens=48, messages=ask, **GREEDY, **forced))
    start = next(d for k, d in events if k == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "get_weather"
    assert re.fullmatch(r"toolu_01[0-9A-Za-z]{22}", start["content_block"]["id"]), start
    fragments = [d["delta"]["partial_json"] for k, d in events
                 if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(fragments)) == use.input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # the result goes back; the model answers in text
    turn = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": [{"type": "text", "text": "Sunny, 22 C"}]}]}]
    answer = client.messages.create(model=MODEL, max_tokens=16, messages=turn, tools=[WEATHER],
                                    extra_body=GREEDY)
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text.strip()
    counted = client.messages.count_tokens(model=MODEL, messages=turn, tools=[WEATHER])
    assert counted.input_tokens == prompt_of(answer.usage)
    # a history written before (OpenAI-style ids from the chat path) still goes through
    old_id = "chatcmpl-tool-" + "0123456789abcdef" * 2
    old = json.loads(json.dumps(turn).replace(use.id, old_id))
    again = client.messages.create(model=MODEL, max_tokens=4, messages=old, tools=[WEATHER], extra_body=GREEDY)
    assert again.content and again.content[0].type == "text"


def test_stop_sequences_end_the_answer_where_they_match(client):
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body=GREEDY).content[0].text
    words = whole.split()
    assert len(words) >= 3, whole
    stop = words[2]
    cut = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, stop_sequences=[stop],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == whole[:whole.index(stop)]


def test_output_config_format_is_enforced(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    reply = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
                                   output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(reply.content[0].text)["answer"] in ("yes", "no")


BAD = [  # (body fields, status, Anthropic error type, what the message must name)
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error", "messages.0.content.0"),
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error",
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto"}}, 400, "invalid_request_error", "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "tools.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "invalid_request_error",
     "messages.0.content.0"),
    ({"model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, 400, "invalid_request_error",
     "tools.0.input_schema"),
    ({"chat_template": "{{ 'x' }}"}, 400, "invalid_request_error", "chat_template"),
]


@pytest.mark.parametrize("fields,status,kind,named", BAD, ids=[b[3] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_input_answers_in_anthropics_error_shape(server, fields, status, kind, named):
    body = {"model": MODEL, "max_tokens": 8, "messages": HELLO, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = server.http.post("/v1/messages", json=body)
    assert r.status_code == status
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert named in r.json()["error"]["message"]
    # Anthropic's request id: the request-id header, and request_id in the body
    assert r.json()["request_id"] == r.headers["request-id"] == r.headers["x-request-id"]


def test_auth_and_count_tokens_errors_take_anthropics_shape(server, client):
    bad_key = anthropic.Anthropic(base_url=server.url_root, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_key.messages.count_tokens(model=MODEL, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert e.value.request_id and e.value.body["request_id"] == e.value.request_id  # 401: outside X-Request-Id
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [{"type": "document"}]}])
    assert e.value.body["type"] == "error" and "messages.0.content.0" in e.value.body["error"]["message"]


def test_the_sdk_reads_each_answers_request_id(client, server):
    # the SDK reads Anthropic's request-id header: message._request_id, stream.request_id
    r = client.messages.with_raw_response.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert r.parse()._request_id == r.headers["request-id"] == r.headers["x-request-id"]
    with client.messages.stream(model=MODEL, max_tokens=2, messages=HELLO) as stream:
        assert stream.request_id
    assert client.messages.count_tokens(model=MODEL, messages=HELLO)._request_id
    # a client's X-Request-Id is the one id
    r = server.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 0, "messages": HELLO},
                         headers={"X-Request-Id": "trace-7"})
    assert r.headers["request-id"] == "trace-7" and r.json()["request_id"] == "trace-7"


def test_a_plain_text_document_counts_as_its_text(client):
    """A plain-text ``document`` block (the SDK's DocumentBlockParam, source ``text``) is
    read as its text: count_tokens equals the same words sent as text (it was a 400)."""
    doc = {"type": "document", "title": "Facts", "source": {"type": "text", "media_type": "text/plain",
                                                             "data": "The grass is green."}}
    as_doc = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
        doc, {"type": "text", "text": "What colour is the grass?"}]}])
    as_text = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Facts\nThe grass is green.\nWhat colour is the grass?"}]}])
    assert as_doc.input_tokens == as_text.input_tokens > 10


def test_a_final_assistant_message_is_continued_here_and_on_ollamas_chat(client, server):
    """Fresh-user trial: a prefill ("The capital of France is") was answered in a new turn
    that repeated it. Anthropic's Messages API and Ollama's /api/chat continue it: the reply
    is the continuation only, and the same on both routes (greedy, same prompt)."""
    messages = [{"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    msg = client.messages.create(model=MODEL, max_tokens=6, messages=messages, extra_body=GREEDY)
    text = msg.content[0].text
    assert "Paris" in text and not text.lstrip().startswith("The capital"), text
    ollama = server.post("/api/chat", {"model": MODEL, "messages": messages, "stream": False,
                                       "options": {"temperature": 0, "num_predict": 6}}).json()
    assert ollama["message"]["content"] == text, ollama
    counted = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted
