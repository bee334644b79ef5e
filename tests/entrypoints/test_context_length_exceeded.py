"""A prompt that does not fit the context: HTTP 400 with vLLM's body (``code: 400``, which
the context-length cases C12 / C13 read) on every OpenAI route, and in-band on a streamed
``/v1/responses`` with OpenAI's ``code: "context_length_exceeded"`` (``response.failed``,
the one place Codex CLI looks for it); Anthropic's and Ollama's bodies unchanged. The engine's refusal is simulated by the
stub engine of test_app (context 64 tokens)."""
from __future__ import annotations

import json
import time

import pytest
from test_app import CHAT, _output, app_and_engine  # noqa: F401  (the fixture)

from llmserve.entrypoints.openai.common.errors import error_response_from_exception, in_band_code
from llmserve.entrypoints.openai.common.serving import renamed_param
from llmserve.entrypoints.openai.responses.protocol import ResponseError
from llmserve.sampling_params import ContextLengthExceededError, SamplingParamsError

CODE = "context_length_exceeded"
TOO_LONG = "This model's maximum context length is 64 tokens. However, your request has 90 input tokens."
RESP = {"model": "m", "input": "hi", "max_output_tokens": 3}


def _overflow() -> ContextLengthExceededError:
    return ContextLengthExceededError(TOO_LONG, "prompt")


def _sse(r) -> list[tuple[str, dict]]:
    out = []
    for block in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_the_mapping_keeps_vllms_body_and_gives_openais_code_in_band():
    status, body = error_response_from_exception(_overflow())
    err = body.model_dump()["error"]
    assert status == 400 and err == {"message": TOO_LONG, "type": "BadRequestError", "param": "prompt", "code": 400}
    assert in_band_code(_overflow(), body) == CODE
    other = SamplingParamsError("bad", "top_p")
    assert in_band_code(other, error_response_from_exception(other)[1]) == 400
    # renaming the field (prompt -> input) keeps the kind, so the code survives it
    renamed = renamed_param(_overflow(), {"prompt": "input"})
    assert isinstance(renamed, ContextLengthExceededError) and renamed.param == "input"
    assert ResponseError.of(400, "m", CODE).code == CODE and ResponseError.of(400, "m", 400).code == "invalid_prompt"


def test_every_openai_route_answers_400_with_vllms_body(app_and_engine):
    client, engine = app_and_engine()
    engine.fail_before = _overflow()
    for path, body, param in [("/v1/chat/completions", CHAT, "messages"),
                              ("/v1/chat/completions", {**CHAT, "stream": True}, "messages"),
                              ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3}, "prompt"),
                              ("/v1/responses", RESP, "input")]:
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"] == {"message": TOO_LONG, "type": "BadRequestError", "param": param, "code": 400}
    # Anthropic's and Ollama's bodies carry no code: unchanged
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    err = r.json()["error"]
    assert r.status_code == 400 and set(err) == {"type", "message"} and err["type"] == "invalid_request_error", r.text
    assert err["message"].endswith(TOO_LONG)
    r = client.post("/api/chat", json={"model": "m", "stream": False, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and list(r.json()) == ["error"] and r.json()["error"].endswith(TOO_LONG), r.text


def _assert_failed_in_band(r, opening: list[str]) -> dict:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = _sse(r)
    assert [e for e, _ in events] == [*opening, "error", "response.failed"], events
    assert events[-2][1]["code"] == CODE and events[-2][1]["param"] == "input"
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": CODE, "message": TOO_LONG.replace(
        "prompt", "input")}
    return failed


def test_a_streamed_response_fails_in_band_with_the_code(app_and_engine):
    client, engine = app_and_engine()
    engine.fail_before = _overflow()
    r = client.post("/v1/responses", json={**RESP, "stream": True})
    failed = _assert_failed_in_band(r, ["response.created", "response.in_progress"])
    stored = client.get(f"/v1/responses/{failed['id']}").json()
    assert stored["status"] == "failed" and stored["error"]["code"] == CODE
    # an input refused before it is rendered (too many characters to fit) fails the same way
    engine.fail_before = None
    r = client.post("/v1/responses", json={**RESP, "input": "word " * 150_000, "stream": True})
    assert _sse(r)[-1][1]["response"]["error"]["code"] == CODE, r.text
    r = client.post("/v1/responses", json={**RESP, "input": "word " * 150_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400 and r.json()["error"]["param"] == "input"


def test_background_responses_fail_with_the_code(app_and_engine):
    client, engine = app_and_engine()
    engine.fail_before = _overflow()
    with client:  # one event loop: the background task outlives the request
        r = client.post("/v1/responses", json={**RESP, "background": True, "stream": True})
        _assert_failed_in_band(r, ["response.created", "response.queued", "response.in_progress"])
        rid = client.post("/v1/responses", json={**RESP, "background": True}).json()["id"]
        for _ in range(100):
            stored = client.get(f"/v1/responses/{rid}").json()
            if stored["status"] == "failed":
                break
            time.sleep(0.01)
        assert stored["status"] == "failed" and stored["error"]["code"] == CODE, stored


@pytest.mark.parametrize("stream", [False, True])
def test_a_normal_answer_is_untouched(app_and_engine, stream):
    client, engine = app_and_engine()
    engine.outputs = [_output("ok", "stop")]
    r = client.post("/v1/responses", json={**RESP, "stream": stream})
    assert r.status_code == 200 and "failed" not in r.text, r.text
