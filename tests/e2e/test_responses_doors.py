"""What Responses clients (Codex CLI, the openai SDK) sent that the server tripped over:
tools it cannot run, fields that change the answer, ``GET .../input_items`` and
``GET /v1/responses/{id}?stream=true`` (``starting_after``). On the shared ``server``."""
import json
import time

import pytest

MODEL = "SmolLM2-135M-Instruct"
CODEX_TOOLS = [  # the shapes Codex CLI 0.171 sends every turn (besides its function tools)
    {"type": "function", "name": "exec_command", "description": "Run a command", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
     "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "custom", "name": "apply_patch", "description": "patch", "format": {"type": "grammar", "syntax": "lark",
                                                                                 "definition": "start: /.+/"}},
]


def test_unsupported_tools_dropped_and_named(server):
    body = {"model": MODEL, "input": [{"type": "message", "id": "msg_codex1", "role": "developer",
                                       "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                                      {"type": "message", "role": "user", "content": "hi"}],
            "tools": CODEX_TOOLS, "tool_choice": "none", "max_output_tokens": 2, "store": False,
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k", "client_metadata": {"thread_id": "t"}}  # unknown fields: ignored
    r = server.http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-llmserve-dropped-tools"] == "namespace:multi_agent_v1,web_search,custom:apply_patch"
    assert [t["name"] for t in r.json()["tools"]] == ["exec_command"]  # what the model was shown
    r = server.http.post("/v1/responses", json={**body, "tools": CODEX_TOOLS[:1]})
    assert r.status_code == 200 and "x-llmserve-dropped-tools" not in r.headers


@pytest.mark.parametrize("field,value", [("conversation", "conv_123"), ("prompt", {"id": "pmpt_1"}),
                                         ("max_tool_calls", 2)])
def test_fields_that_change_the_answer_are_refused(server, field, value):
    r = server.http.post("/v1/responses", json={"model": MODEL, "input": "hi", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_input_items_list(server):
    client = server.client()
    resp = client.responses.create(model=MODEL, max_output_tokens=1, input=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"type": "message", "id": "msg_mine", "role": "user", "content": [{"type": "input_text", "text": "c"}]}])
    listed = client.responses.input_items.list(resp.id)  # the SDK's ResponseItemList validates the shape
    assert [i.id for i in listed.data][0] == "msg_mine" and len(listed.data) == 3 and not listed.has_more
    assert listed.data[1].content[0].type == "output_text" and listed.data[2].content[0].text == "a"
    first = server.http.get(f"/v1/responses/{resp.id}/input_items", params={"limit": 2, "order": "asc"}).json()
    assert [d["content"][0]["text"] for d in first["data"]] == ["a", "b"] and first["has_more"] is True
    rest = server.http.get(f"/v1/responses/{resp.id}/input_items",
                           params={"order": "asc", "after": first["last_id"]}).json()
    assert [d["id"] for d in rest["data"]] == ["msg_mine"] and rest["has_more"] is False
    for params, param in [({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")]:
        r = server.http.get(f"/v1/responses/{resp.id}/input_items", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert server.http.get("/v1/responses/resp_unknown/input_items").status_code == 404


def test_retrieve_stream_replays_events(server):
    client = server.client()
    events = list(client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=6, stream=True))
    rid = events[0].response.id
    again = list(client.responses.retrieve(rid, stream=True))  # the SDK parses every event
    assert [(e.type, e.sequence_number) for e in again] == [(e.type, e.sequence_number) for e in events]
    tail = list(client.responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.sequence_number for e in tail] == [e.sequence_number for e in events[4:]]
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=1)
    r = server.http.get(f"/v1/responses/{plain.id}", params={"stream": "true"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    r = server.http.get(f"/v1/responses/{rid}", params={"starting_after": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after", r.text


def _read_then_hang_up(server, body, n):
    """POST a streamed response, read its first ``n`` events and disconnect: their payloads."""
    got = []
    with server.http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(json.loads(line[6:]))
                if len(got) == n:
                    break
    return got


def test_stream_resumed_after_a_disconnect_ends_with_its_terminal_event(server):
    """OpenAI's resumable stream (background + stream): the client hangs up, the response
    runs on, and ``retrieve(stream=True, starting_after=N)`` gives exactly the events after
    N, ending with the terminal one. A plain stream's disconnect cancels it: its replay
    still ends, with response.failed carrying status "cancelled"."""
    client = server.client()
    body = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 8, "stream": True}
    head = _read_then_hang_up(server, {**body, "background": True}, 5)
    rid, last = head[0]["response"]["id"], head[-1]["sequence_number"]
    tail = list(client.responses.retrieve(rid, stream=True, starting_after=last))  # live, then the end
    whole = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in whole] == list(range(len(whole))) and [e["type"] for e in head] == \
        [e.type for e in whole[:5]]
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in whole[last + 1:]]
    assert tail[-1].type in ("response.completed", "response.incomplete") and tail[-1].response.background
    assert client.responses.retrieve(rid).status == tail[-1].response.status
    head = _read_then_hang_up(server, {**body, "max_output_tokens": 512}, 5)
    rid = head[0]["response"]["id"]
    for _ in range(100):  # the server notices the hang-up at its next write
        if client.responses.retrieve(rid).status == "cancelled":
            break
        time.sleep(0.05)
    tail = list(client.responses.retrieve(rid, stream=True, starting_after=4))
    assert tail[-1].type == "response.failed" and tail[-1].response.status == "cancelled", tail[-1]
    assert [e.sequence_number for e in tail] == list(range(5, 5 + len(tail)))
