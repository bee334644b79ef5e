"""On a tiny random Llama served with ``--renderer-num-workers 4`` and a slow chat
template: /health keeps answering while 64 chats render, and the model's
generation_config.json defaults (output budget, extra EOS ids) take effect."""
from __future__ import annotations

import asyncio
import statistics
import threading
import time

import httpx
import pytest

from e2e_utils import TINY_MAX_NEW_TOKENS
from llmserve.config import ModelConfig

# Own server (~8 s); generation_config offline in tests/engine/test_generation_config.py; `make test-all` runs it (make test keeps under 15 minutes)
pytestmark = pytest.mark.slow

CHATS = 64


def _poll_health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    """Start a GET /health every 20 ms without waiting for the previous one (so a stalled
    event loop shows in every poll started while it stalls); record each latency."""
    async def one(client: httpx.AsyncClient) -> None:
        t0 = time.perf_counter()
        r = await client.get(url)
        latencies.append(time.perf_counter() - t0)
        assert r.status_code == 200

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:
            polls = []
            while not stop.is_set():
                polls.append(asyncio.create_task(one(client)))
                await asyncio.sleep(0.02)
            await asyncio.gather(*polls)

    asyncio.run(run())


async def _chats(server, n: int) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 1}
    async with httpx.AsyncClient(base_url=server.url_root, headers=headers, timeout=600,
                                 limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(n)))


@pytest.mark.slow  # tests/entrypoints/test_api_server.py::test_async_renderer_renders_off_the_event_loop covers it in process; `make test-all`
def test_health_answers_fast_while_64_slow_chat_templates_render(tiny_server):
    """The renders (and tokenization) run in the renderer's 4 threads, so the event loop
    keeps serving /health: median latency under 50 ms over the polls started during the
    load (an inline render of this template alone takes ~0.1 s, and 64 of them in a row
    would stall the loop for seconds)."""
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=_poll_health, args=(tiny_server.url_for("health"), stop, latencies))
    poller.start()
    try:
        t0 = time.perf_counter()
        responses = asyncio.run(_chats(tiny_server, CHATS))
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        poller.join(60)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200][:2]
    assert elapsed > 1.0, "the template was not slow: the load did not last long enough to measure"
    assert len(latencies) >= 10, latencies
    assert statistics.median(latencies) < 0.050, (statistics.median(latencies), sorted(latencies))


@pytest.mark.skipif(not hasattr(ModelConfig, "get_diff_sampling_param"),
                    reason="needs the generation-config defaults in ModelConfig (issue 9, args part)")
def test_generation_config_budget_and_extra_eos_reach_the_server(tiny_server):
    s = tiny_server
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    # default budget: max_new_tokens from generation_config.json (ignore_eos: the extra EOS ids stay out)
    r = s.post("/v1/chat/completions", {**chat, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == TINY_MAX_NEW_TOKENS and r["choices"][0]["finish_reason"] == "length"
    r = s.post("/v1/completions", {"model": "tiny", "prompt": "Hi", "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == TINY_MAX_NEW_TOKENS  # below OpenAI's legacy 16
    r = s.post("/v1/completions", {"model": "tiny", "prompt": "Hi", "ignore_eos": True, "max_tokens": 8}).json()
    assert r["usage"]["completion_tokens"] == 8  # the user's budget wins
    # extra EOS ids: generation_config.json lists every id, so the first token stops the request
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "Hi"}), ("/v1/chat/completions", chat)):
        r = s.post(path, {**body, "max_tokens": 8}).json()
        assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop", r
