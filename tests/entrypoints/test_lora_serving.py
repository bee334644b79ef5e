"""LoRA serving surface without a server (issue 28): ``--lora-modules`` in both of vLLM's
forms, the run-time updating gate, ``vllm:lora_requests_info``, and the engine-client
entry points taking exactly vLLM's keyword arguments (a stray one is a TypeError). The
served-name rule on every door a name comes in by (``--lora-modules``, the offline
``LoRARequest``, ``POST /v1/load_lora_adapter`` in process over the scripted engine)."""
from __future__ import annotations

import argparse
import json
import logging
from types import SimpleNamespace

import pytest
from test_app import app_and_engine  # noqa: F401  (fixture)

from llmserve.entrypoints.openai.models.lora import LoRAModulePath, parse_lora_module


def test_lora_modules_take_name_path_and_vllms_json():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("x", "/p", "m")
    for bad in ("nopath", "=p", "n=", '{"name": "x"}', '{"name": "x", "path": "/p", "rank": 8}', "{bad json"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def _routes(argv, monkeypatch, env=None):
    from llmserve.entrypoints.openai.api_server import build_app
    from llmserve.entrypoints.openai.cli_args import make_arg_parser

    for name in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    if env:
        monkeypatch.setenv(*env)
    args = make_arg_parser().parse_args(argv)
    return set(build_app(args).openapi()["paths"])


def test_load_routes_exist_only_when_runtime_updating_is_allowed(monkeypatch):
    paths = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
    from llmserve.entrypoints.openai.cli_args import make_arg_parser

    assert not set(paths) & _routes([], monkeypatch)
    assert set(paths) <= _routes([], monkeypatch, ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1"))  # vLLM's switch
    assert make_arg_parser().parse_args(["--no-allow-runtime-lora-updating"]).allow_runtime_lora_updating is False
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert make_arg_parser().parse_args(["--allow-runtime-lora-updating"]).allow_runtime_lora_updating is True


def test_lora_requests_info_names_running_and_waiting_adapters():
    from llmserve.metrics.prometheus import PrometheusStatLogger
    from llmserve.metrics.stats import SchedulerStats

    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name=("m",), max_model_len=64),
                             lora_config=SimpleNamespace(max_loras=3))
    sl = PrometheusStatLogger(config)
    for running, waiting in (({"b": 1, "a": 2}, {"c": 1}), ({"a": 1}, {})):
        stats = SchedulerStats()
        stats.running_lora_adapters, stats.waiting_lora_adapters = running, waiting
        sl.record(stats, None)
    lines = [x for x in sl.render().decode().splitlines() if x.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1, lines  # only the current label set
    assert 'max_lora="3"' in lines[0] and 'running_lora_adapters="a"' in lines[0]
    assert 'waiting_lora_adapters=""' in lines[0] and float(lines[0].split()[-1]) > 1e9  # a Unix time
    no_lora = PrometheusStatLogger(SimpleNamespace(model_config=config.model_config))
    assert "lora_requests_info" not in no_lora.render().decode()


# ---- served-name rule (llmserve.served_names): names reach log lines and metric labels
# Names vLLM and OpenAI users write: slashes, colons, dots, dashes, '@', '+', inner spaces,
# any script.
GOOD_NAMES = ["sql", "org/model:tag", "ft:gpt-4o-mini:acme::abc123", "Qwen/Qwen2.5-0.5B-Instruct",
              "llama3.2:1b-q4_K_M", "a@b+c", "my adapter", "ü-адаптер-日本", "x" * 256]
# One of each refused class: control characters (newline, CR, tab, ESC, NUL, DEL), format
# characters (zero-width space, bidi override), the Unicode line/paragraph separators, a
# no-break space, leading/trailing whitespace, a comma (the lora_requests_info separator),
# too long, empty, and a lone surrogate.
BAD_NAMES = ["a\nINFO forged line", "a\rb", "a\tb", "a\x1b[31mred", "a\x00b", "a\x7fb", "a\u200bb", "a\u202eb",
             "a\u2028b", "a\u2029b", "a\u00a0b", " a", "a ", "a,b", "x" * 257, "", "a\ud800b"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_lora_modules_refuse_a_bad_name_in_both_forms(name):
    from llmserve.lora.request import LoRARequest

    forms = ['{"name": %s, "path": "/p"}' % json.dumps(name)]
    if name.strip() and name == name.lstrip():  # "name=path" strips the whole value first
        forms.append(f"{name}=/p")
    for form in forms:
        with pytest.raises(argparse.ArgumentTypeError, match="--lora-modules") as e:
            parse_lora_module(form)
        assert "\n" not in str(e.value) and "\r" not in str(e.value)  # the name is quoted with repr
    with pytest.raises(ValueError, match="lora_name"):  # the offline API: LLM.generate(lora_request=...)
        LoRARequest(name, 1, "/p")


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_lora_names_that_model_ids_use_stay_allowed(name):
    from llmserve.lora.request import LoRARequest

    assert parse_lora_module(json.dumps({"name": name, "path": "/p"})).name == name
    if " " not in name:  # "name=path" is stripped as a whole: inner spaces are fine
        assert parse_lora_module(f"{name}=/p") == LoRAModulePath(name, "/p")
    assert LoRARequest(name, 1, "/p").lora_name == name


class _AdapterEngine:
    """The engine half of LoRA loading as AsyncLLM has it: ``add_lora`` / ``remove_lora``,
    recording what reached it."""

    def __init__(self):
        self.added, self.removed = [], []

    async def add_lora(self, lora):
        self.added.append(lora.lora_name)
        return True

    async def remove_lora(self, lora_id):
        self.removed.append(lora_id)
        return True


def test_lora_modules_name_given_twice_says_so():
    """``--lora-modules a=/p a=/q`` fails at start-up saying the name is given twice (it
    said "set 'load_inplace' to True", an HTTP field with no meaning on the command line)."""
    import asyncio

    from llmserve.entrypoints.openai.models.lora import LoRAAdapters

    engine = _AdapterEngine()
    with pytest.raises(ValueError) as e:
        asyncio.run(LoRAAdapters(engine, ["m"]).load_static([LoRAModulePath("a", "/p"), LoRAModulePath("a", "/q")]))
    assert str(e.value) == "--lora-modules: the name 'a' is given twice (each adapter needs its own name)"
    assert "load_inplace" not in str(e.value)


@pytest.fixture
def lora_client(app_and_engine):  # noqa: F811
    """The app (scripted engine, run-time LoRA updating on) with an adapter table over
    :class:`_AdapterEngine`, as ``start_lora_adapters`` makes it with --enable-lora."""
    from llmserve.entrypoints.openai.models.lora import LoRAAdapters

    client, _ = app_and_engine("--allow-runtime-lora-updating")
    engine = _AdapterEngine()
    state = client.app.state
    state.lora_adapters = LoRAAdapters(engine, ["m"])
    state.openai_serving_models.lora = [state.lora_adapters]  # as init_app_state links them
    return client, engine


@pytest.mark.parametrize("name", BAD_NAMES + [5, None, ["a"]])
def test_load_lora_adapter_refuses_a_bad_name_with_a_400_naming_lora_name(lora_client, name):
    client, engine = lora_client
    # JSON with \u escapes, as a client sends a lone surrogate (httpx would not encode it)
    r = client.post("/v1/load_lora_adapter", content=json.dumps({"lora_name": name, "lora_path": "/p"}),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["param"] == "lora_name" and err["code"] == 400 and err["type"] == "BadRequestError", err
    assert engine.added == []  # refused before the engine
    # the next request is served as usual, and the name table holds only it
    ok = client.post("/v1/load_lora_adapter", json={"lora_name": "org/sql:v2", "lora_path": "/p"})
    assert ok.status_code == 200 and engine.added == ["org/sql:v2"], ok.text
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m", "org/sql:v2"]


def test_lora_load_and_unload_logs_quote_the_clients_text(lora_client, caplog):
    """The path (and an unknown name to unload) are the client's text too: each log record
    of the routes is one line, whatever the body holds."""
    client, _ = lora_client
    caplog.set_level(logging.INFO, logger="llmserve")
    path = "/p\nERROR llmserve: forged line"
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path}).status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "b\nERROR forged"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("Loaded LoRA adapter 'a'" in m for m in messages) and any("Unloaded" in m for m in messages)
    assert all("\n" not in m for m in messages), messages


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_load_routes_when_not_allowed_are_a_404_that_names_the_switches(app_and_engine, path):  # noqa: F811
    # vLLM's status, but it was Starlette's bare {"detail": "Not Found"}: nothing said why
    client, _ = app_and_engine("--no-allow-runtime-lora-updating")
    r = client.post(path, json={"lora_name": "a", "lora_path": "/nowhere"})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["type"] == "NotFoundError" and error["code"] == 404, error
    for switch in ("--allow-runtime-lora-updating", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
                   "LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING=1", path):
        assert switch in error["message"], error["message"]
