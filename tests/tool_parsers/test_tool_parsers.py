"""The tool-call parsers on strings: whole outputs (vLLM's expected calls and content) and
the same outputs streamed, split at every character boundary and in uneven chunks: the
streamed content and calls equal the whole-output ones."""
from __future__ import annotations

import json
import random

import pytest

from llmserve.tool_parsers import ToolParserManager
from llmserve.tool_parsers.forced import NamedToolParser, RequiredToolParser
from llmserve.tool_parsers.json_scan import canonical_json_prefix


def stream(parser, text, cuts):
    """Feed ``text`` cut at ``cuts``; returns (content, [(id, name, arguments)], fragments)."""
    content, calls, frags, prev = "", {}, [], ""
    bounds = sorted(set(cuts) | {len(text)})
    for k in bounds:
        cur = text[:k]
        deltas = [parser.extract_tool_calls_streaming(prev, cur, cur[len(prev):], [], [], [], None)]
        prev = cur
        if k == len(text):
            deltas.append(parser.flush_streaming(text))
        for d in deltas:
            if d is None:
                continue
            content += d.content or ""
            for tc in d.tool_calls or []:
                frags.append(tc)
                entry = calls.setdefault(tc.index, [None, "", ""])
                if tc.id is not None:
                    assert entry[0] is None, "an id appears only in a call's first fragment"
                    entry[0] = tc.id
                    assert tc.type == "function" and tc.function.name
                    entry[1] = tc.function.name
                else:
                    assert tc.function.name is None and tc.type is None
                entry[2] += tc.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], frags


def whole(parser, text):
    info = parser.extract_tool_calls(text, None)
    return info, (info.content or ""), [(c.function.name, c.function.arguments) for c in info.tool_calls]


def check_streaming_equals_whole(make, text):
    info, content, calls = whole(make(), text)
    rng = random.Random(len(text))
    splits = [list(range(1, len(text))), [], sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))]
    for cuts in splits:
        got_content, got_calls, frags = stream(make(), text, cuts)
        assert got_content == content
        assert [(n, a) for _, n, a in got_calls] == calls
        assert all(isinstance(f.index, int) for f in frags)
    return info


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c", '
          '"n": 1.50, "q": "a\\"b\\u00e9\\ud83d\\ude00"}}\n</tool_call>\n<tool_call>\n'
          '{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_whole_and_streamed():
    make = lambda: ToolParserManager.get_tool_parser("hermes")(None)
    info = check_streaming_equals_whole(make, HERMES)
    assert info.tools_called and info.content == "Let me check. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c", "n": 1.5, "q": 'a"bé😀'}), ("get_time", {})]
    assert info.tool_calls[0].function.arguments == '{"city": "Oslo", "unit": "c", "n": 1.5, "q": "a\\"bé😀"}'
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in info.tool_calls)


@pytest.mark.parametrize("text", ["Just text, no calls.", "a < b and <tool", "<tool_call> not json",
                                  '<tool_call>{"name": "f", "arguments": {"a": 1'])
def test_hermes_without_valid_calls_is_content(text):
    make = lambda: ToolParserManager.get_tool_parser("hermes")(None)
    info = make().extract_tool_calls(text, None)
    assert not info.tools_called and info.tool_calls == [] and info.content == text
    # streamed alike: a call is held back until the output ends, so an incomplete or broken one
    # was never sent as a call (its name used to be, the rest then lost)
    assert stream(make(), text, range(1, len(text)))[:2] == (text, [])


def test_llama3_json():
    make = lambda: ToolParserManager.get_tool_parser("llama3_json")(None)
    text = ('<|python_tag|>{"name": "f", "parameters": {"a": [1, 2, {"b": null}]}}; '
            '{"name": "g", "parameters": {"x": true}}')
    info = check_streaming_equals_whole(make, text)
    assert info.content is None
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == [
        ("f", '{"a": [1, 2, {"b": null}]}'), ("g", '{"x": true}')]
    bare = '{"name": "search", "parameters": {"query": "llm serving"}}'
    assert check_streaming_equals_whole(make, bare).tool_calls[0].function.name == "search"
    plain = "The weather is fine."
    assert check_streaming_equals_whole(make, plain).content == plain


def test_mistral():
    make = lambda: ToolParserManager.get_tool_parser("mistral")(None)
    text = 'Sure [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "x"}}]'
    info = check_streaming_equals_whole(make, text)
    assert info.content == "Sure "
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == [
        ("f", '{"a": 1}'), ("g", '{"b": "x"}')]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in info.tool_calls)  # Mistral's id form
    v11 = 'Sure [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b": "x"}'
    info = check_streaming_equals_whole(make, v11)
    assert info.content == "Sure "
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == [
        ("f", '{"a": 1}'), ("g", '{"b": "x"}')]


def test_pythonic():
    make = lambda: ToolParserManager.get_tool_parser("pythonic")(None)
    text = '[get_weather(city="San Francisco", metric=\'celsius\'), register(tags=["a", "b"], n=3, ok=True, x=None)]'
    info = check_streaming_equals_whole(make, text)
    assert info.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
        ("register", {"tags": ["a", "b"], "n": 3, "ok": True, "x": None})]
    for plain in ["No tools needed.", "[1, 2, 3]", "[f(x=undefined_name)]"]:
        info = check_streaming_equals_whole(make, plain)
        assert not info.tools_called and info.content == plain


def test_required_and_named_outputs():
    text = '[{"name": "subtract", "parameters": {"a": 9, "b": 5}}, {"name": "add", "parameters": {"a": 1, "b": 2}}]'
    info = check_streaming_equals_whole(lambda: RequiredToolParser(None), text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("subtract", {"a": 9, "b": 5}), ("add", {"a": 1, "b": 2})]
    named = '{ "a" : 9,\n "b": -5.25e1 }'
    info = check_streaming_equals_whole(lambda: NamedToolParser(None, "subtract"), named)
    assert info.tool_calls[0].function.name == "subtract"
    assert json.loads(info.tool_calls[0].function.arguments) == {"a": 9, "b": -52.5}
    # cut by max_tokens: still the named call, its arguments the text so far, as streamed (vLLM)
    info = check_streaming_equals_whole(lambda: NamedToolParser(None, "subtract"), '{ "a" : 9,\n "b": -5')
    assert info.tools_called and info.content is None and info.tool_calls[0].function.arguments.startswith('{"a": 9')


def test_first_fragment_has_id_type_name_then_only_arguments():
    text = '[{"name": "subtract", "parameters": {"a": 9, "b": 5}}]'
    _, calls, frags = stream(RequiredToolParser(None), text, range(1, len(text)))
    assert frags[0].id and frags[0].type == "function" and frags[0].function.name == "subtract"
    later = [f.model_dump() for f in frags[1:]]
    assert later and all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in later)
    assert json.loads(calls[0][2]) == {"a": 9, "b": 5}


VALUES = [{"a": 1, "b": [True, False, None], "c": {"d": "x\ny\t\"q\" \\ é 😀"}}, [], {}, [1.5, -2e-3, 10],
          {"k": ""}, "plain", 12345, {"nested": [[[{}]]]}]


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("indent", [None, 2])
def test_canonical_prefix_is_monotone_and_ends_at_json_dumps(value, indent):
    raw = json.dumps(value, indent=indent, ensure_ascii=indent is None)
    raw += " " if not isinstance(value, (dict, list, str)) else ""  # a scalar ends at a delimiter
    final = canonical_json_prefix(raw)
    assert final == json.dumps(value, ensure_ascii=False)
    prev = ""
    for k in range(len(raw) + 1):
        cur = canonical_json_prefix(raw[:k])
        assert final.startswith(cur) and cur.startswith(prev)
        prev = cur


def test_registry():
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(ToolParserManager.list_registered())
    with pytest.raises(KeyError, match="not registered"):
        ToolParserManager.get_tool_parser("nope")
