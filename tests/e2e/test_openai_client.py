"""The issue's "Must show" list through the official ``openai`` client (sync and async):
n choices, stop strings, logprobs, echo, usage, streaming, error classes."""
from __future__ import annotations

import asyncio

import openai
import pytest

from e2e_utils import MODEL

MSG = [{"role": "user", "content": "Name three colours."}]


def test_chat_n_stop_logprobs_usage(server):
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=MSG, n=3, max_tokens=5, temperature=1.0, seed=1,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 15
    base = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0)
    text = base.choices[0].message.content
    word = next(w for w in text.split() if len(w) > 2 and text.find(w) > 0)
    cut = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0, stop=[word])
    assert cut.choices[0].message.content == text[:text.find(word)] and cut.choices[0].finish_reason == "stop"
    lp = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert lp.usage.prompt_tokens == server.post("/tokenize", {"model": MODEL, "messages": MSG}).json()["count"]


def test_completions_echo_logprobs_and_stream(server):
    client = server.client()
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    ch = r.choices[0]
    assert ch.text.startswith(prompt)
    assert len(ch.logprobs.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert ch.logprobs.token_logprobs[0] is None and all(x <= 0 for x in ch.logprobs.token_logprobs[1:])
    assert r.usage.prompt_tokens == server.tok(prompt)["count"]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                                    temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == full.choices[0].text


def test_async_client_concurrent_streams(server):
    async def run():
        client = server.async_client()
        async def one(i):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Say {i}."}], max_tokens=6, temperature=0,
                stream=True, stream_options={"include_usage": True})
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage:
                    usage = chunk.usage
            return text, usage
        out = await asyncio.gather(*(one(i) for i in range(4)))
        await client.close()
        return out
    for text, usage in asyncio.run(run()):
        assert usage is not None and usage.completion_tokens >= 1
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_client_error_classes(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MSG)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
