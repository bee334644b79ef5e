"""A generation cut off before it finished (finish reason "abort" on server shutdown, or
any finish reason that is not stop/length/tool_calls) is an error on the Anthropic and
Ollama doors, not a normal end: Anthropic streams end with an ``error`` event and
``/v1/messages`` answers Anthropic's api_error body; Ollama streams end with an
``{"error"}`` line and ``"stream": false`` answers Ollama's error body. The official
``anthropic`` and ``ollama`` clients raise their API error on these answers."""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import httpx2  # the anthropic SDK's httpx
import ollama
import pytest

from llmserve.entrypoints.anthropic.protocol import AnthropicMessagesRequest, anthropic_error_body
from llmserve.entrypoints.anthropic.serving import message_of
from llmserve.entrypoints.anthropic.streaming import MessageStreamWriter, message_events
from llmserve.entrypoints.ollama.api_router import ollama_error_body
from llmserve.entrypoints.ollama.stream import OllamaWire, RunStats
from llmserve.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponse,
                                                                  ChatCompletionResponseChoice,
                                                                  ChatCompletionResponseStreamChoice,
                                                                  ChatCompletionStreamResponse, ChatMessage,
                                                                  DeltaMessage)
from llmserve.entrypoints.openai.common.errors import RequestAbortedError, error_response_from_exception
from llmserve.entrypoints.openai.common.protocol import UsageInfo

CUT_OFF = ["abort", "error"]


def _chunks(finish: str) -> list[ChatCompletionStreamResponse]:
    """"1, 2," then the finish chunk and the usage chunk (7 prompt, 350 output tokens)."""
    def chunk(delta: DeltaMessage, reason=None) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id="c", created=0, model="m", choices=[
            ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=reason)])
    return [chunk(DeltaMessage(role="assistant", content="")), chunk(DeltaMessage(content="1, 2,")),
            chunk(DeltaMessage(content=""), finish),
            ChatCompletionStreamResponse(id="c", created=0, model="m", choices=[],
                                         usage=UsageInfo(prompt_tokens=7, completion_tokens=350, total_tokens=357))]


async def _gen(items):
    for item in items:
        yield item


def _sse_text(finish: str) -> str:
    """The Anthropic SSE text the server streams for ``_chunks(finish)``."""
    async def collect():
        return [e async for e in message_events(_gen(_chunks(finish)), MessageStreamWriter("msg_1", "m", None))]
    return "".join(asyncio.run(collect()))


def _anthropic_events(finish: str) -> list[tuple[str, dict]]:
    text = _sse_text(finish)
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


@pytest.mark.parametrize("finish", CUT_OFF)
def test_anthropic_stream_of_a_cut_off_generation_ends_with_an_error_event(finish):
    events = _anthropic_events(finish)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and "text_delta" in json.dumps(events)
    assert kinds[-1] == "error" and "message_delta" not in kinds and "message_stop" not in kinds
    error = events[-1][1]
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert f"finish reason '{finish}'" in error["error"]["message"] and "350 output tokens" in error["error"]["message"]


def test_anthropic_stream_of_a_normal_end_is_unchanged():
    events = _anthropic_events("stop")
    assert [k for k, _ in events][-2:] == ["message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"


def _response(finish: str) -> ChatCompletionResponse:
    return ChatCompletionResponse(id="c", created=0, model="m", choices=[ChatCompletionResponseChoice(
        index=0, message=ChatMessage(role="assistant", content="1, 2,"), finish_reason=finish)],
        usage=UsageInfo(prompt_tokens=7, completion_tokens=350, total_tokens=357))


@pytest.mark.parametrize("finish", CUT_OFF)
def test_anthropic_message_of_a_cut_off_generation_is_api_error(finish):
    request = AnthropicMessagesRequest(model="m", max_tokens=1900, messages=[{"role": "user", "content": "Count"}])
    with pytest.raises(RequestAbortedError) as info:
        message_of(_response(finish), "msg_1", request)
    status, body = error_response_from_exception(info.value)
    assert status == 500
    shaped = anthropic_error_body(status, body.error.model_dump())
    assert shaped["error"]["type"] == "api_error" and "cut off" in shaped["error"]["message"]
    assert message_of(_response("stop"), "msg_1", request).stop_reason == "end_turn"


@pytest.mark.parametrize("finish", CUT_OFF)
async def test_ollama_stream_and_whole_of_a_cut_off_generation_are_errors(finish):
    lines = [json.loads(ln) async for ln in OllamaWire("m", chat=False).lines(_gen(_chunks(finish)), RunStats())]
    assert lines[0]["response"] == "1, 2," and lines[0]["done"] is False
    assert set(lines[-1]) == {"error"} and f"finish reason '{finish}'" in lines[-1]["error"]
    assert not any(ln.get("done") for ln in lines)
    with pytest.raises(RequestAbortedError, match="350 output tokens"):
        await OllamaWire("m", chat=False).whole(_gen(_chunks(finish)), RunStats())
    whole = await OllamaWire("m", chat=False).whole(_gen(_chunks("stop")), RunStats())
    assert whole["done_reason"] == "stop" and whole["response"] == "1, 2,"


def _mock(handler) -> httpx2.Client:
    """An anthropic SDK http client answering every request with ``handler(request)``."""
    return httpx2.Client(transport=httpx2.MockTransport(handler), base_url="http://server")


def _abort_body(shape) -> dict:
    status, body = error_response_from_exception(RequestAbortedError("abort", 350))
    return shape(status, body.error.model_dump())


def test_official_clients_raise_their_api_error_on_these_answers():
    """What the server sends for a cut-off generation, fed to the official clients."""
    message = _abort_body(anthropic_error_body)
    client = anthropic.Anthropic(api_key="k", base_url="http://server", max_retries=0,
                                 http_client=_mock(lambda r: httpx2.Response(500, json=message)))
    with pytest.raises(anthropic.InternalServerError, match="cut off"):
        client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "Count"}])

    sse = _sse_text("abort")
    client = anthropic.Anthropic(api_key="k", base_url="http://server", max_retries=0, http_client=_mock(
        lambda r: httpx2.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})))
    with pytest.raises(anthropic.APIStatusError, match="cut off"):
        with client.messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "Count"}]) as s:
            for _ in s:
                pass

    body = _abort_body(ollama_error_body)
    client = ollama.Client(host="http://server", transport=httpx.MockTransport(lambda r: httpx.Response(500, json=body)))
    with pytest.raises(ollama.ResponseError, match="cut off") as info:
        client.generate(model="m", prompt="1, 2,", raw=True, stream=False)
    assert info.value.status_code == 500
    ndjson = b'{"model":"m","created_at":"2026-12-06T00:00:00Z","response":"3,","done":false}\n' + \
        json.dumps(body).encode() + b"\n"
    client = ollama.Client(host="http://server", transport=httpx.MockTransport(lambda r: httpx.Response(200, content=ndjson)))
    with pytest.raises(ollama.ResponseError, match="cut off"):
        for _ in client.generate(model="m", prompt="1, 2,", raw=True, stream=True):
            pass
