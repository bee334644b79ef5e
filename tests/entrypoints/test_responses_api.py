"""``/v1/responses`` wiring with the scripted engine of test_app.py (no model): the event
sequence validated by the openai client's own types, the store (GET/DELETE, eviction,
``store: false``, ``previous_response_id``), background + cancel, and the 400/404
bodies. The real model is tests/e2e/test_responses_e2e.py."""
from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_app import _output, app_and_engine  # noqa: F401  (the fixture)

from llmserve.entrypoints.openai.responses.input_items import input_messages
from llmserve.entrypoints.openai.responses.store import ResponsesStore, StoredResponse
from llmserve.entrypoints.openai.responses.protocol import ResponsesResponse

EVENT = TypeAdapter(ResponseStreamEvent)
BASE = {"model": "m", "input": "hi", "max_output_tokens": 3}


def _events(r):
    """The SSE events of a streamed response: (event line, payload) pairs."""
    out = []
    for block in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def _err(r, status, param):
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    return err


def test_create_retrieve_delete_and_the_object_validates(app_and_engine):
    client, engine = app_and_engine()
    engine.outputs = [_output("Hello there", "stop")]
    r = client.post("/v1/responses", json={**BASE, "instructions": "Be brief.", "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    body = Response.model_validate(r.json())
    assert body.object == "response" and body.id.startswith("resp") and body.status == "completed"
    assert body.output_text == "Hello there" and body.instructions == "Be brief." and body.metadata == {"k": "v"}
    assert body.incomplete_details is None
    n_prompt = len(engine.prompts[-1]["prompt_token_ids"])
    assert (body.usage.input_tokens, body.usage.output_tokens) == (n_prompt, 1)
    assert body.usage.total_tokens == n_prompt + 1
    assert "Be brief." in engine.prompts[-1]["prompt"] and "hi" in engine.prompts[-1]["prompt"]
    got = client.get(f"/v1/responses/{body.id}")
    assert got.status_code == 200 and got.json() == r.json()
    d = client.delete(f"/v1/responses/{body.id}")
    assert d.json() == {"id": body.id, "object": "response", "deleted": True}
    for method in ("get", "delete"):
        err = _err(getattr(client, method)(f"/v1/responses/{body.id}"), 404, "response_id")
        assert body.id in err["message"] and err["type"] == "NotFoundError"
    _err(client.post("/v1/responses/resp-nope/cancel"), 404, "response_id")


def test_max_output_tokens_is_incomplete_c36(app_and_engine):
    client, engine = app_and_engine()
    engine.outputs = [_output("Four", "length")]
    body = client.post("/v1/responses", json={**BASE, "max_output_tokens": 1}).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["type"] == "message" and body["output"][0]["content"][0]["text"] == "Four"
    assert body["usage"]["output_tokens"] == 1
    Response.model_validate(body)
    stream = client.post("/v1/responses", json={**BASE, "max_output_tokens": 1, "stream": True})
    events = _events(stream)
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1][1]["response"]["usage"]["output_tokens"] == 1
    assert [e for e, _ in events].count("response.incomplete") == 1


def test_stream_event_order_sequence_and_types(app_and_engine):
    client, engine = app_and_engine()
    engine.outputs = [_output("Hel"), _output("lo", "stop")]
    r = client.post("/v1/responses", json={**BASE, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    for name, payload in events:
        assert name == payload["type"]
        EVENT.validate_python(payload)  # the openai client's own event types
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    assert [e for e, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    final = Response.model_validate(events[-1][1]["response"])
    assert final.output_text == "Hello" == "".join(p["delta"] for e, p in events if e.endswith("text.delta"))
    assert final.usage.output_tokens == 2
    assert client.get(f"/v1/responses/{final.id}").json()["output"][0]["content"][0]["text"] == "Hello"


def test_error_after_the_stream_started_is_an_error_event_then_failed(app_and_engine):
    from llmserve.engine.exceptions import EngineDeadError

    client, engine = app_and_engine()
    engine.outputs = [_output("Hel")]
    engine.fail_after = EngineDeadError()
    events = _events(client.post("/v1/responses", json={**BASE, "stream": True}))
    assert [e for e, _ in events][-2:] == ["error", "response.failed"]
    for _, payload in events:
        EVENT.validate_python(payload)
    assert events[-1][1]["response"]["status"] == "failed"


def test_generation_cut_off_by_the_engine_is_failed_not_incomplete(app_and_engine):
    """finish reason "abort" (server shutdown): a 500 server_error when not streamed, an
    error event then response.failed (error.code server_error) when streamed; never a
    completed or incomplete answer that looks whole."""
    client, engine = app_and_engine()
    engine.outputs = [_output("Hel", "abort")]
    r = client.post("/v1/responses", json=BASE)
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError", r.text
    assert "cut off" in r.json()["error"]["message"]
    engine.outputs = [_output("Hel"), _output("lo", "abort")]
    events = _events(client.post("/v1/responses", json={**BASE, "stream": True}))
    assert [e for e, _ in events][-2:] == ["error", "response.failed"]
    for _, payload in events:
        EVENT.validate_python(payload)
    failed = Response.model_validate(events[-1][1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.incomplete_details is None
    assert client.get(f"/v1/responses/{failed.id}").json()["status"] == "failed"


def test_store_false_previous_response_id_and_eviction(app_and_engine):
    client, engine = app_and_engine("--responses-store-max-entries", "2")
    engine.outputs = [_output("Paris", "stop")]
    unstored = client.post("/v1/responses", json={**BASE, "store": False}).json()
    assert unstored["store"] is False
    _err(client.get(f"/v1/responses/{unstored['id']}"), 404, "response_id")
    first = client.post("/v1/responses", json={**BASE, "input": "Capital of France?"}).json()
    engine.outputs = [_output("Berlin", "stop")]
    client.post("/v1/responses", json={**BASE, "input": "And of Germany?", "previous_response_id": first["id"],
                                       "instructions": "Answer in one word."})
    prompt = engine.prompts[-1]["prompt"]
    # earlier turn (input and output), then the new input; the new instructions lead
    order = [prompt.index(s) for s in ("Answer in one word.", "Capital of France?", "Paris", "And of Germany?")]
    assert order == sorted(order)
    third = client.post("/v1/responses", json=BASE).json()
    _err(client.get(f"/v1/responses/{first['id']}"), 404, "response_id")  # the oldest of 3 went
    assert client.get(f"/v1/responses/{third['id']}").status_code == 200
    _err(client.post("/v1/responses", json={**BASE, "previous_response_id": first["id"]}), 404,
         "previous_response_id")


def test_function_call_items_and_follow_up_render_as_chat_tool_turns():
    msgs = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert msgs[0] == {"role": "user", "content": "Weather in Oslo?"}
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"] and msgs[1]["role"] == "assistant"
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_function_call_output_without_its_call_is_a_400_naming_input(app_and_engine):
    """OpenAI answers 400 (param ``input``, "No tool call found for function call output
    with call_id ...") for a ``function_call_output`` whose call_id no ``function_call``
    of the input or of the ``previous_response_id`` chain made; it was taken (200) and
    rendered as a tool turn answering nothing. A long call id is not quoted back."""
    client, engine = app_and_engine()
    engine.outputs = [_output("x", "stop")]
    call = {"type": "function_call", "call_id": "call_a1", "name": "f", "arguments": "{}"}
    user = {"role": "user", "content": "hi"}
    for stream in (False, True):
        orphan = [user, call, {"type": "function_call_output", "call_id": "call_b2", "output": "x"}]
        err = _err(client.post("/v1/responses", json={**BASE, "input": orphan, "stream": stream}), 400, "input")
        assert "No tool call found for function call output with call_id call_b2" in err["message"], err
        assert "input[2]" in err["message"]
        long_id = "call_" + "z" * 5000
        orphan = [user, {"type": "function_call_output", "call_id": long_id, "output": "x"}]
        err = _err(client.post("/v1/responses", json={**BASE, "input": orphan, "stream": stream}), 400, "input")
        assert "zzz" not in err["message"] and len(err["message"]) < 300
    assert engine.prompts == []  # nothing ran
    # the call made in an earlier turn of the previous_response_id chain is found
    first = client.post("/v1/responses", json={**BASE, "input": [user, call, {
        "type": "function_call_output", "call_id": "call_a1", "output": "sunny"}]})
    assert first.status_code == 200, first.text
    engine.outputs = [_output("y", "stop")]
    again = client.post("/v1/responses", json={**BASE, "previous_response_id": first.json()["id"], "input": [
        {"type": "function_call_output", "call_id": "call_a1", "output": "still sunny"}]})
    assert again.status_code == 200, again.text


def test_store_evicts_oldest_first():
    store = ResponsesStore(2)
    for i in range(3):
        store.put(StoredResponse(ResponsesResponse(id=f"r{i}", model="m")))
    assert "r0" not in store and "r1" in store and "r2" in store and len(store) == 2
    with pytest.raises(ValueError, match="responses_store_max_entries"):
        ResponsesStore(0)


@pytest.mark.parametrize("body, param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": "x"}] * 4097}, "input"),  # MAX_MESSAGES items (a long string is fine)
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c"}]},
     "input[1].output"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"tools": [{"type": "web_search"}, {"type": "function", "description": "no name"}]}, "tools[1].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "auto"}, "tool_choice"),  # no auto flags
    ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format.schema"),
    ({"include": ["bogus"]}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    # fields of the plain-JSON objects, of the wrong JSON type, were taken (200)
    ({"reasoning": {"summary": 5}}, "reasoning.summary"),
    ({"reasoning": {"effort": 5}}, "reasoning.effort"),
    ({"input": [{"type": "message", "id": 5, "role": "user", "content": "hi"}]}, "input.0.id"),
    ({"input": [{"type": "message", "role": "user", "content": "hi", "status": True}]}, "input.0.status"),
    ({"input": [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "hi", "annotations": "x"}]}]},
     "input.0.content.0.annotations"),
    ({"input": [{"type": "message", "role": "user", "content": "hi"},
                {"type": "function_call", "id": 5, "call_id": "c", "name": "f", "arguments": "{}"}]}, "input.1.id"),
    ({"input": [{"type": "message", "role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input.1.arguments"),
    ({"input": [{"type": "message", "role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "c", "output": 5}]}, "input.1.output"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": "x"}, {"role": "user", "content": "hi"}]},
     "input.0.summary"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": 5}]},
                {"role": "user", "content": "hi"}]}, "input.0.summary.0.text"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": 5},
                {"role": "user", "content": "hi"}]}, "input.0.encrypted_content"),
    ({"input": [{"type": 5, "role": "user", "content": "hi"}]}, "input.0.type"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"background": True, "store": False}, "store"),
    ({"stream": "yes"}, "stream"),
])
def test_bad_requests_are_400s_naming_the_field(app_and_engine, body, param):
    client, engine = app_and_engine()
    engine.outputs = [_output("x", "stop")]
    for stream in (False, True):
        if "stream" in body:
            stream = body["stream"]
        _err(client.post("/v1/responses", json={**BASE, **body, "stream": stream}), 400, param)
    assert engine.prompts == []  # nothing ran


def test_background_then_cancel(app_and_engine):
    client, engine = app_and_engine()
    started = asyncio.Event()

    async def hang(prompt, params, request_id, priority=0):
        try:
            started.set()
            await asyncio.sleep(3600)
            yield None
        finally:
            engine.closed.append(request_id)

    engine.generate = hang
    with client:  # one event loop for the whole block, so the background task keeps running
        r = client.post("/v1/responses", json={**BASE, "background": True})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "queued" and body["background"] is True
        Response.model_validate(body)
        assert client.get(f"/v1/responses/{body['id']}").json()["status"] in ("queued", "in_progress")
        c = client.post(f"/v1/responses/{body['id']}/cancel")
        assert c.status_code == 200 and c.json()["status"] == "cancelled", c.text
        assert client.get(f"/v1/responses/{body['id']}").json()["status"] == "cancelled"
        assert engine.closed and engine.closed[-1].startswith(body["id"])  # the engine request was aborted
        engine.generate = type(engine).generate.__get__(engine)
        engine.outputs = [_output("x", "stop")]
        done = client.post("/v1/responses", json=BASE).json()
        _err(client.post(f"/v1/responses/{done['id']}/cancel"), 400, "response_id")  # not a background one


def test_background_stream_resumes_after_any_event_to_the_terminal_one(app_and_engine):
    """background + stream (OpenAI's resumable stream): the events validate, and
    ``GET ?stream=true&starting_after=N`` gives exactly the events after N (same
    sequence numbers) ending with the terminal event; a bad cursor is a 400 naming it."""
    client, engine = app_and_engine()
    engine.outputs = [_output("Hel"), _output("lo", "length")]
    with client:  # one event loop, as on a server: the background task outlives the request
        r = client.post("/v1/responses", json={**BASE, "background": True, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
        events = _events(r)
        for _, payload in events:
            EVENT.validate_python(payload)
        assert [e for e, _ in events][:3] == ["response.created", "response.queued", "response.in_progress"]
        assert events[0][1]["response"]["status"] == "queued" and events[-1][0] == "response.incomplete"
        assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
        rid = events[0][1]["response"]["id"]
        for n in range(len(events)):
            r = client.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": n})
            assert r.status_code == 200 and (_events(r) if r.text else []) == events[n + 1:], (n, r.text)
        assert client.get(f"/v1/responses/{rid}").json()["status"] == "incomplete"
        for bad in (-1, len(events), "two", 1.5):
            _err(client.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": bad}),
                 400, "starting_after")
        _err(client.get("/v1/responses/resp_unknown", params={"stream": "true", "starting_after": 1}),
             404, "response_id")


def test_cancelled_background_stream_ends_with_its_terminal_event(app_and_engine):
    """A background stream cancelled mid-output (or before it ran) still ends, for the
    follower and for a resume, with response.failed carrying status "cancelled"."""
    from llmserve.entrypoints.openai.responses.protocol import ResponsesRequest

    client, engine = app_and_engine()
    handler = client.app.state.openai_serving_responses

    async def hang(prompt, params, request_id, priority=0):
        yield _output("Hel")
        await asyncio.sleep(3600)

    async def run():
        engine.generate = hang
        body = {**BASE, "background": True, "stream": True}
        follower = await handler.create_responses(ResponsesRequest(**body))
        seen = [await follower.__anext__() for _ in range(6)]  # ... the first text delta
        rid = json.loads(seen[0].split("data: ", 1)[1])["response"]["id"]
        assert '"response.output_text.delta"' in seen[-1]
        assert (await handler.cancel_responses(rid)).status == "cancelled"
        rest = [e async for e in follower]
        resumed = [e async for e in handler.retrieve_responses(rid, True, 5)]
        early = await handler.create_responses(ResponsesRequest(**body))  # cancelled before its task ran
        early_id = json.loads((await early.__anext__()).split("data: ", 1)[1])["response"]["id"]
        await handler.cancel_responses(early_id)
        return rest, resumed, [e async for e in early]
    rest, resumed, early = asyncio.run(run())
    assert rest == resumed and len(rest) == 4
    for tail in (rest, early):
        payloads = [json.loads(e.split("data: ", 1)[1]) for e in tail]
        for payload in payloads:
            EVENT.validate_python(payload)
        assert payloads[-1]["type"] == "response.failed" and payloads[-1]["response"]["status"] == "cancelled"
    assert json.loads(rest[-1].split("data: ", 1)[1])["response"]["output"][0]["content"][0]["text"] == "Hel"


def test_output_builder_reasoning_text_and_calls_stream_like_whole():
    """Reasoning (with --reasoning-parser), then text, then two calls: each event is a
    valid openai event, the items close in order, and building from the whole parsed
    output gives the same items as the streamed pieces."""
    from llmserve.entrypoints.openai.chat_completion.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
    from llmserve.entrypoints.openai.responses.streaming import OutputBuilder

    def call(i, args, name=None):
        return DeltaToolCall(index=i, id=f"call_{i}" if name else None, type="function" if name else None,
                             function=DeltaFunctionCall(name=name, arguments=args))

    stream = OutputBuilder(stream=True)
    pieces = [DeltaMessage(reasoning="Let me "), DeltaMessage(reasoning="think."), DeltaMessage(content="Sure."),
              DeltaMessage(tool_calls=[call(0, '{"city": ', "get_weather")]),
              DeltaMessage(tool_calls=[call(0, '"Oslo"}')]), DeltaMessage(tool_calls=[call(1, "{}", "now")])]
    events = [e for p in pieces for e in stream.add(p)] + stream.finish()
    payloads = [json.loads(e.split("\ndata: ", 1)[1]) for e in events]
    for p in payloads:
        EVENT.validate_python(p)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    done = [(p["output_index"], p["item"]["type"]) for p in payloads if p["type"] == "response.output_item.done"]
    assert done == [(0, "reasoning"), (1, "message"), (2, "function_call"), (3, "function_call")]
    args = [p["arguments"] for p in payloads if p["type"] == "response.function_call_arguments.done"]
    assert args == ['{"city": "Oslo"}', "{}"]
    whole = OutputBuilder()
    assert whole.add(DeltaMessage(reasoning="Let me think.", content="Sure.")) == []
    whole.tool_call(0, "call_0", "get_weather", '{"city": "Oslo"}')
    whole.tool_call(1, "call_1", "now", "{}")
    whole.finish()
    strip = [{k: v for k, v in i.model_dump().items() if k != "id"} for i in stream.items]
    assert strip == [{k: v for k, v in i.model_dump().items() if k != "id"} for i in whole.items]
    Response.model_validate(ResponsesResponse(id="resp-1", model="m", output=whole.items).model_dump(mode="json"))


def test_long_string_input_is_the_context_400_not_a_list_limit(app_and_engine):
    client, engine = app_and_engine()
    err = _err(client.post("/v1/responses", json={**BASE, "input": "word " * 150_000}), 400, "input")
    assert "64" in err["message"] and "cannot fit" in err["message"], err
    # streamed: in-band, as OpenAI streams it (test_context_length_exceeded.py)
    failed = _events(client.post("/v1/responses", json={**BASE, "input": "word " * 150_000, "stream": True}))[-1]
    assert failed[0] == "response.failed" and failed[1]["response"]["error"]["message"] == err["message"]


def _logprob_output(text, token_ids, finish=None):
    """One step of output with logprobs: each token chosen at rank 1 among two."""
    from llmserve.outputs import CompletionOutput, Logprob, RequestOutput

    steps = [{t: Logprob(-0.25, 1), t + 1: Logprob(-1.5, 2)} for t in token_ids]
    return RequestOutput("r", None, [1], None, [CompletionOutput(0, text, token_ids, None, steps, finish)],
                         finish is not None)


def test_include_output_text_logprobs_whole_and_streamed(app_and_engine):
    """``include: ["message.output_text.logprobs"]`` samples ``top_logprobs`` alternatives
    (SamplingParams.logprobs) and returns chat's entries on the output_text part (token,
    logprob, bytes, top_logprobs) and, streamed, on each delta event (no bytes); without
    include the engine is asked for none and the lists stay empty."""
    client, engine = app_and_engine()
    tok = engine.tokenizer
    ids = tok.encode(" four", add_special_tokens=False) + tok.encode("!", add_special_tokens=False)
    engine.outputs = [_logprob_output(" four!", ids, "stop")]
    body = {**BASE, "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    whole = client.post("/v1/responses", json=body).json()
    assert engine.params[-1].logprobs == 1
    parsed = Response.model_validate(whole)
    assert parsed.top_logprobs == 1
    lps = parsed.output[0].content[0].logprobs
    assert [lp.token for lp in lps] == [tok.convert_ids_to_tokens(i).replace("\u0120", " ") for i in ids]
    assert [lp.logprob for lp in lps] == [-0.25] * len(ids)
    assert all(lp.bytes == list(lp.token.encode()) and len(lp.top_logprobs) == 1 for lp in lps)
    assert [lp.top_logprobs[0].logprob for lp in lps] == [-0.25] * len(ids)  # the chosen one ranks first
    engine.outputs = [_logprob_output(" four", ids[:1]), _logprob_output("!", ids[1:], "stop")]
    events = [p for _, p in _events(client.post("/v1/responses", json={**body, "stream": True}))]
    for p in events:
        EVENT.validate_python(p)
    deltas = [p for p in events if p["type"] == "response.output_text.delta"]
    assert [d["delta"] for d in deltas] == [" four", "!"]
    streamed = [lp for d in deltas for lp in d["logprobs"]]
    assert streamed == [{k: v for k, v in lp.model_dump().items() if k != "bytes"} | {
        "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in lp.top_logprobs]} for lp in lps]
    done = next(p for p in events if p["type"] == "response.output_item.done")
    assert done["item"]["content"][0]["logprobs"] == [lp.model_dump() for lp in lps]
    final = next(p for p in events if p["type"] == "response.completed")["response"]
    assert final["output"][0]["content"][0]["text"] == " four!"
    engine.outputs = [_output("x", "stop")]
    plain = client.post("/v1/responses", json={**BASE, "top_logprobs": 3}).json()  # no include: none asked
    assert engine.params[-1].logprobs is None and plain["output"][0]["content"][0]["logprobs"] == []
    # the other include values ask for items this server never makes: accepted, no effect
    engine.outputs = [_output("x", "stop")]
    assert client.post("/v1/responses", json={**BASE, "include": ["reasoning.encrypted_content"]}).status_code == 200


def test_truncation_auto_drops_the_oldest_items_and_keeps_instructions(app_and_engine):
    """The context is 64 tokens here: three long turns do not fit; with ``auto`` the
    oldest turns go, the instructions and the last message stay (OpenAI's truncation
    strategy; vLLM truncates too)."""
    client, engine = app_and_engine()
    engine.outputs = [_output("x", "stop")]
    turns = [{"role": "user", "content": "alpha " * 12}, {"role": "assistant", "content": "bravo " * 12},
             {"role": "user", "content": "charlie"}]
    body = {**BASE, "input": turns, "instructions": "Be brief."}
    assert client.post("/v1/responses", json=body).status_code == 200  # (this stub engine checks no length)
    assert "alpha" in engine.tokenizer.decode(engine.prompts[-1]["prompt_token_ids"])
    r = client.post("/v1/responses", json={**body, "truncation": "auto"})
    assert r.status_code == 200 and r.json()["truncation"] == "auto", r.text
    prompt = engine.tokenizer.decode(engine.prompts[-1]["prompt_token_ids"])
    assert "Be brief." in prompt and "charlie" in prompt and "alpha" not in prompt
    assert len(engine.prompts[-1]["prompt_token_ids"]) <= 64 - 3
    # one message that alone does not fit stays the context-length 400
    _err(client.post("/v1/responses", json={**BASE, "input": "word " * 150_000, "truncation": "auto"}), 400, "input")


def test_stream_cut_by_its_request_timeout_fails_with_code_timeout(smol_tokenizer):
    """X-Request-Timeout running out mid-stream: the error event carries the 408 (as the
    answer that is not streamed) and response.failed OpenAI's "server_error" (it said
    "invalid_request": a timeout is not a refused request, and that code is not one of
    OpenAI's, so the openai package's own Response type refused the failed response)."""
    import argparse

    from fastapi.testclient import TestClient
    from test_app import ScriptedEngine

    from llmserve.entrypoints.openai.api_server import build_app, init_app_state
    from llmserve.entrypoints.openai.cli_args import make_arg_parser
    from llmserve.entrypoints.openai.responses.protocol import ResponseError

    class SlowEngine(ScriptedEngine):
        async def generate(self, prompt, params, request_id, priority=0, **kwargs):
            yield _output("Hel")
            await asyncio.sleep(0.3)  # past the 0.1 s deadline: the server aborts the request
            yield _output("lo", "abort")

        async def abort(self, *request_ids):
            pass

    args = make_arg_parser(argparse.ArgumentParser()).parse_args([])
    app = build_app(args)
    asyncio.run(init_app_state(SlowEngine(smol_tokenizer), app.state, args))
    client = TestClient(app)
    headers = {"X-Request-Timeout": "0.1"}
    events = _events(client.post("/v1/responses", json={**BASE, "stream": True}, headers=headers))
    (_, error), (_, failed) = events[-2:]
    assert error["type"] == "error" and error["code"] == "408" and error["param"] == "X-Request-Timeout", error
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["code"] == "server_error", failed
    assert Response.model_validate(failed["response"]).error.message == error["message"]
    r = client.post("/v1/responses", json=BASE, headers=headers)
    assert r.status_code == 408 and r.json()["error"]["type"] == "RequestTimeoutError", r.text
    assert [ResponseError.of(s, "m").code for s in (400, 404, 429, 500, 503)] == [
        "invalid_prompt", "invalid_prompt", "rate_limit_exceeded", "server_error", "server_error"]
