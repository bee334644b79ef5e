"""Anthropic's request rules that the field types alone do not say (``anthropic/checks.py``):
``thinking`` (type, display, budget_tokens against max_tokens) and the pairing of
``tool_use`` / ``tool_result`` blocks between turns. Each fault is a SamplingParamsError
(400) whose ``param`` is the Anthropic path of the field; each valid shape passes."""
import json

import pytest
from test_app import _output, app_and_engine  # noqa: F401  (fixture)

from llmserve.entrypoints.anthropic.checks import check_thinking, check_tool_turns
from llmserve.entrypoints.anthropic.conversion import to_chat_request
from llmserve.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from llmserve.sampling_params import SamplingParamsError

ASK = {"role": "user", "content": "What is the weather in Paris and Rome?"}


def use(*ids):
    return {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}] + [
        {"type": "tool_use", "id": i, "name": "get_weather", "input": {"city": "Paris"}} for i in ids]}


def result(*ids, text_first=False):
    blocks = [{"type": "tool_result", "tool_use_id": i, "content": "sunny"} for i in ids]
    text = [{"type": "text", "text": "Here you go."}]
    return {"role": "user", "content": text + blocks if text_first else blocks + text}


def _request(messages, **fields):
    return AnthropicMessagesRequest(model="m", max_tokens=fields.pop("max_tokens", 4096), messages=messages, **fields)


def _param(fn, *args):
    with pytest.raises(SamplingParamsError) as e:
        fn(*args)
    return e.value.param, str(e.value)


@pytest.mark.parametrize("thinking", [None, {"type": "adaptive"}, {"type": "disabled"}, {"type": "between_tools"},
                                      {"type": "enabled", "budget_tokens": 1024},
                                      {"type": "enabled", "budget_tokens": 4095, "display": "omitted"},
                                      {"type": "adaptive", "display": "summarized"},
                                      # Claude Code 2.1.332's (beta thinking-display-updates-2026-08-18)
                                      {"type": "adaptive", "display": "updates"},
                                      # a value newer than this server: logged, not refused
                                      {"type": "enabled", "budget_tokens": 1024, "display": "sparkles"}])
def test_valid_thinking_passes(thinking):
    check_thinking(thinking, 4096)


@pytest.mark.parametrize("thinking,max_tokens,param,words", [
    ({"type": "enabled", "budget_tokens": 1023}, 4096, "thinking.budget_tokens", ">= 1024"),
    ({"type": "enabled", "budget_tokens": 100}, None, "thinking.budget_tokens", ">= 1024"),  # count_tokens
    ({"type": "enabled", "budget_tokens": -1}, 4096, "thinking.budget_tokens", ">= 1024"),
    ({"type": "enabled", "budget_tokens": 4096}, 4096, "thinking.budget_tokens", "less than max_tokens (4096)"),
    ({"type": "enabled", "budget_tokens": 5000}, 2000, "thinking.budget_tokens", "less than max_tokens (2000)"),
    ({"type": "enabled"}, 4096, "thinking.budget_tokens", "needs an integer"),
    ({"type": "enabled", "budget_tokens": "2000"}, 4096, "thinking.budget_tokens", "needs an integer"),
    ({"type": "enabled", "budget_tokens": 2000.0}, 4096, "thinking.budget_tokens", "needs an integer"),
    ({"type": "enabled", "budget_tokens": True}, 4096, "thinking.budget_tokens", "needs an integer"),
    ({"type": "on"}, 4096, "thinking.type", "'on'"),
    ({}, 4096, "thinking.type", "None"),
    ({"type": "adaptive", "display": 5}, 4096, "thinking.display", "got 5"),
    ({"type": "adaptive", "display": ["omitted"]}, 4096, "thinking.display", "got [\"omitted\"]"),
    ({"type": "disabled", "display": "omitted"}, 4096, "thinking.display", "'disabled'"),
    ({"type": "between_tools", "display": "sparkles"}, 4096, "thinking.display", "'between_tools'"),
])
def test_bad_thinking_names_the_field(thinking, max_tokens, param, words):
    got, message = _param(check_thinking, thinking, max_tokens)
    assert got == param and param in message and words in message


def test_budget_is_checked_against_the_requests_own_max_tokens():
    # the messages request: budget >= max_tokens as sent; count_tokens has no max_tokens
    bad = _request([ASK], max_tokens=1500, thinking={"type": "enabled", "budget_tokens": 1500})
    with pytest.raises(SamplingParamsError) as e:
        to_chat_request(bad, auto_tools=False)
    assert e.value.param == "thinking.budget_tokens"
    counted = AnthropicCountTokensRequest(model="m", messages=[ASK],
                                          thinking={"type": "enabled", "budget_tokens": 1500})
    assert to_chat_request(counted, auto_tools=False).chat_template_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize("messages", [
    [ASK],
    [ASK, use("toolu_1"), result("toolu_1")],
    [ASK, use("toolu_1", "toolu_2"), result("toolu_2", "toolu_1"), {"role": "assistant", "content": "Both sunny."}],
    [ASK, use("toolu_1")],  # a continuation of the assistant's turn: no result yet
    [ASK, use("toolu_1"), result("toolu_1"), {"role": "system", "content": "Be brief."}],  # Claude Code's system
    # consecutive messages of one role are one turn (Anthropic combines them)
    [ASK, use("toolu_1"), use("toolu_2"), {"role": "user", "content": result("toolu_1")["content"][:1]},
     result("toolu_2")],
    [ASK, use("a-b_C9"), result("a-b_C9"), ASK, use("toolu_2"), result("toolu_2")],
])
def test_paired_tool_turns_pass(messages):
    check_tool_turns(_request(messages).messages)


@pytest.mark.parametrize("messages,param,words", [
    ([ASK, use("toolu_1"), result("toolu_2")], "messages.2.content.0", "unexpected `tool_use_id`"),
    ([result("toolu_1")], "messages.0.content.0", "unexpected `tool_use_id`"),  # nothing before it
    ([ASK, use("toolu_1"), ASK, result("toolu_1")], "messages.3.content.0",  # one turn: text came first
     "before any other block (messages.2.content comes before it)"),
    ([ASK, use("toolu_1"), result("toolu_1"), {"role": "assistant", "content": "Sunny."}, result("toolu_1")],
     "messages.4.content.0", "unexpected `tool_use_id`"),
    ([ASK, use("toolu_1", "toolu_2"), result("toolu_1")], "messages.2", "without `tool_result` blocks"),
    ([ASK, use("toolu_1"), {"role": "user", "content": "thanks"}], "messages.2", "toolu_1"),
    ([ASK, use("toolu_1"), result("toolu_1", text_first=True)], "messages.2.content.1", "must come first"),
    ([ASK, use("toolu_1"), result("toolu_1", "toolu_1")], "messages.2.content.1", "second `tool_result`"),
    ([ASK, use("toolu_1", "toolu_1"), result("toolu_1")], "messages.1.content.2", "must be unique"),
    ([ASK, use("toolu_1"), result("toolu_1"), use("toolu_1"), result("toolu_1")], "messages.3.content.1",
     "already used at messages.1.content.1"),
    ([ASK, use("call 1"), result("call 1")], "messages.1.content.1.id", "^[a-zA-Z0-9_-]+$"),
    ([ASK, use(""), result("")], "messages.1.content.1.id", "''"),
])
def test_unpaired_tool_turns_name_the_block(messages, param, words):
    got, message = _param(check_tool_turns, _request(messages).messages)
    assert got == param and message.startswith(param) and words in message


def test_to_chat_request_applies_the_turn_rules_to_both_routes():
    turns = [ASK, use("toolu_1"), result("toolu_9")]
    for request in (_request(turns), AnthropicCountTokensRequest(model="m", messages=turns)):
        with pytest.raises(SamplingParamsError) as e:
            to_chat_request(request, auto_tools=False)
        assert e.value.param == "messages.2.content.0"


@pytest.mark.parametrize("tool,param", [
    ({"name": "get weather!", "input_schema": {"type": "object"}}, "tools.0.name"),
    ({"name": "x" * 65, "input_schema": {"type": "object"}}, "tools.0.name"),
    ({"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
     "tools.0.input_schema"),
])
def test_a_bad_tool_is_named_by_its_anthropic_path(tool, param):
    # not the chat path's tools[0].function..., a field the Anthropic client never sent
    request = _request([ASK], tools=[tool])
    got, message = _param(lambda r: to_chat_request(r, auto_tools=False), request)
    assert got == param and message.startswith(param)
    assert "weather!" not in message  # the name is not quoted back


def test_a_duplicate_tool_name_is_named_by_its_anthropic_path():
    tool = {"name": "f", "input_schema": {"type": "object"}}
    got, message = _param(lambda r: to_chat_request(r, auto_tools=False), _request([ASK], tools=[tool, tool]))
    assert got == "tools.1.name" and message.startswith("tools.1.name"), message


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": ""}], "messages.0"),
    ([{"role": "user", "content": []}], "messages.0"),
    ([ASK, {"role": "assistant", "content": ""}, ASK], "messages.1"),
    ([{"role": "user", "content": [{"type": "text", "text": ""}]}], "messages.0.content.0.text"),
    ([ASK, {"role": "assistant", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": ""}]}],
     "messages.1.content.1.text"),
    ([{"role": "user", "content": "   \n"}], "messages.0"),  # whitespace only (fresh-user trial)
    ([{"role": "user", "content": [{"type": "text", "text": " \t"}]}], "messages.0.content.0.text"),
])
def test_empty_contents_are_refused_as_anthropic_refuses_them(messages, param):
    with pytest.raises(SamplingParamsError) as e:
        to_chat_request(_request(messages), auto_tools=False)
    assert e.value.param == param and str(e.value).startswith(param)


def test_a_final_empty_assistant_message_is_a_prefill():
    for last in ({"role": "assistant", "content": ""}, {"role": "assistant", "content": []}):
        to_chat_request(_request([ASK, last]), auto_tools=False)
    to_chat_request(_request([ASK, {"role": "system", "content": ""}]), auto_tools=False)  # Claude Code's, unchecked


def test_stop_sequences_are_named_as_anthropic_names_them():
    with pytest.raises(SamplingParamsError) as e:
        to_chat_request(_request([ASK], stop_sequences=["END", ""]), auto_tools=False)
    assert e.value.param == "stop_sequences.1" and "stop sequence cannot be empty" in str(e.value)
    to_chat_request(_request([ASK], stop_sequences=["END"]), auto_tools=False)


def test_a_missing_budget_is_said_in_json_terms_not_python_ones():
    with pytest.raises(SamplingParamsError) as e:
        check_thinking({"type": "enabled"}, 4096)
    assert "none was given" in str(e.value) and "None" not in str(e.value)
    with pytest.raises(SamplingParamsError, match='got "2000"'):
        check_thinking({"type": "enabled", "budget_tokens": "2000"}, 4096)


@pytest.mark.parametrize("content", ["Hello ", "  ", [{"type": "text", "text": "Hi\n"}],
                                     [{"type": "text", "text": "ok"}, {"type": "text", "text": " "}]])
def test_a_prefill_ending_in_whitespace_is_refused_in_either_form(content):
    with pytest.raises(SamplingParamsError) as e:
        to_chat_request(_request([ASK, {"role": "assistant", "content": content}]), auto_tools=False)
    assert e.value.param == "messages.1" and "trailing whitespace" in str(e.value)
    to_chat_request(_request([ASK, {"role": "assistant", "content": "Hello"}]), auto_tools=False)


def test_a_boolean_max_tokens_is_refused_not_read_as_one_token():
    """``"max_tokens": true`` ran as a 1-token answer (pydantic's lax ints); Anthropic's
    API refuses it, as the OpenAI routes now do. Integers stay accepted."""
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="not a boolean"):
        _request([ASK], max_tokens=True)
    assert _request([ASK], max_tokens=7).max_tokens == 7


def test_a_value_of_the_wrong_json_type_is_refused_not_coerced():
    """Fresh-user trial of the OpenAI routes, checked here too: ``"max_tokens": "5"`` and
    ``"temperature": "0.5"`` were read as numbers (pydantic's lax mode), and
    ``tool_choice.disable_parallel_tool_use: "true"`` was silently read as false (only
    ``true`` counted); Anthropic answers each with a 400 naming the field."""
    import pydantic

    for fields, name in (({"max_tokens": "5"}, "max_tokens"), ({"temperature": "0.5"}, "temperature"),
                         ({"top_k": 5.5}, "top_k"), ({"stream": 1}, "stream")):
        with pytest.raises(pydantic.ValidationError) as e:
            _request([ASK], **fields)
        assert e.value.errors()[0]["loc"] == (name,) and e.value.errors()[0]["type"].endswith("_type"), e.value
    for value in ("true", 1):
        with pytest.raises(SamplingParamsError) as e:
            to_chat_request(_request([ASK], tool_choice={"type": "auto", "disable_parallel_tool_use": value}),
                            auto_tools=True)
        assert e.value.param == "tool_choice.disable_parallel_tool_use" and "must be a boolean" in str(e.value)
    chat = to_chat_request(_request([ASK], temperature=1, tool_choice={"type": "none",
                                                                       "disable_parallel_tool_use": True}),
                           auto_tools=True)
    assert chat.temperature == 1.0


@pytest.mark.parametrize("messages,param,words", [
    # each block type's fields stay plain JSON in the request model; a wrong type was read as
    # something else ("is_error": "yes" as false) or dropped unread (thinking blocks): 200
    ([ASK, use("t1"), {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok",
                                                    "is_error": "yes"}]}],
     "messages.2.content.0.is_error", "must be a boolean, not a string."),
    ([ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": 5, "signature": "s"},
                                             {"type": "text", "text": "x"}]}, ASK],
     "messages.1.content.0.thinking", "must be a string, not a number."),
    ([ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": 5},
                                             {"type": "text", "text": "x"}]}, ASK],
     "messages.1.content.0.signature", "must be a string, not a number."),
    ([ASK, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": []},
                                             {"type": "text", "text": "x"}]}, ASK],
     "messages.1.content.0.data", "must be a string, not a list."),
    ([{"role": "user", "content": [{"type": "text", "text": "hi", "citations": "x"}]}],
     "messages.0.content.0.citations", "must be a list, not a string."),
    ([{"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                                   "data": 5}}]}],
     "messages.0.content.0.source.data", "must be a string, not a number."),
    ([{"role": "user", "content": [{"type": "document", "title": 5, "source": {"type": "text", "data": "d"}}]}],
     "messages.0.content.0.title", "must be a string, not a number."),
    ([{"role": "user", "content": [{"type": "search_result", "source": 5, "title": "t",
                                    "content": [{"type": "text", "text": "x"}]}]}],
     "messages.0.content.0.source", "must be a string, not a number."),
    ([ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": "{}"}]}],
     "messages.1.content.0.input", "must be an object, not a string."),
    ([ASK, use("t1"), {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                    "content": [{"type": "text", "text": "x", "citations": {}}]}]}],
     "messages.2.content.0.content.0.citations", "must be a list, not an object."),
])
def test_a_block_field_of_the_wrong_json_type_is_named(messages, param, words):
    """Every content block type accepted here (text, document, search_result, tool_use,
    tool_result, thinking, redacted_thinking), at any depth: a field of the wrong JSON type
    is Anthropic's 400 naming it, by the value's kind only."""
    with pytest.raises(SamplingParamsError) as e:
        to_chat_request(_request(messages), auto_tools=True)
    assert e.value.param == param and str(e.value) == f"{param}: {words}", str(e.value)


def test_accepted_fields_name_the_wrong_kind_without_echoing_it():
    """``metadata.user_id`` and ``cache_control.type`` said "got 5", echoing the value."""
    from llmserve.entrypoints.anthropic.accepted_fields import check_accepted_fields

    for fields, param, words in (
            ({"metadata": {"user_id": 5}}, "metadata.user_id", "Input should be a valid string; got a number."),
            ({"cache_control": {"type": "secret"}}, "cache_control.type",
             "Input should be 'ephemeral'; got a string."),
            ({"service_tier": "secret"}, "service_tier", "Input should be 'auto' or 'standard_only'; got a string.")):
        with pytest.raises(SamplingParamsError) as e:
            check_accepted_fields(_request([ASK], **fields))
        assert e.value.param == param and str(e.value) == f"{param}: {words}", str(e.value)
    with pytest.raises(SamplingParamsError) as e:  # ignored, yet of Anthropic's type (a number was taken)
        to_chat_request(_request([ASK], output_config={"effort": 5}), auto_tools=True)
    assert e.value.param == "output_config.effort" and "must be a string, not a number" in str(e.value)
    for choice, param in (({"type": "tool", "name": 5}, "tool_choice.name"), ({"type": 5}, "tool_choice.type")):
        with pytest.raises(SamplingParamsError) as e:
            to_chat_request(_request([ASK], tools=[{"name": "f", "input_schema": {"type": "object"}}],
                                     tool_choice=choice), auto_tools=True)
        assert e.value.param == param and "must be a string, not a number" in str(e.value), str(e.value)


def test_tool_use_ids_take_anthropics_form_and_come_back_through_the_checks():
    """tool_use ids were the chat path's ``chatcmpl-tool-<hex>``; Anthropic's are
    ``toolu_01`` + 22 base-62 characters. The same call id gives the same block id (stream
    and whole answer agree), and a conversation that sends it back passes the pairing
    checks and reaches the chat request, as one with OpenAI-style ids from before does."""
    import re

    from llmserve.entrypoints.anthropic.streaming import tool_use_id

    call_id = "chatcmpl-tool-" + "0123456789abcdef" * 2
    ids = [tool_use_id(call_id), tool_use_id("call_abc123"), tool_use_id(None)]
    assert all(re.fullmatch(r"toolu_01[0-9A-Za-z]{22}", i) for i in ids), ids
    assert tool_use_id(call_id) == ids[0] and len(set(ids)) == 3 and tool_use_id(ids[1]) == ids[1]
    for tid in (ids[0], call_id, "call_abc123"):
        chat = to_chat_request(_request([ASK, use(tid), result(tid)]), auto_tools=False)
        assert chat.messages[1].tool_calls[0]["id"] == tid and chat.messages[2].tool_call_id == tid


def test_a_system_message_stands_anywhere_but_first():
    """Anthropic takes role "system" inside ``messages`` as a mid-conversation system
    message: after a user turn (Claude Code sends [user, system, assistant, user]) and after
    an assistant turn (Anthropic's guide appends one there; a 400 here before). As the
    first message it is a 400 about the role, pointing at the top-level ``system``."""
    brief = {"role": "system", "content": "Be brief."}
    hi = {"role": "assistant", "content": "Hi."}
    for ok in ([ASK, brief], [ASK, brief, brief, use("toolu_1"), result("toolu_1"), brief, ASK],
               [ASK, hi, brief, ASK], [ASK, use("toolu_1"), brief, result("toolu_1")]):
        to_chat_request(_request(ok), auto_tools=False)
    for bad in ([brief, ASK], [brief, brief, ASK]):
        for request in (_request(bad), AnthropicCountTokensRequest(model="m", messages=bad)):
            with pytest.raises(SamplingParamsError) as e:
                to_chat_request(request, auto_tools=False)
            assert e.value.param == "messages.0.role" and "as the first message" in str(e.value), str(e.value)
            assert 'Unexpected role "system"' in str(e.value) and "top-level `system`" in str(e.value)


def test_plain_text_documents_and_search_results_are_read_as_text():
    """Agent-door trial: a plain-text ``document`` (source ``text`` or ``content``) and a
    ``search_result`` block, in a user message or a tool_result, were a 400 'not supported:
    text-only model', though a text-only model can read them. They become text under their
    title (and context / source); PDF, URL and file documents stay a 400 naming the block."""
    doc = {"type": "document", "title": "Facts", "context": "from a book", "citations": {"enabled": True},
           "source": {"type": "text", "media_type": "text/plain", "data": "The grass is green."}}
    parts = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "A"},
                                                                             {"type": "text", "text": "B"}]}}
    found = {"type": "search_result", "source": "https://x.example", "title": "T",
             "content": [{"type": "text", "text": "body"}]}
    ask = {"type": "text", "text": "What colour?"}
    chat = to_chat_request(_request([{"role": "user", "content": [doc, parts, found, ask]}]), auto_tools=True)
    assert chat.messages[-1].content == "Facts\nfrom a book\nThe grass is green.\nA\nB\nT\nhttps://x.example\nbody\n" \
                                        "What colour?"
    tool_turn = [ASK, use("t1"), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a"}, found, doc]}]}]
    chat = to_chat_request(_request(tool_turn), auto_tools=True)
    assert chat.messages[-1].role == "tool" and chat.messages[-1].content == \
        "a\nT\nhttps://x.example\nbody\nFacts\nfrom a book\nThe grass is green."
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    for content, param in (([pdf, ask], "messages.0.content.0"),
                           ([{**doc, "title": 5}], "messages.0.content.0.title"),
                           ([{**found, "content": "body"}], "messages.0.content.0.content"),
                           ([{"type": "document", "source": {"type": "content", "content": [
                               {"type": "image", "source": {}}]}}], "messages.0.content.0.source.content.0")):
        assert _param(lambda r: to_chat_request(r, auto_tools=True), _request([{"role": "user", "content": content}])
                      )[0] == param


def test_thinking_with_a_forced_tool_choice_is_anthropics_400():
    """Agent-door trial: thinking with tool_choice any/tool answered 200 (a forced call, the
    thinking switched on in the template) where Anthropic refuses it ("Thinking may not be
    enabled when tool_choice forces tool use"), on /v1/messages and count_tokens alike;
    auto, none and thinking disabled pass."""
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    on = {"type": "enabled", "budget_tokens": 1024}
    for thinking, choice, refused in ((on, {"type": "any"}, True), ({"type": "adaptive"}, {"type": "tool",
                                      "name": "get_weather"}, True), (on, {"type": "auto"}, False),
                                      (on, {"type": "none"}, False), ({"type": "disabled"}, {"type": "any"}, False)):
        for request in (_request([ASK], tools=tools, tool_choice=choice, thinking=thinking),
                        AnthropicCountTokensRequest(model="m", messages=[ASK], tools=tools, tool_choice=choice,
                                                    thinking=thinking)):
            if refused:
                param, words = _param(lambda r: to_chat_request(r, auto_tools=True), request)
                assert param == "tool_choice" and words.startswith("Thinking may not be enabled"), words
            else:
                to_chat_request(request, auto_tools=True)


PREFILL = [{"role": "user", "content": "Capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]
OPEN_PREFILL = "<|im_start|>assistant\nThe capital of France is"


def test_a_final_assistant_message_is_continued_not_answered(app_and_engine):  # noqa: F811
    """Fresh-user trial: a final assistant message (Anthropic's prefill) was closed and a
    new assistant turn opened, so the answer repeated it ("The capital of France is
    Paris."). Now the prompt ends with the prefill left open (one assistant header, no
    <|im_end|> after it), the message and the stream carry only the continuation, and
    input_tokens and count_tokens count that prompt. A text block after a thinking block
    is a prefill too; an empty final assistant message opens the turn; a final tool_use
    turn is not continued; with thinking on a prefill is a 400 naming the message."""
    client, engine = app_and_engine()
    body = {"model": "m", "max_tokens": 5, "messages": PREFILL}
    engine.outputs = [_output(" Paris.", "stop")]
    r = client.post("/v1/messages", json=body)
    prompt = engine.prompts[-1]["prompt"]
    assert r.status_code == 200 and prompt.endswith(OPEN_PREFILL) and prompt.count("<|im_start|>assistant") == 1, prompt
    assert r.json()["content"] == [{"type": "text", "text": " Paris."}] and r.json()["stop_reason"] == "end_turn"
    n_prompt = len(engine.prompts[-1]["prompt_token_ids"])
    assert r.json()["usage"]["input_tokens"] == n_prompt
    assert client.post("/v1/messages/count_tokens", json={"model": "m", "messages": PREFILL}).json() == {
        "input_tokens": n_prompt}
    events = []
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert engine.prompts[-1]["prompt"] == prompt
    assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == " Paris."
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["end_turn"]
    blocks = {"role": "assistant", "content": [{"type": "thinking", "thinking": "France.", "signature": ""},
                                                {"type": "text", "text": "The capital of France is"}]}
    assert client.post("/v1/messages", json={**body, "messages": [PREFILL[0], blocks]}).status_code == 200
    assert engine.prompts[-1]["prompt"] == prompt
    for empty in ("", []):  # prefills nothing: the answer opens the assistant's turn
        client.post("/v1/messages", json={**body, "messages": [PREFILL[0], {"role": "assistant", "content": empty}]})
        opened = engine.prompts[-1]["prompt"]
        assert opened.endswith("Capital of France?<|im_end|>\n<|im_start|>assistant\n"), opened
    tool_turn = {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, {
        "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}
    client.post("/v1/messages", json={**body, "messages": [PREFILL[0], tool_turn]})
    assert engine.prompts[-1]["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
    sent = len(engine.prompts)
    r = client.post("/v1/messages", json={**body, "max_tokens": 2048,
                                          "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"].startswith("messages.1: a final assistant message (a prefill)")
    assert len(engine.prompts) == sent
    with pytest.raises(SamplingParamsError) as e:
        to_chat_request(_request(PREFILL, thinking={"type": "adaptive"}), auto_tools=False)
    assert e.value.param == "messages.1"
    for fine in ({"type": "disabled"}, None):
        assert to_chat_request(_request(PREFILL, thinking=fine), auto_tools=False).continue_final_message
    to_chat_request(_request([PREFILL[0], tool_turn], thinking={"type": "adaptive"}), auto_tools=False)


def test_tool_references_load_deferred_tools():
    # Claude Code's tool search: deferred tools (defer_loading) stay out of the prompt until a
    # tool_result's tool_reference block names one; the block was a 400 ("content blocks of
    # type 'tool_reference' are not supported").
    schema = {"type": "object", "properties": {}}
    tools = [{"name": "ToolSearch", "input_schema": schema},
             {"name": "get_weather", "input_schema": schema, "defer_loading": True},
             {"name": "get_time", "input_schema": schema, "defer_loading": True}]
    search = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
                                                "input": {"query": "weather"}}]}
    found = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
        {"type": "tool_reference", "tool_name": "get_weather", "cache_control": {"type": "ephemeral"}}]}]}
    names = lambda chat: [t["function"]["name"] for t in chat.tools or ()]  # noqa: E731
    assert names(to_chat_request(_request([ASK], tools=tools), auto_tools=True)) == ["ToolSearch"]
    chat = to_chat_request(_request([ASK, search, found], tools=tools), auto_tools=True)
    assert names(chat) == ["ToolSearch", "get_weather"]
    assert chat.messages[-1].content == "Tool loaded: get_weather"
    counted = AnthropicCountTokensRequest(model="m", messages=[ASK, search, found], tools=tools)
    assert names(to_chat_request(counted, auto_tools=False)) == ["ToolSearch", "get_weather"]
    unknown = json.loads(json.dumps(found).replace("get_weather", "no_such_tool"))
    with pytest.raises(SamplingParamsError) as e:
        to_chat_request(_request([ASK, search, unknown], tools=tools), auto_tools=True)
    assert e.value.param == "messages.2.content.0.content.0.tool_name" and e.value.code == "tool_reference_unresolved"
    assert "no_such_tool" not in str(e.value)
    broken = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
        {"type": "tool_reference", "tool_name": 5}]}]}
    assert _param(lambda: to_chat_request(_request([ASK, search, broken], tools=tools), auto_tools=True))[0] == \
        "messages.2.content.0.content.0.tool_name"
    # mid-conversation tool changes (Claude Code 2.1.332's beta): offered / withdrawn by name
    change = lambda kind, name: {"role": "user", "content": [  # noqa: E731
        {"type": kind, "tool": {"type": "tool_reference", "name": name}}, {"type": "text", "text": "Go on."}]}
    chat = to_chat_request(_request([change("tool_addition", "get_time")], tools=tools), auto_tools=True)
    assert names(chat) == ["ToolSearch", "get_time"] and chat.messages[-1].content == "Tool available: get_time\nGo on."
    later = [change("tool_addition", "get_time"), {"role": "assistant", "content": "Ok."},
             change("tool_removal", "ToolSearch")]
    assert names(to_chat_request(_request(later, tools=tools), auto_tools=True)) == ["get_time"]
    assert _param(lambda: to_chat_request(_request([change("tool_removal", "nope")], tools=tools),
                                          auto_tools=True))[0] == "messages.0.content.0.tool.name"
    mcp = {"role": "user", "content": [{"type": "tool_addition", "tool": {"type": "mcp_toolset_reference"}}]}
    assert _param(lambda: to_chat_request(_request([mcp], tools=tools), auto_tools=True))[0] == \
        "messages.0.content.0.tool"
    wrong = [{**tools[1], "defer_loading": "yes"}]
    assert _param(lambda: to_chat_request(_request([ASK], tools=wrong), auto_tools=True))[0] == \
        "tools.0.defer_loading"
