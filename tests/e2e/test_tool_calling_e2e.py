"""Tool calling and reasoning on a real server: a tiny random Qwen3 checkpoint with a
Qwen3-style tool-aware chat template, served with vLLM's flags
``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``. A random
model writes no meaningful calls, so this checks the flags' wiring end to end (tools
rendered by the template, reasoning fields, thinking switched off by the template); the
parsers' behaviour on known text is tests/entrypoints/test_tool_calling.py."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from e2e_utils import MODEL, RemoteServer

QWEN3_STYLE_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    import transformers as tf

    from llmserve.tokenizer import get_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-qwen3-tools"))
    tok = get_tokenizer("SmolLM2-135M-Instruct")
    tok = copy.deepcopy(tok)  # the loaded tokenizer is shared
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = tf.Qwen3Config(vocab_size=49216, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    srv = RemoteServer(["--model", path, "--served-model-name", "tiny-qwen3", "--dtype", "float32",
                        "--kv-cache-memory", "64MiB", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3"])
    yield srv
    srv.stop()


def _chat(srv, **kw):
    body = {"model": "tiny-qwen3", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 12, "temperature": 0, **kw}
    return srv.http.post("/v1/chat/completions", json=body)


def test_auto_tools_and_reasoning_flags_end_to_end(qwen3_server):
    r = _chat(qwen3_server)  # tools without tool_choice: "auto", allowed by the flags
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    # thinking is on and a random model never closes it: all output is reasoning (vLLM's qwen3 rule)
    assert msg["reasoning"] and msg["reasoning"] == msg["reasoning_content"] and msg["content"] is None
    assert msg["tool_calls"] == [] and choice["finish_reason"] == "length"
    with qwen3_server.http.stream("POST", "/v1/chat/completions",
                                  json={"model": "tiny-qwen3", "messages": MESSAGES, "tools": TOOLS,
                                        "max_tokens": 12, "temperature": 0, "stream": True}) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks if c["choices"])
    assert streamed == msg["reasoning"]


def test_thinking_off_in_the_template_makes_content(qwen3_server):
    r = _chat(qwen3_server, chat_template_kwargs={"enable_thinking": False}, tool_choice="none")
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning"] is None and msg["content"]


def test_the_template_sees_the_tools(qwen3_server):
    body = {"model": "tiny-qwen3", "messages": MESSAGES}
    with_tools = qwen3_server.http.post("/tokenize", json={**body, "tools": TOOLS}).json()["tokens"]
    without = qwen3_server.http.post("/tokenize", json=body).json()["tokens"]
    text = qwen3_server.http.post("/detokenize", json={"model": "tiny-qwen3", "tokens": with_tools}).json()["prompt"]
    assert len(with_tools) > len(without) and '"name": "get_weather"' in text and "<tools>" in text


# ---- C25 on the real SmolLM2: required and named choices are forced by structured outputs ----
SUBTRACT = [{"type": "function", "function": {
    "name": "subtract", "description": "Return a minus b",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]
W1 = {"messages": [{"role": "user", "content": "What is 9 minus 5?"}], "tools": SUBTRACT, "tool_choice": "required",
      "temperature": 0, "max_tokens": 128}


def _streamed_calls(client, **body):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **body):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                assert isinstance(tc.index, int)
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id is not None:
                    assert entry["id"] is None, "C25 A3: an id only in its call's first fragment"
                    entry["id"], entry["name"] = tc.id, tc.function.name
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice,finish", [("required", "tool_calls"),
                                           ({"type": "function", "function": {"name": "subtract"}}, "stop")])
def test_c25_forced_tool_calls_whole_and_streamed(server, choice, finish):
    client = server.client(timeout=600.0)
    # One call (greedy SmolLM2 repeats the call three times otherwise, which only makes the
    # test slower; several calls are covered on known text in tests/entrypoints/test_tool_calling.py).
    body = {**W1, "tool_choice": choice, "parallel_tool_calls": False}
    r = client.chat.completions.create(model=MODEL, **body)  # W1 / W3
    c = r.choices[0]
    assert c.finish_reason == finish and c.message.content in (None, "") and c.message.tool_calls
    call = c.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name == "subtract"
    args = json.loads(call.function.arguments)
    assert isinstance(args["a"], (int, float)) and isinstance(args["b"], (int, float))
    calls, stream_finish = _streamed_calls(client, **body)  # W2 / W3 streamed
    assert stream_finish == finish and len(calls) == len(c.message.tool_calls)
    assert calls[0]["id"] and calls[0]["name"] == "subtract" and json.loads(calls[0]["arguments"]) == args


def test_c25_none_and_missing_tools(server):
    client = server.client(timeout=600.0)
    r = client.chat.completions.create(model=MODEL, **{**W1, "tool_choice": "none", "max_tokens": 8})  # W4
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    w5 = server.post("/v1/chat/completions", {"model": MODEL, **{k: v for k, v in W1.items() if k != "tools"}})
    assert w5.status_code == 400 and w5.json()["error"]["param"] == "tool_choice"
    # a schema that is valid JSON Schema but cannot become a grammar: 400 naming the tools
    dangling = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]
    for stream in (False, True):
        r = server.post("/v1/chat/completions", {"model": MODEL, **W1, "tools": dangling, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "subtract"}}])
def test_forced_call_cut_by_max_tokens_is_an_error_not_content(server, choice):
    """A forced call that max_tokens cuts is neither grammar text as content nor a call
    whose arguments are not JSON: a 400 naming the budget field (vLLM fails the request),
    and in a stream an error event after the fragments."""
    body = {"model": MODEL, **W1, "tool_choice": choice, "max_tokens": 6}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = server.post("/v1/chat/completions", {**body, "max_completion_tokens": 6, "max_tokens": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    _, events = server.sse_events("/v1/chat/completions", {**body, "stream": True})
    payloads = [json.loads(e) for e in events if e != "[DONE]"]
    assert "error" in payloads[-1] and payloads[-1]["error"]["param"] == "max_tokens"
    assert not any(c["choices"] and c["choices"][0].get("finish_reason") for c in payloads[:-1])
    server.assert_healthy()
