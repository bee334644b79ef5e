"""LoRA serving surface without a server (issue 28): ``--lora-modules`` in both of vLLM's
forms, the run-time updating gate, ``vllm:lora_requests_info``, and the engine-client
entry points taking exactly vLLM's keyword arguments (a stray one is a TypeError)."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

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
