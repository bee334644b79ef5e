"""Anthropic's request rules (``anthropic/checks.py``) over HTTP, through the official
``anthropic`` SDK against the shared ``server``: each request Anthropic's API refuses with
400 ``invalid_request_error`` (thinking.budget_tokens below 1024 or not below
max_tokens, a tool_result with no tool_use before it, a tool_use with no result after
it, duplicate tool_use ids, an empty message or text block) is a BadRequestError here too, in Anthropic's error body,
naming the field, on ``/v1/messages`` (streamed or not) and ``count_tokens`` alike,
before any token is generated. The fresh-user trial found them all answered 200."""
import anthropic
import pytest

from e2e_utils import API_KEY, MODEL

ASK = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER = {"name": "get_weather", "description": "The weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _use(*ids):
    return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "get_weather",
                                              "input": {"city": "Paris"}} for i in ids]}


def _result(*ids):
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "Sunny"} for i in ids]}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url_root, api_key=API_KEY, max_retries=0, timeout=120)


BAD = [  # (create() arguments, the field the message must name)
    (dict(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 100}), "thinking.budget_tokens"),
    (dict(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 2048}), "thinking.budget_tokens"),
    (dict(max_tokens=2048, thinking={"type": "enabled"}), "thinking.budget_tokens"),
    (dict(max_tokens=2048, thinking={"type": "adaptive", "display": 5}), "thinking.display"),
    (dict(messages=[ASK, _use("toolu_1"), _result("toolu_2")], tools=[WEATHER]), "messages.2.content.0"),
    (dict(messages=[_result("toolu_1")], tools=[WEATHER]), "messages.0.content.0"),
    (dict(messages=[ASK, _use("toolu_1"), {"role": "user", "content": "Thanks"}], tools=[WEATHER]), "messages.2"),
    (dict(messages=[ASK, _use("toolu_1", "toolu_1"), _result("toolu_1")], tools=[WEATHER]), "messages.1.content.1"),
    (dict(messages=[ASK, _use("call.1"), _result("call.1")], tools=[WEATHER]), "messages.1.content.0.id"),
    (dict(messages=[ASK, {"role": "assistant", "content": ""}, ASK]), "messages.1"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]), "messages.0.content.0.text"),
    (dict(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "persistent"}}]),
     "system.0.cache_control.type"),
]


@pytest.mark.parametrize("kwargs,named", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_what_anthropic_refuses_is_a_400_naming_the_field(client, kwargs, named):
    kwargs = {"model": MODEL, "max_tokens": 8, "messages": [ASK], **kwargs}
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**kwargs, stream=stream)
        body = e.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(named), body
    # count_tokens has no max_tokens: every fault but "budget_tokens not below max_tokens" applies
    if kwargs.get("thinking", {}).get("budget_tokens", 0) < 1024:
        counted = {k: v for k, v in kwargs.items() if k != "max_tokens"}
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.count_tokens(**counted)
        assert e.value.body["error"]["message"].startswith(named)


def test_what_anthropic_accepts_still_passes(client):
    # count_tokens has no max_tokens: only the 1024 floor applies to the budget
    n = client.messages.count_tokens(model=MODEL, messages=[ASK], thinking={"type": "enabled", "budget_tokens": 1024})
    assert n.input_tokens > 0
    # a paired round trip, the results first and then text; a trailing tool_use is a continuation
    turns = [ASK, _use("toolu_1"), {"role": "user", "content": _result("toolu_1")["content"] + [
        {"type": "text", "text": "Answer in one word."}]}]
    reply = client.messages.create(model=MODEL, max_tokens=4, messages=turns, tools=[WEATHER],
                                   extra_body={"temperature": 0})
    assert reply.content and reply.usage.output_tokens >= 1
    assert client.messages.count_tokens(model=MODEL, messages=[ASK, _use("toolu_1")], tools=[WEATHER]).input_tokens
    # an empty final assistant message is a prefill, not an empty message
    prefill = client.messages.create(model=MODEL, max_tokens=2, messages=[ASK, {"role": "assistant", "content": ""}],
                                     extra_body={"temperature": 0})
    assert prefill.usage.output_tokens >= 1


def test_accepted_fields_are_checked_and_message_batches_are_a_clear_404(client):
    """``metadata`` and ``service_tier`` change nothing here but take Anthropic's values
    only (accepted_fields.py); the Message Batches API is not served, and says so."""
    for bad, named in (({"metadata": {"user_id": 5}}, "metadata.user_id"), ({"service_tier": "priority"},
                                                                          "service_tier")):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=MODEL, max_tokens=8, messages=[ASK], **bad)
        assert e.value.body["error"]["message"].startswith(named), e.value.body
    for call in (client.messages.batches.list, lambda: client.messages.batches.retrieve("msgbatch_1")):
        with pytest.raises(anthropic.NotFoundError) as e:
            call()
        error = e.value.body["error"]
        assert error["type"] == "not_found_error" and "Message Batches API" in error["message"], e.value.body
