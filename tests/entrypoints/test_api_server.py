"""The server's assembly: every endpoint family mounted by its register_*_api_routers,
the online renderer's thread pool, and the engine-client context manager's shutdown."""
from __future__ import annotations

import argparse
import asyncio
import threading

import psutil
import pytest
from fastapi import FastAPI

from llmserve.entrypoints.openai import api_server
from llmserve.entrypoints.openai.api_server import (
    API_ROUTER_REGISTRARS,
    build_app,
    build_async_engine_client_from_engine_args,
)
from llmserve.entrypoints.openai.cli_args import make_arg_parser
from llmserve.entrypoints.renderer import AsyncRenderer, Renderer
from llmserve.sampling_params import SamplingParams

FAMILIES = {
    "register_basic_api_routers": {"/health", "/v1/health", "/ready", "/version", "/metrics"},
    "register_models_api_routers": {"/v1/models", "/models", "/v1/models/{model_id}"},
    "register_chat_api_routers": {"/v1/chat/completions", "/chat/completions"},
    "register_completion_api_routers": {"/v1/completions"},
    "register_infill_api_routers": {"/infill", "/completion", "/completions", "/apply-template", "/props",
                                    "/slots", "/slots/{id_slot}"},
    "register_tokenize_api_routers": {"/tokenize", "/detokenize"},
    "register_render_api_routers": {"/v1/completions/render", "/v1/chat/completions/render"},
    "register_kv_event_sources_api_routers": {"/kv_event_sources", "/get_server_info"},
    "register_responses_api_routers": {"/v1/responses", "/v1/responses/{response_id}", "/v1/responses/input_tokens",
                                       "/v1/responses/{response_id}/cancel", "/v1/responses/{response_id}/input_items"},
    "register_embeddings_api_routers": {"/v1/embeddings", "/pooling", "/embedding", "/embeddings"},
    "register_score_api_routers": {"/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/reranking",
                                   "/v1/reranking"},
    "register_classify_api_routers": {"/classify", "/v1/classify"},
    "register_speech_to_text_api_routers": {"/v1/audio/transcriptions", "/v1/audio/translations"},
    "register_sagemaker_api_routers": {"/invocations", "/ping"},
    "register_anthropic_api_routers": {"/v1/messages", "/v1/messages/count_tokens"},
    "register_ollama_api_routers": {"/api/chat", "/api/embed", "/api/embeddings", "/api/generate", "/api/ps",
                                    "/api/show", "/api/tags", "/api/version"},
    "register_request_timeline_api_routers": {"/v1/requests", "/v1/requests/{request_id}/timeline"},
    # Stored chat completions' routes only answer OpenAI's 404 (vLLM keeps none): not in the schema.
    "register_stored_chat_api_routers": set(),
}


def _paths(app: FastAPI) -> set[str]:
    return set(app.openapi()["paths"])


def test_each_register_function_mounts_its_endpoint_family():
    assert {f.__name__ for f in API_ROUTER_REGISTRARS} == set(FAMILIES)
    for register in API_ROUTER_REGISTRARS:
        app = FastAPI()
        register(app)
        assert _paths(app) == FAMILIES[register.__name__], register.__name__


def test_build_app_mounts_every_family():
    args = make_arg_parser(argparse.ArgumentParser()).parse_args([])
    # /load is mounted by the frontend flags (0 unless --enable-server-load-tracking)
    assert _paths(build_app(args)) == set().union(*FAMILIES.values()) | {"/load"}


SLOW_TEMPLATE = ("{% set ns = namespace(n=0) %}{% for i in range(60000) %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                 "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")


async def test_async_renderer_renders_off_the_event_loop(smol_tokenizer):
    """While slow templates render in the pool, the event loop keeps running (a ticker
    advances); the rendered ids equal the synchronous renderer's."""
    renderer = Renderer(smol_tokenizer, SLOW_TEMPLATE)
    pool = AsyncRenderer(renderer, num_workers=2)
    msgs = [{"role": "user", "content": "hi"}]
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            await asyncio.sleep(0.005)
            ticks += 1

    t = asyncio.create_task(ticker())
    threads = set()
    orig = renderer.render_chat

    def spy(*a, **kw):
        threads.add(threading.current_thread().name)
        return orig(*a, **kw)

    renderer.render_chat = spy
    try:
        results = await asyncio.gather(*(pool.render_chat(msgs, add_generation_prompt=False) for _ in range(4)))
    finally:
        stop.set()
        await t
        pool.shutdown()
    assert all(r == results[0] for r in results)
    assert results[0].token_ids == orig(msgs, add_generation_prompt=False).token_ids
    assert results[0].text == "[user] hi\n"
    assert threads and all(n.startswith("llmserve-renderer") for n in threads)
    assert ticks >= 3, ticks  # an inline render would have starved the ticker


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_async_renderer_num_workers_is_validated(smol_tokenizer, bad):
    with pytest.raises(ValueError, match="renderer_num_workers"):
        AsyncRenderer(Renderer(smol_tokenizer), bad)


async def test_engine_client_context_manager_shuts_down_within_timeout(monkeypatch):
    """``build_async_engine_client_from_engine_args``: yields a working AsyncLLM; leaving
    the block (here by an exception) calls ``shutdown(timeout=shutdown_timeout)`` and the
    engine process is gone."""
    from llmserve.engine.async_llm import AsyncLLM
    from llmserve.engine_args import AsyncEngineArgs

    calls = []
    real_shutdown = AsyncLLM.shutdown

    def recording_shutdown(self, timeout=None):
        calls.append(timeout)
        return real_shutdown(self, timeout=timeout)

    monkeypatch.setattr(AsyncLLM, "shutdown", recording_shutdown)
    engine_args = AsyncEngineArgs(kv_cache_memory="64MiB", max_model_len=256, disable_log_stats=True)
    engine_args.shutdown_timeout = 7.0  # a field of EngineArgs once the args branch lands
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match="handler failed"):
        async with build_async_engine_client_from_engine_args(engine_args) as engine_client:
            children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
            assert children, "the EngineCore runs in its own process"
            outs = [o async for o in engine_client.generate(
                {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, ignore_eos=True), "cm-1")]
            assert len(outs[-1].outputs[0].token_ids) == 2
            assert api_server._prometheus_logger(engine_client) is not None
            raise RuntimeError("handler failed")
    assert calls == [7.0]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
