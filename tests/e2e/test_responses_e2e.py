"""``/v1/responses`` on a real server (the real SmolLM2, greedy) with the official openai
client and an openai-agents Agent on its default Responses model (issue 13, case C36).
One server for the module, started with the chat tool flags (``--enable-auto-tool-choice
--tool-call-parser hermes``) so the agent's turns after its forced tool call (tool
choice reset to auto, as the SDK does) are served like chat's."""
from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

from e2e_utils import MODEL, RemoteServer, metric_sum

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
FORCE = {"type": "function", "name": "get_weather"}
Q = "What is 2+2?"


@pytest.fixture(scope="module")
def rserver():
    srv = RemoteServer(["--kv-cache-memory", "128MiB", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--responses-store-max-entries", "64"])
    yield srv
    srv.stop()


def _count(srv, messages):
    return srv.post("/tokenize", {"model": MODEL, "messages": messages}).json()["count"]


def test_plain_and_instructions_equal_chat_with_exact_usage(rserver):
    c = rserver.client()
    r = c.responses.create(model=MODEL, input=Q, instructions="Answer briefly.", max_output_tokens=12,
                           temperature=0, metadata={"run": "e2e"})
    assert r.object == "response" and r.id.startswith("resp") and isinstance(r.created_at, (int, float))
    assert r.model == MODEL and r.metadata == {"run": "e2e"} and r.instructions == "Answer briefly."
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": Q}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens == _count(rserver, messages)
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_max_output_tokens_incomplete_and_streams_c36(rserver):
    c = rserver.client()
    o1 = c.responses.create(model=MODEL, input=Q, max_output_tokens=1)
    assert o1.status == "incomplete" and o1.incomplete_details.reason == "max_output_tokens"
    assert o1.usage.output_tokens == 1 and o1.usage.input_tokens > 0
    assert o1.usage.total_tokens == o1.usage.input_tokens + 1
    assert o1.output[0].type == "message" and o1.output_text
    o2 = c.responses.create(model=MODEL, input=Q, max_output_tokens=64, temperature=0)
    if o2.usage.output_tokens < 64:
        assert o2.status == "completed" and o2.incomplete_details is None and o2.output_text
    for whole, kwargs in ((o1, {"max_output_tokens": 1, "temperature": 0}),
                          (o2, {"max_output_tokens": 64, "temperature": 0})):
        with c.responses.stream(model=MODEL, input=Q, **kwargs) as s:
            events = list(s)
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.in_progress"]
        terminal = [t for t in types if t in ("response.completed", "response.incomplete", "response.failed")]
        assert terminal == [types[-1]] == [f"response.{whole.status}"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        if whole is o2:
            assert text == whole.output_text
        assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
        assert events[-1].response.usage.input_tokens == whole.usage.input_tokens
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * (len(types) - 8),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]


def test_previous_response_id_retrieve_delete_and_404s(rserver):
    c = rserver.client()
    first = c.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8, temperature=0)
    second = c.responses.create(model=MODEL, input="Name another one.", previous_response_id=first.id,
                                max_output_tokens=8, temperature=0)
    conversation = [{"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "Name another one."}]
    assert second.usage.input_tokens == _count(rserver, conversation)
    assert second.previous_response_id == first.id
    assert c.responses.retrieve(first.id).output_text == first.output_text
    c.responses.delete(first.id)
    for call in (lambda: c.responses.retrieve(first.id), lambda: c.responses.delete(first.id),
                 lambda: c.responses.create(model=MODEL, input="x", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = c.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="hi", max_output_tokens=0)
    assert e.value.body["param"] == "max_output_tokens"
    dropped = c.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=1,
                                                    tools=[{"type": "web_search"}])  # dropped, not a 400
    assert dropped.headers["x-llmserve-dropped-tools"] == "web_search"
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="no-such-model", input="hi")


def test_json_schema_text_format(rserver):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = rserver.client().responses.create(
        model=MODEL, input="Give me a person.", max_output_tokens=48, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_forced_function_tool_then_function_call_output(rserver):
    c = rserver.client()
    r = c.responses.create(model=MODEL, input="What is the weather in Oslo?", tools=TOOLS, tool_choice=FORCE,
                           max_output_tokens=24, temperature=0)
    assert [o.type for o in r.output] == ["function_call"] and r.status == "completed"
    call = r.output[0]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    with c.responses.stream(model=MODEL, input="What is the weather in Oslo?", tools=TOOLS, tool_choice=FORCE,
                            max_output_tokens=24, temperature=0) as s:
        events = list(s)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == deltas == call.arguments
    follow = c.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, max_output_tokens=8,
                                temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                       "output": "Sunny, 20 degrees."}])
    assert follow.status in ("completed", "incomplete") and follow.output


def test_parallel_tool_calls_false_one_function_call_c56(rserver):
    """C56 P4 (A4): ``"required"`` with ``parallel_tool_calls: false`` on /v1/responses is
    exactly one ``function_call`` output item, whole and streamed (one item added); the
    response echoes the flag."""
    c = rserver.client()
    body = dict(model=MODEL, input="What is the weather in Paris and in Oslo? Call the tool once for each city.",
                tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    r = c.responses.create(**body)
    assert [o.type for o in r.output] == ["function_call"] and r.status == "completed", r
    assert r.parallel_tool_calls is False and r.output[0].name == "get_weather"
    assert isinstance(json.loads(r.output[0].arguments)["city"], str)
    with c.responses.stream(**body) as s:
        events = list(s)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    final = events[-1].response
    assert added == ["function_call"] and [o.type for o in final.output] == ["function_call"]
    assert final.output[0].arguments == r.output[0].arguments


def test_background_completes_and_cancel_aborts(rserver):
    c = rserver.client()
    queued = c.responses.create(model=MODEL, input=Q, max_output_tokens=4, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background
    for _ in range(600):  # polled, not timed: the run finishes whatever the load
        got = c.responses.retrieve(queued.id)
        if got.status not in ("queued", "in_progress"):
            break
        time.sleep(0.2)
    assert got.status == "incomplete" and got.usage.output_tokens == 4
    long = c.responses.create(model=MODEL, input="Write a long story.", max_output_tokens=2000, background=True)
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and c.responses.retrieve(long.id).status == "cancelled"
    rserver.assert_healthy()


def test_openai_agents_agent_with_a_function_tool(rserver):
    """An openai-agents Agent on its default model (OpenAIResponsesModel over this
    server) calls its one function tool (forced by ModelSettings) and answers."""
    import asyncio

    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_default_openai_client, set_tracing_disabled)
    from agents.models.multi_provider import MultiProvider

    set_tracing_disabled(True)
    set_default_openai_client(rserver.async_client(), use_for_tracing=False)
    assert isinstance(MultiProvider().get_model(MODEL), OpenAIResponsesModel)  # the SDK's default model
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"It is sunny and 20 degrees in {city}."

    agent = Agent(name="weather", instructions="Answer weather questions with the tool.", model=MODEL,
                  tools=[get_weather], model_settings=ModelSettings(tool_choice="get_weather", temperature=0,
                                                                    max_tokens=64))
    result = asyncio.run(Runner.run(agent, "What is the weather in Oslo?", max_turns=4))
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
    assert len(calls) == 1 and isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2  # the forced call, then the answer after the tool's output
    assert all(r.response_id.startswith("resp") for r in result.raw_responses)


def test_bench_serve_responses_against_chat(rserver):
    """``bench serve --endpoint /v1/responses --compare-endpoint /v1/chat/completions``:
    both endpoints produce every requested token (ignore_eos honoured on Responses)."""
    import argparse

    from llmserve.benchmarks import serve as bench

    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    res = bench.main(parser.parse_args([
        "--base-url", rserver.url_root, "--api-key", rserver.api_key, "--endpoint", "/v1/responses",
        "--compare-endpoint", "/v1/chat/completions", "--compare-rounds", "1", "--num-prompts", "2",
        "--random-input-len", "16", "--random-output-len", "4", "--max-concurrency", "2"]))
    assert [r["endpoint"] for r in res["rounds"]] == ["/v1/responses", "/v1/chat/completions"]
    assert all(r["total_output_tokens"] == 8 and r["failed"] == 0 for r in res["rounds"]), res["rounds"]
    assert res["output_throughput_ratio"] > 0


def test_output_text_logprobs_equal_chat_streamed_and_whole(rserver):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the entries
    equal chat's logprobs for the same greedy turn (the same builder), and the streamed
    delta events carry the same tokens and values (no bytes, as OpenAI's delta events)."""
    c = rserver.client()
    kw = {"max_output_tokens": 6, "temperature": 0, "top_logprobs": 2, "include": ["message.output_text.logprobs"]}
    r = c.responses.create(model=MODEL, input=Q, **kw)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": Q}], max_tokens=6,
                                     temperature=0, logprobs=True, top_logprobs=2)
    lps = r.output[0].content[0].logprobs
    assert [lp.model_dump() for lp in lps] == [e.model_dump() for e in chat.choices[0].logprobs.content]
    assert len(lps) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)
    with c.responses.stream(model=MODEL, input=Q, **kw) as s:
        deltas = [e for e in s if e.type == "response.output_text.delta"]
    streamed = [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs])
                for e in deltas for lp in e.logprobs]
    assert streamed == [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]) for lp in lps]
    plain = c.responses.create(model=MODEL, input=Q, max_output_tokens=2, top_logprobs=2)  # not included
    assert plain.output[0].content[0].logprobs == []


# ---- C61: previous_response_id continues a stored conversation; what is not stored is a 404 ----
SECRET = "My secret word is PLUM-42. Reply OK."
ASK = "What is my secret word?"
TURN = {"max_output_tokens": 8, "temperature": 0}


def _error_json(r, status: int) -> dict:
    """The OpenAI error body of a ``status`` answer (the cases' "error JSON")."""
    assert r.status_code == status and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and isinstance(err["type"], str) and err["code"] == status, err
    assert err["param"] is None or isinstance(err["param"], str)
    return err


def _explicit(srv, first_output: str, system: list) -> dict:
    """S3: the turns of S1 and S2 sent as one input."""
    return srv.post("/v1/responses", {"model": MODEL, **TURN, "input": [
        *system, {"role": "user", "content": SECRET}, {"role": "assistant", "content": first_output},
        {"role": "user", "content": ASK}]}).json()


def test_previous_response_id_continues_the_stored_conversation_c61(rserver):
    c = rserver.client()
    s1 = c.responses.create(model=MODEL, input=SECRET, **TURN)  # store at its default
    s2 = c.responses.create(model=MODEL, input=ASK, previous_response_id=s1.id, **TURN)
    assert s2.previous_response_id == s1.id and s2.status in ("completed", "incomplete")  # A1
    s3 = _explicit(rserver, s1.output_text, [])
    assert s2.usage.input_tokens == s3["usage"]["input_tokens"]
    assert s2.output_text == s3["output"][0]["content"][0]["text"]
    with c.responses.stream(model=MODEL, input=ASK, previous_response_id=s1.id, **TURN) as stream:
        events = list(stream)
    final = events[-1].response
    assert final.previous_response_id == s1.id and final.usage.input_tokens == s2.usage.input_tokens
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == s2.output_text
    # a chain of three: each turn brings all the earlier ones
    s2b = c.responses.create(model=MODEL, input="Say it again.", previous_response_id=s2.id, **TURN)
    whole = rserver.post("/v1/responses", {"model": MODEL, **TURN, "input": [
        {"role": "user", "content": SECRET}, {"role": "assistant", "content": s1.output_text},
        {"role": "user", "content": ASK}, {"role": "assistant", "content": s2.output_text},
        {"role": "user", "content": "Say it again."}]}).json()
    assert s2b.usage.input_tokens == whole["usage"]["input_tokens"]


def test_unstored_deleted_and_unknown_ids_are_404s_c61(rserver):
    s4 = rserver.post("/v1/responses", {"model": MODEL, "input": SECRET, **TURN, "store": False}).json()
    _error_json(rserver.http.get(f"/v1/responses/{s4['id']}"), 404)  # A2
    for stream in (False, True):
        r = rserver.post("/v1/responses", {"model": MODEL, "input": ASK, **TURN, "previous_response_id": s4["id"],
                                           "stream": stream})
        assert s4["id"] in _error_json(r, 404)["message"]
    s1 = rserver.post("/v1/responses", {"model": MODEL, "input": SECRET, **TURN}).json()
    got = rserver.http.get(f"/v1/responses/{s1['id']}")  # A3
    assert got.status_code == 200 and got.json()["id"] == s1["id"] and got.json()["status"] == s1["status"]
    assert got.json()["output"][0]["content"][0]["text"] == s1["output"][0]["content"][0]["text"]
    d = rserver.http.delete(f"/v1/responses/{s1['id']}")
    assert d.status_code == 200 and d.json()["id"] == s1["id"] and d.json()["deleted"] is True
    _error_json(rserver.http.get(f"/v1/responses/{s1['id']}"), 404)
    _error_json(rserver.post("/v1/responses", {"model": MODEL, "input": ASK, **TURN,
                                               "previous_response_id": s1["id"]}), 404)
    for stream in (False, True):  # A4
        r = rserver.post("/v1/responses", {"model": MODEL, "input": ASK, **TURN,
                                           "previous_response_id": "resp_doesnotexist", "stream": stream})
        assert "resp_doesnotexist" in _error_json(r, 404)["message"]
    with pytest.raises(openai.NotFoundError):
        rserver.client().responses.create(model=MODEL, input=ASK, previous_response_id="resp_doesnotexist", **TURN)


def test_instructions_are_not_carried_over_c61(rserver):
    c = rserver.client()
    s7 = c.responses.create(model=MODEL, input=SECRET, instructions="Answer in French.", **TURN)
    s2 = c.responses.create(model=MODEL, input=ASK, previous_response_id=s7.id, **TURN)
    assert s2.instructions is None  # A5
    assert s2.usage.input_tokens == _explicit(rserver, s7.output_text, [])["usage"]["input_tokens"]
    with_system = _explicit(rserver, s7.output_text, [{"role": "system", "content": "Answer in French."}])
    # (SmolLM2's template puts its own default system prompt where none is given)
    assert with_system["usage"]["input_tokens"] != s2.usage.input_tokens


# ---- C63: only background responses can be cancelled; a cancel stops the generation ----
def _running(srv) -> float:
    return metric_sum(srv, "vllm:num_requests_running")


def test_background_cancel_stops_and_is_idempotent_c63(rserver):
    c = rserver.client()
    b1 = c.responses.create(model=MODEL, input="Tell me a long story about a lighthouse.", background=True,
                            max_output_tokens=800, temperature=0)
    assert b1.status in ("queued", "in_progress") and b1.background is True  # A1
    cancelled = rserver.post(f"/v1/responses/{b1.id}/cancel")  # A2
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    first = rserver.http.get(f"/v1/responses/{b1.id}").json()
    t_end = time.monotonic() + 5
    while _running(rserver) > 0 and time.monotonic() < t_end:
        time.sleep(0.1)  # polled: the engine's abort lands within a step or two
    assert _running(rserver) == 0
    second = rserver.http.get(f"/v1/responses/{b1.id}").json()
    assert first["status"] == second["status"] == "cancelled"
    assert (first["output"], first["usage"]) == (second["output"], second["usage"])  # nothing grew
    again = rserver.post(f"/v1/responses/{b1.id}/cancel")
    if again.status_code == 200:
        assert again.json()["status"] == "cancelled"
    else:
        _error_json(again, 400)


def test_cancel_of_finished_foreground_and_unknown_responses_c63(rserver):
    c = rserver.client()
    b3 = c.responses.create(model=MODEL, input=Q, background=True, max_output_tokens=4)
    for _ in range(600):  # polled, not timed
        got = c.responses.retrieve(b3.id)
        if got.status not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    assert got.status in ("completed", "incomplete")
    r = rserver.post(f"/v1/responses/{b3.id}/cancel")  # A3
    if r.status_code == 200:
        assert r.json()["status"] == got.status
    else:
        assert "synchronous" not in _error_json(r, 400)["message"].lower()
    assert c.responses.retrieve(b3.id).status == got.status
    b4 = c.responses.create(model=MODEL, input=Q, max_output_tokens=32, temperature=0)
    assert b4.status == "completed"
    _error_json(rserver.post(f"/v1/responses/{b4.id}/cancel"), 400)  # A4
    assert c.responses.retrieve(b4.id).status == "completed"
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(b4.id)
    b5 = rserver.post("/v1/responses", {"model": MODEL, "input": Q, "background": True, "store": False})
    assert _error_json(b5, 400)["param"] in ("store", "background")  # A5
    _error_json(rserver.post("/v1/responses/resp_doesnotexist/cancel"), 404)  # A6
    with pytest.raises(openai.NotFoundError):
        c.responses.cancel("resp_doesnotexist")


def test_request_timeout_is_a_408_on_the_apis_without_an_abort_reason(rserver):
    """X-Request-Timeout running out: chat keeps vLLM's 200 + finish_reason "abort"; the
    Responses API (no such reason) answers 408 naming the header, streamed as an error
    event then response.failed; never the "server is shutting down" 500."""
    slow = {"model": MODEL, "input": "Count from 1 to 500.", "max_output_tokens": 400, "temperature": 0}
    headers = {"X-Request-Timeout": "0.3"}
    r = rserver.post("/v1/responses", slow, headers=headers)
    assert r.status_code == 408, r.text
    err = r.json()["error"]
    assert err["param"] == "X-Request-Timeout" and "X-Request-Timeout" in err["message"], err
    with rserver.http.stream("POST", "/v1/responses", json={**slow, "stream": True}, headers=headers) as s:
        text = "".join(s.iter_text())
    assert "event: response.failed" in text and "X-Request-Timeout" in text, text[-500:]
    chat = rserver.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 400, "ignore_eos": True,
                                                 "messages": [{"role": "user", "content": "Count from 1 to 500."}]},
                        headers=headers)  # ignore_eos: a sampled answer may end before the deadline ("66.", 4 tokens)
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] == "abort", chat.text


def test_request_timeout_on_anthropic_and_ollama_is_a_timeout_not_a_shutdown(rserver):
    """The same deadline on /v1/messages (Anthropic's timeout_error) and /api/chat
    (Ollama's {"error"}): a 408 naming the header, not an api_error 500."""
    ask = [{"role": "user", "content": "Count from 1 to 500."}]
    headers = {"X-Request-Timeout": "0.3"}
    a = rserver.post("/v1/messages", {"model": MODEL, "max_tokens": 400, "messages": ask, "temperature": 0},
                     headers=headers)  # greedy: a sampled answer may end before the deadline
    assert a.status_code == 408 and a.json()["error"]["type"] == "timeout_error", a.text
    o = rserver.post("/api/chat", {"model": MODEL, "messages": ask, "stream": False,
                                   "options": {"num_predict": 400, "temperature": 0}}, headers=headers)
    assert o.status_code == 408 and "X-Request-Timeout" in o.json()["error"], o.text
