"""Issue 26 item 7: liveness (``/health``, ``/ping``) apart from readiness (``/ready``).

A liveness probe that fails restarts the server, so ``/health`` stays 200 while the
engine heals itself (a self-heal restart under way, or a stall the healer will end by
killing and restarting the engine) and answers 503 only for an engine that will not come
back (dead without self-heal or past its restart budget, or stalled without self-heal).
``/ready`` says not-ready (503) while the engine restarts. First over the app with an
engine stub, then with a real tiny engine whose process is killed and healed."""
from __future__ import annotations

import argparse
import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from llmserve.engine.exceptions import EngineDeadError
from llmserve.entrypoints.openai.api_server import build_app, init_app_state
from llmserve.entrypoints.openai.cli_args import make_arg_parser


class _Engine:
    """Engine stub; ``healer`` as AsyncLLM's (None: no self-heal), ``dead`` as ``errored``."""

    def __init__(self, tokenizer, healer=None):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=64, vocab_size=49152, served_model_name=("m",), model="m")
        self.generation_config_defaults = {}
        self.healer = healer
        self.dead = False

    @property
    def errored(self):
        return self.dead

    async def check_health(self):
        if self.dead:
            raise EngineDeadError("EngineCore failed 5 times within 300 s: giving up")


def _client(tokenizer, healer=None, stalled_s=0.0):
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--engine-stall-timeout", "10"])
    engine = _Engine(tokenizer, healer)
    app = build_app(args)
    asyncio.run(init_app_state(engine, app.state, args))
    app.state.admission.stalled_for = lambda: stalled_s  # no progress for that long, requests in flight
    return TestClient(app), engine


@pytest.mark.parametrize("stalled_s", [0.0, 12.0])
def test_alive_while_healing_but_not_ready(smol_tokenizer, stalled_s):
    client, _ = _client(smol_tokenizer, SimpleNamespace(restarting=True), stalled_s)
    for path in ("/health", "/ping"):
        r = client.get(path)
        assert r.status_code == 200 and r.json() == {"status": "healing"}, (path, r.text)
    r = client.get("/ready")
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "EngineRestartingError" and "restarting" in r.json()["error"]["message"]


def test_a_stall_is_fatal_only_without_self_heal(smol_tokenizer):
    healing, _ = _client(smol_tokenizer, SimpleNamespace(restarting=False), stalled_s=12.0)
    assert healing.get("/health").json() == {"status": "ok"}  # the healer kills and restarts a stalled engine
    r = healing.get("/ready")
    assert r.status_code == 503 and r.json()["error"]["type"] == "EngineStalledError"
    plain, _ = _client(smol_tokenizer, None, stalled_s=12.0)
    r = plain.get("/health")
    assert r.status_code == 503 and r.json()["error"]["type"] == "EngineStalledError"
    assert "12.0 s" in r.json()["error"]["message"]
    assert plain.get("/ping").status_code == 503 and plain.get("/ready").status_code == 503


@pytest.mark.parametrize("healer", [None, SimpleNamespace(restarting=False)])
def test_an_engine_that_will_not_come_back_is_reported(smol_tokenizer, healer):
    client, engine = _client(smol_tokenizer, healer)
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
    engine.dead = True  # died without self-heal, or its restart budget is spent
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["type"] == "EngineDeadError"
    assert "giving up" in r.json()["error"]["message"]
    assert client.get("/ready").status_code == 503


# ---- a real tiny engine, killed and healed -----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, save_tiny_model_fn):
    from llmserve.tokenizer import get_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-heal"))
    save_tiny_model_fn("llama", path)
    get_tokenizer("SmolLM2-135M-Instruct").save_pretrained(path)
    return path


async def _probe_through_restart(tiny_dir):
    from llmserve import AsyncEngineArgs, AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=tiny_dir, dtype="float32", kv_cache_memory="64MiB", max_model_len=128, disable_log_stats=True,
        restart_engine_on_failure=True))
    try:
        args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--model", tiny_dir])
        app = build_app(args)
        await init_app_state(engine, app.state, args)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            assert (await http.get("/health")).json() == {"status": "ok"}
            assert (await http.get("/ready")).status_code == 200
            await engine.restart_engine()  # SIGKILL of the EngineCore process
            seen = []  # (health status, health body, ready status) while it heals
            t_end = time.monotonic() + 120  # a guard against a hang, not a timing assertion
            while engine.num_engine_restarts == 0 and time.monotonic() < t_end:
                health, ready = await http.get("/health"), await http.get("/ready")
                seen.append((health.status_code, health.json().get("status"), ready.status_code))
                await asyncio.sleep(0.1)
            after = (await http.get("/health")).json(), (await http.get("/ready")).status_code
            done = await http.post("/v1/completions", json={"model": tiny_dir, "prompt": "hi", "max_tokens": 2})
        return engine.num_engine_restarts, seen, after, done
    finally:
        engine.shutdown()


def test_a_real_engine_restart_keeps_health_200_and_ready_503(tiny_dir):
    restarts, seen, after, done = asyncio.run(_probe_through_restart(tiny_dir))
    assert restarts == 1
    assert seen and all(status == 200 for status, _, _ in seen), seen  # never a 503 a liveness probe would act on
    assert (200, "healing", 503) in seen, seen
    assert after == ({"status": "ok"}, 200)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] >= 1
