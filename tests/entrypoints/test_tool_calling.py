"""Tool calling and reasoning through the real chat handler, renderer and app, over a
scripted engine that "generates" known text (a tiny random model writes no tool calls,
and the forced outputs of ``required``/named choices are the engine's structured outputs,
tested end to end in tests/e2e/test_tool_calling_e2e.py). Streamed responses are built
from one-character deltas and must equal the whole responses. Cases C25, C48 and C56."""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from llmserve.entrypoints.openai.api_server import build_app, init_app_state, shutdown_app_state
from llmserve.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import RequestOutputKind

SUBTRACT = [{"type": "function", "function": {
    "name": "subtract", "description": "Return a minus b",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
W1 = {"model": "m", "messages": [{"role": "user", "content": "What is 9 minus 5?"}], "tools": SUBTRACT,
      "tool_choice": "required", "temperature": 0, "max_tokens": 128}
# A template that shows the tools, the tool calls and the tool results it is given.
TOOL_TEMPLATE = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}<{{ m.role }}>"
                 "{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<call {{ c.function.name }} "
                 "{{ c.function.arguments | tojson }}>{% endfor %}{% endif %}</{{ m.role }}>\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


class ScriptedEngine:
    """Yields ``text`` (one character per delta when streaming) and records each call."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=4096, vocab_size=len(tokenizer), served_model_name=("m",),
                                            model="m")
        self.generation_config_defaults = {}
        self.errored = False
        self.text = ""
        self.calls = []

    async def check_health(self):
        pass

    async def generate(self, prompt, params, request_id, priority=0, **kwargs):
        self.calls.append(SimpleNamespace(prompt=prompt, params=params, kwargs=kwargs))
        pieces = list(self.text) if params.output_kind == RequestOutputKind.DELTA else [self.text]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None,
                                [CompletionOutput(0, piece, [5], None, None, "stop" if last else None)], last)


@pytest.fixture(scope="module")
def think_tokenizer(smol_tokenizer):
    """SmolLM2's tokenizer plus Qwen3's think and tool-call tokens."""
    tok = copy.deepcopy(smol_tokenizer)
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    return tok


# the flags of an app whose requests send their own chat_template (refused without them)
TRUSTED = ("--trust-request-chat-template", "--request-chat-template-workers", "1")


@pytest.fixture
def app(smol_tokenizer, think_tokenizer):
    states = []

    def make(*flags, tokenizer=None):
        args = make_arg_parser(argparse.ArgumentParser()).parse_args(list(flags))
        validate_parsed_serve_args(args)
        engine = ScriptedEngine(tokenizer or smol_tokenizer)
        application = build_app(args)
        asyncio.run(init_app_state(engine, application.state, args))
        states.append(application.state)
        return TestClient(application), engine
    yield make
    for state in states:  # the renderer pools (and request-template workers)
        shutdown_app_state(state)


def post(client, body):
    return client.post("/v1/chat/completions", json=body)


def stream_chunks(client, body):
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def assemble(chunks):
    """Content, reasoning, calls (grouped by index: id, name, arguments) and the finish reason."""
    content = reasoning = ""
    calls, finish = {}, None
    for ch in chunks:
        for choice in ch["choices"]:
            d = choice["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning") or ""
            assert d.get("reasoning") == d.get("reasoning_content")
            for tc in d.get("tool_calls") or []:
                assert isinstance(tc["index"], int)
                entry = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                if "id" in tc:  # C25 A3: the id only in the first fragment, with type and name
                    assert entry["id"] is None and tc["type"] == "function" and tc["function"]["name"]
                    entry["id"], entry["name"] = tc["id"], tc["function"]["name"]
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                entry["arguments"] += tc["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_c25_required_whole_and_streamed(app):
    client, engine = app()
    engine.text = '[{"name": "subtract", "parameters": {"a": 9, "b": 5}}]'
    r = post(client, W1)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] in (None, "")
    call = msg["tool_calls"][0]
    assert call["id"] and call["type"] == "function" and call["function"]["name"] == "subtract"
    args = json.loads(call["function"]["arguments"])
    assert args == {"a": 9, "b": 5}
    schema = engine.calls[0].params.structured_outputs.json  # the forced shape (vLLM's)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    option = schema["items"]["anyOf"][0]
    assert option["properties"]["name"] == {"type": "string", "enum": ["subtract"]}
    assert option["properties"]["parameters"] == SUBTRACT[0]["function"]["parameters"]
    content, _, calls, finish = assemble(stream_chunks(client, W1))  # W2
    assert content == "" and finish == "tool_calls" and len(calls) == len(msg["tool_calls"])
    assert calls[0]["name"] == "subtract" and json.loads(calls[0]["arguments"]) == args


def test_c25_named_choice_whole_and_streamed(app):
    client, engine = app()
    engine.text = '{"a": 9, "b": 5}'
    body = {**W1, "tool_choice": {"type": "function", "function": {"name": "subtract"}}}
    r = post(client, body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # vLLM's for a named choice (OpenAI's too)
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "subtract" and json.loads(call["function"]["arguments"]) == {"a": 9, "b": 5}
    assert engine.calls[0].params.structured_outputs.json == SUBTRACT[0]["function"]["parameters"]
    content, _, calls, finish = assemble(stream_chunks(client, body))
    assert finish == "stop" and content == "" and [c["name"] for c in calls] == ["subtract"]
    assert json.loads(calls[0]["arguments"]) == {"a": 9, "b": 5}


def test_c25_none_and_no_tools(app):
    client, engine = app(*TRUSTED)
    engine.text = "9 minus 5 is 4."
    r = post(client, {**W1, "tool_choice": "none", "chat_template": TOOL_TEMPLATE})  # W4
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "9 minus 5 is 4." and not msg["tool_calls"]
    assert engine.calls[0].params.structured_outputs is None
    assert '"name": "subtract"' in engine.calls[0].prompt["prompt"]  # vLLM shows the tools with "none"
    t = client.post("/tokenize", json={"model": "m", "messages": W1["messages"], "tools": SUBTRACT,
                                       "chat_template": TOOL_TEMPLATE})
    assert t.json()["tokens"] == engine.calls[0].prompt["prompt_token_ids"]  # /tokenize renders the tools too
    bad = client.post("/tokenize", json={"model": "m", "messages": W1["messages"], "tools": [{"type": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].type"
    body = {k: v for k, v in W1.items() if k != "tools"}  # W5
    r = post(client, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("tools,choice,param", [
    # the exact field, as OpenAI names it (it was "tools" for all of these)
    ([{"type": "function", "function": {"name": "bad name!"}}], "required", "tools[0].function.name"),
    ([{"type": "function", "function": {"description": "no name"}}], "required", "tools[0].function.name"),
    ([{"type": "function"}], "required", "tools[0].function"),
    ([{"type": "retrieval"}], "required", "tools[0].type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "required",
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}], "required",
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 5}}], "required", "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "required", "tools[0].function.strict"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "required", "tools[1].function.name"),
    (SUBTRACT, {"type": "function", "function": {"name": "add"}}, "tool_choice"),
    (SUBTRACT, {"type": "function"}, "tool_choice.function"),
    (SUBTRACT, "sometimes", "tool_choice"),
    (SUBTRACT, "auto", "tool_choice"),  # no --enable-auto-tool-choice
    (SUBTRACT, None, "tool_choice"),  # tools without a choice mean "auto" (vLLM)
])
def test_bad_tools_and_choices_are_400s_naming_the_field(app, tools, choice, param):
    client, engine = app()
    body = {**W1, "tools": tools, "tool_choice": choice}
    for stream in (False, True):
        r = post(client, {**body, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert engine.calls == []


def test_parallel_tool_calls_false_allows_one_call(app):
    client, engine = app()
    engine.text = '[{"name": "subtract", "parameters": {"a": 9, "b": 5}}]'
    r = post(client, {**W1, "parallel_tool_calls": False, "tools": SUBTRACT + [WEATHER]})
    assert r.status_code == 200
    schema = engine.calls[0].params.structured_outputs.json
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2


# C56's output of two calls (get_n first), in hermes form
TWO_HERMES_CALLS = ('<tool_call>\n{"name": "get_n", "arguments": {"n": 1}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
GET_N = {"type": "function", "function": {"name": "get_n", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}}}}}


def test_parallel_tool_calls_false_keeps_the_first_auto_call_c56(app, think_tokenizer):
    """C56 A5 on known text, one character per streamed delta: an ``"auto"`` output of
    two hermes calls (``get_n`` first) with ``parallel_tool_calls: false`` gives only
    ``get_n``, whole and streamed, and no fragment of the second call; unset, both.
    (End to end: tests/e2e/test_tool_calling_e2e.py.)"""
    client, engine = app("--enable-auto-tool-choice", "--tool-call-parser", "hermes", tokenizer=think_tokenizer)
    engine.text = TWO_HERMES_CALLS
    body = {**W1, "tools": [GET_N, WEATHER], "tool_choice": "auto", "parallel_tool_calls": False}
    choice = post(client, body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]
            ] == [("get_n", {"n": 1})]
    chunks = stream_chunks(client, body)
    indexes = {tc["index"] for ch in chunks for c in ch["choices"] for tc in c["delta"].get("tool_calls") or []}
    content, _, calls, finish = assemble(chunks)
    assert (content, finish, indexes) == ("", "tool_calls", {0})
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    unset = {k: v for k, v in body.items() if k != "parallel_tool_calls"}
    names = [c["function"]["name"] for c in post(client, unset).json()["choices"][0]["message"]["tool_calls"]]
    assert names == ["get_n", "get_weather"]
    assert [c["name"] for c in assemble(stream_chunks(client, unset))[2]] == ["get_n", "get_weather"]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_n", "arguments": {"n": 1,,}}\n</tool_call>',  # broken JSON inside the markers
    '<tool_call>\n{"name": "get_n", "arguments": {"n": 1}\n</tool_call>',  # the object never closed
    'Sure. <tool_call>\n{"name": "get_n", "arguments": {"n": 1}}\n</tool_call>\n<tool_call>{"name": "get_n", '
    '"arguments": {"n": tw',  # a good call, then a broken one: the whole output is content (vLLM)
])
def test_a_malformed_tool_call_is_the_same_content_streamed_or_not(app, think_tokenizer, text):
    """A malformed call inside the markers: the whole output is content with finish
    "stop" (vLLM's whole-output rule), and the stream, one character per delta, says the
    same: it sent the call's name and arguments as they came, then finished "tool_calls"
    with a call whose arguments were not JSON."""
    client, engine = app("--enable-auto-tool-choice", "--tool-call-parser", "hermes", tokenizer=think_tokenizer)
    engine.text = text
    body = {**W1, "tools": [GET_N], "tool_choice": "auto"}
    choice = post(client, body).json()["choices"][0]
    assert choice["message"]["content"] == text and not choice["message"]["tool_calls"]
    content, _, calls, finish = assemble(stream_chunks(client, body))
    assert (content, calls, finish) == (text, [], choice["finish_reason"])


def test_parallel_tool_calls_false_on_responses_c56(app, think_tokenizer):
    """C56 A4 (and A5) on /v1/responses, flat tool form: ``"required"`` with the flag
    false forces at most one call (the schema's maxItems) and gives one ``function_call``
    item; ``"auto"`` over two written calls keeps the first, whole and streamed."""
    client, engine = app("--enable-auto-tool-choice", "--tool-call-parser", "hermes", tokenizer=think_tokenizer)
    flat = [{"type": "function", **t["function"]} for t in (GET_N, WEATHER)]
    body = {"model": "m", "input": "n and the weather in Oslo?", "tools": flat, "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 200}
    engine.text = '[{"name": "get_n", "parameters": {"n": 1}}]'
    r = client.post("/v1/responses", json=body).json()
    assert engine.calls[-1].params.structured_outputs.json["maxItems"] == 1
    assert [(o["type"], o["name"]) for o in r["output"]] == [("function_call", "get_n")], r
    assert r["parallel_tool_calls"] is False and r["status"] == "completed"
    engine.text = TWO_HERMES_CALLS
    r = client.post("/v1/responses", json={**body, "tool_choice": "auto"}).json()
    assert [(o["type"], o["name"], json.loads(o["arguments"])) for o in r["output"]] == [
        ("function_call", "get_n", {"n": 1})], r
    stream = client.post("/v1/responses", json={**body, "tool_choice": "auto", "stream": True})
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in stream.text.strip().split("\n\n")]
    added = [e["item"]["name"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["get_n"] and [o["arguments"] for o in events[-1]["response"]["output"]] == ['{"n": 1}']


HERMES_OUT = ('<think>The user wants 9-5.</think>Let me compute. <tool_call>\n{"name": "subtract", '
              '"arguments": {"a": 9, "b": 5}}\n</tool_call>')


def test_auto_hermes_with_qwen3_reasoning(app, think_tokenizer):
    client, engine = app("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                         tokenizer=think_tokenizer)
    engine.text = HERMES_OUT
    body = {**W1, "tool_choice": "auto"}
    r = post(client, body)
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["reasoning"] == msg["reasoning_content"] == "The user wants 9-5."
    assert msg["content"] == "Let me compute. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("subtract", {"a": 9, "b": 5})]
    call = engine.calls[0]
    assert call.params.structured_outputs is None and call.params.skip_special_tokens is False
    assert call.kwargs == {"reasoning_ended": False, "reasoning_parser_kwargs": {"chat_template_kwargs": {}}}
    content, reasoning, calls, finish = assemble(stream_chunks(client, body))
    assert (content, reasoning, finish) == ("Let me compute. ", "The user wants 9-5.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    # no tool call in the output: content (and no tool_calls finish)
    engine.text = "<think>easy</think>4"
    r = post(client, body)
    assert r.json()["choices"][0]["message"]["content"] == "4"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    # include_reasoning false: the reasoning is left out
    r = post(client, {**body, "include_reasoning": False})
    assert r.json()["choices"][0]["message"]["reasoning"] is None
    assert engine.calls[-1].kwargs["reasoning_ended"] is True


def test_reasoning_ended_in_the_prompt_makes_all_output_content(app, think_tokenizer):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}<think>\n\n</think>\n\n"
    client, engine = app("--reasoning-parser", "qwen3", *TRUSTED, tokenizer=think_tokenizer)
    engine.text = "plain answer</think>"
    body = {**W1, "tools": None, "tool_choice": None, "chat_template": template,
            "chat_template_kwargs": {"enable_thinking": False}}
    r = post(client, body)
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "plain answer</think>" and msg["reasoning"] is None
    assert engine.calls[0].kwargs == {"reasoning_ended": True,
                                      "reasoning_parser_kwargs": {"chat_template_kwargs": {"enable_thinking": False}}}


def test_flags_are_checked_at_start():
    parse = lambda *f: validate_parsed_serve_args(make_arg_parser(argparse.ArgumentParser()).parse_args(list(f)))
    with pytest.raises(ValueError, match="--tool-call-parser"):
        parse("--enable-auto-tool-choice")
    with pytest.raises(ValueError, match="not registered"):
        parse("--enable-auto-tool-choice", "--tool-call-parser", "nope")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        parse("--reasoning-parser", "nope")
    with pytest.raises(ValueError, match="--tool-parser-plugin.*not a file"):
        parse("--tool-parser-plugin", "no_such_plugin.py")


def test_reasoning_parser_needs_think_tokens(app):
    with pytest.raises(ValueError, match="think"):
        app("--reasoning-parser", "deepseek_r1")  # SmolLM2's vocabulary has no <think>


# ---- C48: tool-call history in OpenAI form --------------------------------------------
def history(assistant_content="null", tool_content="TEMP_RESULT_17C"):
    assistant = {"role": "assistant", "tool_calls": [{"id": "call_x1", "type": "function", "function": {
        "name": "get_temp", "arguments": '{"city": "Oslo"}'}}]}
    if assistant_content != "absent":
        assistant["content"] = None if assistant_content == "null" else assistant_content
    return [{"role": "user", "content": "How warm is it in Oslo?"}, assistant,
            {"role": "tool", "tool_call_id": "call_x1", "content": tool_content}]


H = {"H1": history(), "H2": history("absent"), "H3": history(""),
     "H4": history(tool_content=[{"type": "text", "text": "TEMP_RESULT_17C"}])}
H5 = [{"role": "user", "content": "How warm is it in Oslo?"}, {"role": "assistant", "content": "ok", "tool_calls": []},
      {"role": "user", "content": "thanks"}]
# Llama 3.1's rule: an assistant message with a tool_calls key must hold exactly one call
LLAMA_LIKE = ("{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls is defined %}"
              "{% if m.tool_calls | length != 1 %}{{ raise_exception('one tool call only') }}{% endif %}"
              "<|python_tag|>{{ m.tool_calls[0].function | tojson }}{% elif m.role == 'tool' %}"
              "<|ipython|>{{ m.content }}{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}<|eot|>{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("template", [None, TOOL_TEMPLATE, LLAMA_LIKE], ids=["smollm2", "tool-aware", "llama-like"])
def test_c48_tool_call_history(app, smol_tokenizer, template):
    client, engine = app(*(TRUSTED if template else ()))
    engine.text = "17C"
    extra = {"chat_template": template} if template else {}
    ids = {}
    for name, msgs in {**H, "H5": H5}.items():
        r = post(client, {"model": "m", "messages": msgs, "max_tokens": 8, "temperature": 0, **extra})
        assert r.status_code == 200, (name, r.text)
        t = client.post("/tokenize", json={"model": "m", "messages": msgs, "add_generation_prompt": True, **extra})
        assert t.status_code == 200, (name, t.text)
        ids[name] = t.json()["tokens"]
        assert ids[name] == engine.calls[-1].prompt["prompt_token_ids"]
    assert ids["H1"] == ids["H2"] == ids["H3"] == ids["H4"]  # null, absent, "" and parts are one thing
    text = smol_tokenizer.decode(ids["H1"])
    assert text.count("TEMP_RESULT_17C") == 1
    assert text.index("TEMP_RESULT_17C") > text.index("assistant" if template != LLAMA_LIKE else "<|python_tag|>")
    if template == TOOL_TEMPLATE:  # the call reaches the template with dict arguments
        assert '<call get_temp {"city": "Oslo"}>' in text
    assert "tool_calls" not in engine.calls[-1].prompt["prompt"]


# ---- --tool-parser-plugin: a vLLM-style plugin file registers a parser ---------------------
PLUGIN = """
import json
from llmserve.entrypoints.openai.chat_completion.protocol import (
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, ExtractedToolCallInformation, FunctionCall, ToolCall)
from llmserve.tool_parsers import ToolParser, ToolParserManager


@ToolParserManager.register_module(["angle_calls"])
class AngleToolParser(ToolParser):
    # vLLM's plugin shape: its own extract methods; calls look like <<name {json}>>.
    def extract_tool_calls(self, model_output, request):
        if not model_output.startswith("<<"):
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        name, _, args = model_output[2:-2].partition(" ")
        call = ToolCall(function=FunctionCall(name=name, arguments=json.dumps(json.loads(args))))
        return ExtractedToolCallInformation(tools_called=True, tool_calls=[call], content=None)

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, previous_token_ids,
                                     current_token_ids, delta_token_ids, request):
        if not current_text.startswith("<"):
            return DeltaMessage(content=delta_text)
        if not current_text.endswith(">>") or len(current_text) < 4:
            return None
        info = self.extract_tool_calls(current_text, request)
        c = info.tool_calls[0]
        return DeltaMessage(tool_calls=[DeltaToolCall(index=0, id=c.id, type="function", function=DeltaFunctionCall(
            name=c.function.name, arguments=c.function.arguments))])
"""


def test_tool_parser_plugin_registers_a_parser_for_auto(app, tmp_path, monkeypatch):
    """vLLM's --tool-parser-plugin: the file is imported, its parser becomes a valid
    --tool-call-parser and parses auto tool calls, whole and streamed."""
    # The plugin's registration must not outlive this test (the flag table lists the parsers).
    from llmserve.tool_parsers import ToolParserManager
    monkeypatch.setattr(ToolParserManager, "_registry", dict(ToolParserManager._registry))
    plugin = tmp_path / "angle_plugin.py"
    plugin.write_text(PLUGIN)
    client, engine = app("--tool-parser-plugin", str(plugin), "--enable-auto-tool-choice",
                         "--tool-call-parser", "angle_calls")
    engine.text = '<<subtract {"a": 9, "b": 5}>>'
    body = {**W1, "tool_choice": "auto"}
    r = post(client, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "subtract", "arguments": '{"a": 9, "b": 5}'}
    content, _, calls, finish = assemble(stream_chunks(client, body))
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("subtract", '{"a": 9, "b": 5}')]
    engine.text = "No tool needed."
    assert post(client, body).json()["choices"][0]["message"]["content"] == "No tool needed."
    assert assemble(stream_chunks(client, body))[0] == "No tool needed."


def test_tool_parser_plugin_that_fails_to_import_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken_plugin.py"
    bad.write_text("raise RuntimeError('boom')\n")
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--tool-parser-plugin", str(bad)])
    with pytest.raises(ValueError, match=r"--tool-parser-plugin: .*broken_plugin.py.*RuntimeError: boom"):
        validate_parsed_serve_args(args)
