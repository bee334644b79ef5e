"""Tool calling and reasoning on a real server: a tiny scripted Qwen3 checkpoint with a
Qwen3-style tool-aware chat template, served with vLLM's flags
``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``. The
model writes no meaningful calls, so this checks the flags' wiring end to end (tools
rendered by the template, reasoning fields, thinking switched off by the template) and,
case C59, that a JSON schema or forced tool call constrains the answer, never the
reasoning, and, case C56, that ``parallel_tool_calls: false`` keeps only the first call
(there and on the real SmolLM2); the parsers' behaviour on known text is
tests/entrypoints/test_tool_calling.py."""
from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
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
{% if enable_thinking is defined and enable_thinking is false and not bare_thinking_off %}<think>

</think>

{% endif %}{% endif %}"""

# ``bare_thinking_off`` (a chat_template_kwargs entry): thinking switched off without writing
# the closed ``<think></think>`` block, as some templates do; then no ``</think>`` ever comes.
REASONING = "Let me add the two numbers first, then write one short JSON answer."
# Structural JSON tokens the scripted model prefers wherever its script has no next token,
# best first: a grammar then closes each value as soon as it may (the answers terminate).
FALLBACK = {"}": 6.0, "}}": 5.5, "]": 5.0, ",": 4.0, "5": 3.0, '{"': 2.5, "{": 2.0, "[": 1.5}


def _script_qwen3(model, tok) -> None:
    """Make ``model`` (a Qwen3ForCausalLM, hidden size 64) a bigram model: attention and MLP
    add nothing (o_proj, down_proj zero), so the last hidden state is the last token's
    embedding and the logits depend on that token only. After the prompt's final newline it
    writes REASONING (15 tokens) then ``</think>`` (logit 10 each), and everywhere else the
    FALLBACK tokens rank first (then EOS, then all others at 0). Greedy output is then fixed:
    thinking on, the 16th token closes the reasoning; under a grammar, the first allowed
    token of FALLBACK wins, so ``{"answer": 5}`` or a call with ``5`` for each integer."""
    def one(text):
        (tid,) = tok.encode(text, add_special_tokens=False)
        return tid

    # the generation prompt ends with "\n" (one token): the script starts there
    script = [one("\n"), *tok.encode(REASONING, add_special_tokens=False), one("</think>")]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        emb[:, 63] = 1.0  # dimension 63: on for every token, carries the fallback ranking
        for text, score in FALLBACK.items():
            head[one(text), 63] = score
        head[tok.eos_token_id, 63] = 1.0
        for k, (cur, nxt) in enumerate(zip(script, script[1:])):  # dimension k: step k of the script
            emb[cur, k] = 1.0
            head[nxt, k] = 10.0


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
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _script_qwen3(model, tok)
    model.save_pretrained(path)
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
    # thinking is on and 12 tokens end before the script closes it: all output is reasoning (vLLM's qwen3 rule)
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


# ---- C59: a JSON schema or a forced tool call constrains the answer, never the reasoning ----
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
ADD = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
Q59 = [{"role": "user", "content": "What is 2 + 3? Reply in JSON."}]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "ans", "schema": ANSWER}}
# thinking off, by a template that writes the closed <think></think> block, and by one that writes nothing
THINKING_OFF = [{"enable_thinking": False}, {"enable_thinking": False, "bare_thinking_off": True}]


def _reasoning(msg) -> str:
    """The cases' reasoning(msg): ``reasoning``, else ``reasoning_content`` ("" for empty)."""
    extra = msg.model_extra or {}
    return extra.get("reasoning") or extra.get("reasoning_content") or ""


def _chat_stream(client, **body):
    """(content, reasoning, {index: (name, arguments)}, finish_reason) of a streamed chat."""
    content = reasoning = ""
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model="tiny-qwen3", stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += _reasoning(choice.delta)
            for tc in choice.delta.tool_calls or []:
                name, args = calls.get(tc.index, (None, ""))
                calls[tc.index] = (name or tc.function.name, args + (tc.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


@pytest.mark.parametrize("off", THINKING_OFF, ids=["closed-block", "bare"])
def test_json_schema_with_thinking_off_constrains_the_content_c59(qwen3_server, off):
    client = qwen3_server.client()
    body = {"messages": Q59, "response_format": JSON_FORMAT, "temperature": 0, "max_tokens": 40,
            "extra_body": {"chat_template_kwargs": off}}
    r = client.chat.completions.create(model="tiny-qwen3", **body)  # S1
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and _reasoning(choice.message) == "", choice  # A1
    jsonschema.validate(json.loads(choice.message.content), ANSWER)
    content, reasoning, _, finish = _chat_stream(client, **body)  # S2
    assert (content, reasoning, finish) == (choice.message.content, "", "stop")


@pytest.mark.parametrize("off", THINKING_OFF, ids=["closed-block", "bare"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_tool_call_with_thinking_off_c59(qwen3_server, off, tool_choice):
    client = qwen3_server.client()
    body = {"messages": Q59, "tools": ADD, "tool_choice": tool_choice, "temperature": 0, "max_tokens": 60,
            "extra_body": {"chat_template_kwargs": off}}
    r = client.chat.completions.create(model="tiny-qwen3", **body)  # S3
    msg = r.choices[0].message
    assert _reasoning(msg) == "" and msg.tool_calls, r  # A2
    calls = {i: (c.function.name, c.function.arguments) for i, c in enumerate(msg.tool_calls)}
    for name, arguments in calls.values():
        args = json.loads(arguments)
        assert name == "add" and isinstance(args["a"], int) and isinstance(args["b"], int), args
    _, reasoning, streamed, _ = _chat_stream(client, **body)  # S3 streamed
    assert reasoning == "" and streamed == calls


@pytest.mark.parametrize("off", THINKING_OFF, ids=["closed-block", "bare"])
def test_responses_text_format_with_thinking_off_c59(qwen3_server, off):
    r = qwen3_server.client().responses.create(  # S4
        model="tiny-qwen3", input=Q59[0]["content"], max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "ans", "schema": ANSWER}},
        extra_body={"chat_template_kwargs": off})
    assert r.status == "completed" and [o.type for o in r.output] == ["message"], r  # A3
    jsonschema.validate(json.loads(r.output_text), ANSWER)


def test_thinking_on_the_constraint_applies_after_the_reasoning_c59(qwen3_server):
    """S5 (A4): the reasoning is the scripted free text (not JSON), the content after it
    validates; a budget spent while thinking is a length / incomplete finish, not a stop."""
    client = qwen3_server.client()
    r = client.chat.completions.create(model="tiny-qwen3", messages=Q59, response_format=JSON_FORMAT,
                                       temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and _reasoning(choice.message) == REASONING, choice
    jsonschema.validate(json.loads(choice.message.content), ANSWER)
    assert _chat_stream(client, messages=Q59, response_format=JSON_FORMAT, temperature=0, max_tokens=40) == (
        choice.message.content, REASONING, {}, "stop")
    text = {"format": {"type": "json_schema", "name": "ans", "schema": ANSWER}}
    resp = client.responses.create(model="tiny-qwen3", input=Q59[0]["content"], max_output_tokens=40,
                                   temperature=0, text=text)
    assert resp.status == "completed" and [o.type for o in resp.output] == ["reasoning", "message"], resp
    assert resp.output[0].content[0].text == REASONING
    jsonschema.validate(json.loads(resp.output_text), ANSWER)
    # an EOS while thinking cannot end the request before its answer (it would be a "stop"
    # with no content): with EOS pushed far above the rest, the answer is the same
    eos = qwen3_server.post("/tokenize", {"model": "tiny-qwen3", "prompt": "<|im_end|>",
                                          "add_special_tokens": False}).json()["tokens"]
    pushed = client.chat.completions.create(model="tiny-qwen3", messages=Q59, response_format=JSON_FORMAT,
                                            temperature=0, max_tokens=40, logit_bias={str(eos[0]): 100})
    assert pushed.choices[0].finish_reason == "stop" and pushed.choices[0].message.content == choice.message.content
    cut = client.chat.completions.create(model="tiny-qwen3", messages=Q59, response_format=JSON_FORMAT,
                                         temperature=0, max_tokens=8)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.content
    cut = client.responses.create(model="tiny-qwen3", input=Q59[0]["content"], max_output_tokens=8,
                                  temperature=0, text=text)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_completions_structured_output_applies_under_a_reasoning_parser(qwen3_server):
    """vLLM issue 57726 (a neighbour of C59): with ``--reasoning-parser`` set, a
    /v1/completions request with ``structured_outputs`` came back unconstrained with a 200
    (the grammar waited for a ``</think>`` that a plain prompt never opened; here the
    scripted model writes its free-text reasoning). A completion's text is not split into
    reasoning, so the constraint holds from its first token, streamed or not, and on
    llama-server's /completion ``json_schema`` too."""
    schema_body = {"model": "tiny-qwen3", "prompt": "Answer in JSON:", "max_tokens": 40, "temperature": 0,
                   "structured_outputs": {"json": ANSWER}}
    choice = qwen3_server.post("/v1/completions", schema_body).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["text"]), ANSWER)
    forced = {**schema_body, "structured_outputs": {"choice": ["alpha beta"]}}
    assert qwen3_server.post("/v1/completions", forced).json()["choices"][0]["text"] == "alpha beta"
    chunks = qwen3_server.stream_chunks("/v1/completions", {**schema_body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    r = qwen3_server.post("/completion", {"prompt": "Answer in JSON:", "n_predict": 40, "temperature": 0,
                                          "json_schema": ANSWER})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["content"]), ANSWER)


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


# ---- C56: parallel_tool_calls false keeps only the first call, streamed or not ----
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
C56_QUESTION = "What is the weather in Paris and in Oslo? Call the tool once for each city."
P1 = {"messages": [{"role": "user", "content": C56_QUESTION}], "tools": [WEATHER_TOOL], "tool_choice": "required",
      "parallel_tool_calls": False, "temperature": 0, "max_tokens": 200}
GET_N = {"type": "function", "function": {"name": "get_n", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
# Two hermes calls, get_n first: the model's whole output, forced by a one-option choice
# (the stand-in for C57's forced output T4; C57 itself is not in cases.md).
T4 = ('<tool_call>\n{"name": "get_n", "arguments": {"n": 1}}\n</tool_call>\n'
      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def _tool_call_deltas(client, model, **body):
    """Every ``tool_calls`` delta of a streamed chat, in order, and the finish reason."""
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model=model, stream=True, **body):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return deltas, finish


def _assert_weather_call(call) -> None:
    assert call.type == "function" and call.function.name == "get_weather", call
    assert isinstance(json.loads(call.function.arguments)["city"], str), call


def test_parallel_tool_calls_false_keeps_one_forced_call_c56(server):
    """C56 P1 (A1) and P2 (A2) on the real SmolLM2: ``"required"`` with
    ``parallel_tool_calls: false`` is exactly one valid call, ``tool_calls`` finish;
    streamed, every fragment has index 0 and the arguments join to P1's."""
    client = server.client(timeout=600.0)
    choice = client.chat.completions.create(model=MODEL, **P1).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    _assert_weather_call(choice.message.tool_calls[0])
    deltas, finish = _tool_call_deltas(client, MODEL, **P1)
    assert deltas and [d.index for d in deltas] == [0] * len(deltas) and finish == "tool_calls"
    assert "".join(d.function.arguments or "" for d in deltas) == choice.message.tool_calls[0].function.arguments


def test_parallel_tool_calls_true_or_absent_c56(server):
    """C56 P3 (A3): with the flag true, or left out (OpenAI's default is true), at least
    one call and every call valid; how many is the model's choice (not asserted)."""
    client = server.client(timeout=600.0)
    bodies = [{**P1, "parallel_tool_calls": True}, {k: v for k, v in P1.items() if k != "parallel_tool_calls"}]
    with ThreadPoolExecutor(2) as pool:  # one batch: the two run together
        responses = list(pool.map(lambda body: client.chat.completions.create(model=MODEL, **body), bodies))
    for r in responses:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            _assert_weather_call(call)


def test_parallel_tool_calls_false_keeps_the_first_auto_call_c56(qwen3_server):
    """C56 P5 (A5): ``"auto"`` (hermes parser) on an output of two calls, ``get_n`` then
    ``get_weather`` (T4, forced through a one-option ``structured_outputs`` choice with
    thinking off): ``parallel_tool_calls: false`` returns only ``get_n``, whole and
    streamed (the stream never shows index 1); with the flag true both calls come back,
    so the cap is the flag's doing."""
    client = qwen3_server.client()
    body = {**P1, "tools": [GET_N, WEATHER_TOOL], "tool_choice": "auto",
            "extra_body": {"structured_outputs": {"choice": [T4]},
                           "chat_template_kwargs": {"enable_thinking": False}}}
    with ThreadPoolExecutor(3) as pool:  # one batch: the three run together
        whole = pool.submit(client.chat.completions.create, model="tiny-qwen3", **body)
        streamed = pool.submit(_tool_call_deltas, client, "tiny-qwen3", **body)
        parallel = pool.submit(client.chat.completions.create, model="tiny-qwen3",
                               **{**body, "parallel_tool_calls": True})
    choice = whole.result().choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_n" and json.loads(call.function.arguments) == {"n": 1}
    deltas, finish = streamed.result()
    assert [d.index for d in deltas] == [0] * len(deltas) and finish == "tool_calls"
    assert [d.function.name for d in deltas if d.function.name] == ["get_n"]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    both = parallel.result().choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in both.message.tool_calls] == [
        ("get_n", {"n": 1}), ("get_weather", {"city": "Oslo"})]
