"""The exact requests of the real agent CLIs, replayed on the shared ``server`` (2048-token
context, no tool-call parser: what ``llmserve serve MODEL`` gives a user).

Recorded in ``tests/data/agent_clis/`` through a logging proxy in front of llmserve
(headers and bodies as sent; ids zeroed): Claude Code 2.1.197's second request of a
``claude -p`` turn after a ``Read`` tool call (24 tools, ``?beta=true``, seven betas,
``thinking``, ``context_management``, ``output_config``, ``cache_control`` on a
``tool_result``) and Codex CLI 0.171.0's second request after an ``exec_command`` call
(developer messages with ids, ``function_call`` / ``function_call_output`` items, a
``namespace`` and a ``web_search`` tool, ``store: false``, ``include``,
``client_metadata``). Claude Code 2.1.332's first request of a ``--output-format
stream-json --verbose`` turn (``thinking.display: "updates"``). ``tests/e2e/test_agent_clis_real.py``
drives the CLIs themselves.
"""
from __future__ import annotations

import json
import pathlib
import re

import anthropic
import openai
from pydantic import TypeAdapter

from e2e_utils import API_KEY, MODEL

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "agent_clis"
# Claude Code 2.1.197 reads the sizes out of a 400 with this pattern to show "Prompt is too
# long · the request is ~N tokens (limit M)" (its other 400s are shown as "API Error: 400 ...").
CLAUDE_PROMPT_TOO_LONG = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.I)
ANTHROPIC_EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
# Anthropic's usage splits the prompt in three: the rest, cache writes, cache reads
PROMPT_PARTS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
RESPONSES_EVENT = TypeAdapter(openai.types.responses.ResponseStreamEvent)


def recorded(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def claude_code() -> tuple[str, dict, dict]:
    """(path, headers with the test key, body) of the recorded Claude Code request."""
    rec = recorded("claude_code_2.1.197.json")
    return rec["path"], {**rec["headers"], "x-api-key": API_KEY}, rec["body"]


def sse(response) -> list[tuple[str, dict]]:
    """The (event, data) pairs of an SSE body."""
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[len("data: "):])))
    return events


def count_tokens(server, headers: dict, body: dict) -> int:
    fields = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")}
    r = server.http.post("/v1/messages/count_tokens?beta=true", json=fields, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_claude_code_prompt_over_the_context_is_anthropics_prompt_too_long(server):
    # Claude Code's system prompt, agent list and first message (~3050 tokens) do not fit
    # the default 2048-token context: the 400 must carry Anthropic's words, so the CLI shows
    # "Prompt is too long" with both sizes, streamed or not (its fallback after a failed stream).
    path, headers, body = claude_code()
    first_turn = {**body, "messages": body["messages"][:2]}
    prompt = count_tokens(server, headers, first_turn)
    max_len = server.http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert prompt > max_len
    for stream in (True, False):
        r = server.http.post(path, json={**first_turn, "stream": stream}, headers=headers)
        assert r.status_code == 400, r.text
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        sizes = CLAUDE_PROMPT_TOO_LONG.search(error["error"]["message"])
        assert sizes is not None, error
        assert (int(sizes[1]), int(sizes[2])) == (prompt, max_len - 1)
        assert "--max-model-len" in error["error"]["message"]


def test_claude_code_tool_result_turn_streams_events_the_sdk_parses(server):
    # The recorded turn without the agent-list system message and the long system block, so
    # that it fits 2048 tokens; everything else (tools, betas, thinking, tool_use /
    # tool_result blocks, cache_control) as Claude Code sent it. max_tokens as with
    # CLAUDE_CODE_MAX_OUTPUT_TOKENS=8.
    path, headers, body = claude_code()
    assert [m["role"] for m in body["messages"]] == ["user", "system", "assistant", "user"]
    body = {**body, "messages": [body["messages"][0]] + body["messages"][2:], "system": body["system"][:2],
            "max_tokens": 8}
    with server.http.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    for kind, data in events:  # ping is not in the SDK's event union (its stream skips it)
        assert kind == data["type"] and (kind == "ping" or ANTHROPIC_EVENT.validate_python(data).type == kind)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    text = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    assert text.strip()
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn") and delta["usage"]["output_tokens"] >= 1
    start = events[0][1]["message"]
    assert start["model"] == MODEL
    used = sum(start["usage"][k] for k in PROMPT_PARTS)
    assert used == count_tokens(server, headers, body)


def test_claude_code_2_1_332_thinking_display_updates_is_served(server):
    # Claude Code 2.1.332 with --output-format stream-json --verbose sends thinking
    # {"type": "adaptive", "display": "updates"} (beta thinking-display-updates-2026-08-18).
    # It was a 400 naming thinking.display; the CLI retried twice, then dropped display.
    # The recorded request as sent, but for the 9117-character agent list and the long
    # system block (to fit 2048 tokens), max_tokens and the model (served as "smol" then).
    rec = recorded("claude_code_2.1.332.json")
    body, headers = rec["body"], {**rec["headers"], "x-api-key": API_KEY}
    assert body["thinking"] == {"type": "adaptive", "display": "updates"}
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    body = {**body, "model": MODEL, "messages": body["messages"][:1], "system": body["system"][:2], "max_tokens": 8}
    with server.http.stream("POST", rec["path"], json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        events = sse(r)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert count_tokens(server, headers, body) == sum(events[0][1]["message"]["usage"][k] for k in PROMPT_PARTS)


def codex() -> tuple[str, dict, dict]:
    rec = recorded("codex_0.171.0.json")
    return rec["path"], {**rec["headers"], "Authorization": f"Bearer {API_KEY}"}, rec["body"]


def test_codex_turn_without_a_tool_parser_is_a_400_naming_tool_choice(server):
    # Codex always sends tool_choice "auto"; a server without --enable-auto-tool-choice
    # --tool-call-parser cannot find its calls in the text, and says which flags to set
    # (vLLM's answer; codex prints the body).
    path, headers, body = codex()
    assert body["tool_choice"] == "auto"
    r = server.http.post(path, json=body, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


def test_codex_tool_output_turn_streams_events_the_sdk_parses(server):
    # The recorded items (developer messages with ids, function_call with status,
    # function_call_output) with tool_choice "none" (no parser here) and the long developer
    # instructions cut so the prompt fits 2048 tokens.
    path, headers, body = codex()
    items = body["input"]
    assert [i["type"] for i in items[-2:]] == ["function_call", "function_call_output"]
    instructions = items[0]["content"][0]["text"]
    items = [{**items[0], "content": [{"type": "input_text", "text": instructions[:800]}]}] + items[1:]
    body = {**body, "input": items, "tool_choice": "none", "max_output_tokens": 8}
    with server.http.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        # Codex's namespace and web_search tools cannot run here: dropped and named
        assert r.headers["x-llmserve-dropped-tools"] == "namespace:multi_agent_v1,web_search"
        events = sse(r)
    parsed = [RESPONSES_EVENT.validate_python(data) for _, data in events]
    assert [e.type for e in parsed] == [k for k, _ in events]
    assert parsed[0].type == "response.created" and parsed[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    final = parsed[-1].response
    assert final.model == MODEL and final.usage.output_tokens >= 1 and final.output_text.strip()


def test_codex_prompt_over_the_context_fails_with_context_length_exceeded(server):
    # The recorded turn, instructions whole (~2500 tokens), does not fit 2048 tokens. Codex
    # 0.171.0 knows an overflow only by a response.failed whose error.code is
    # "context_length_exceeded" (then "ran out of room in the model's context window" and
    # compaction); a 400 before the stream it printed raw. Not streamed: vLLM's 400 (code 400).
    path, headers, body = codex()
    body = {**body, "tool_choice": "none"}
    with server.http.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert [k for k, _ in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    error = events[-1][1]["response"]["error"]
    assert error["code"] == "context_length_exceeded" and "maximum context length is 2048" in error["message"]
    r = server.http.post(path, json={**body, "stream": False}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
    assert r.json()["error"]["param"] == "input"


def test_codex_oss_ollama_handshake(server):
    # `codex exec --oss --local-provider ollama` (CODEX_OSS_BASE_URL=<server>/v1) asks
    # GET /v1/models, GET /api/version (refused below 0.13.4: "Ollama 0.12.6 is too old"),
    # GET /api/tags (the model must be listed), then POSTs /v1/responses.
    assert server.http.get("/v1/models").status_code == 200
    version = server.http.get("/api/version").json()["version"]
    assert tuple(int(p) for p in version.split(".")) >= (0, 13, 4), version
    names = [m["name"] for m in server.http.get("/api/tags").json()["models"]]
    assert f"{MODEL}:latest" in names  # as Ollama lists it; /v1 serves that name as MODEL


def test_head_requests_claude_code_and_ollama_clients_send(server):
    # Claude Code sends HEAD / before its first request; Ollama's Go client checks the
    # server with HEAD / (Heartbeat). Both were 405s: GET routes now answer HEAD too, with
    # the GET's headers and no body, behind the same authentication.
    get, head = server.http.get("/"), server.http.head("/")
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == get.headers["content-length"]
    assert server.http.head("/v1/models").status_code == 200
    assert server.http.head("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert server.http.head("/v1/completions").status_code == 405  # a POST-only path
