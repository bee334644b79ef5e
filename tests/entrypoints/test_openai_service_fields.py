"""The OpenAI fields that only tune OpenAI's service (``common/service_fields.py``):
``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``, ``prompt_cache_retention``,
``safety_identifier`` and ``verbosity`` take OpenAI's types and values on
``/v1/chat/completions`` and ``/v1/responses`` alike, and anything else is a 400 with the
OpenAI error body naming the field. The fresh-user trial found chat answering 200 for
``"metadata": "x"``, ``{"metadata": {"k": 5}}`` and ``"store": "yes"`` (Responses: 400),
and any type taken by both for ``service_tier``, ``verbosity``, ``prompt_cache_key`` and
``safety_identifier``."""
from __future__ import annotations

import pytest
from test_app import CHAT, _output, app_and_engine  # noqa: F401  (the fixture)

from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.common.service_fields import OpenAIServiceFields
from llmserve.entrypoints.openai.responses.protocol import ResponsesRequest

RESPONSES = {"model": "m", "input": "hi", "max_output_tokens": 3}
SHARED = ("metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier")

GOOD = [
    {"metadata": {"k": "v"}}, {"metadata": {}}, {"metadata": None},
    {"metadata": {f"k{i}".ljust(64, "x"): "v" * 512 for i in range(16)}},
    {"store": True}, {"store": False},
    *({"service_tier": t} for t in ("auto", "default", "flex", "scale", "priority", "fast")),
    {"prompt_cache_key": "01a249e0-13f6-7512-9a1e-b99d6140dabc"},  # as Codex sends it
    {"prompt_cache_retention": "in_memory"}, {"prompt_cache_retention": "24h"},
    {"safety_identifier": "u" * 128},
]
BAD = [  # (fields, param)
    ({"metadata": "x"}, "metadata"),
    ({"metadata": ["k"]}, "metadata"),
    ({"metadata": {"k": 5}}, "metadata.k"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"store": "yes"}, "store"),
    ({"store": 1}, "store"),
    ({"service_tier": "turbo"}, "service_tier"),
    ({"service_tier": 1}, "service_tier"),
    ({"prompt_cache_key": 5}, "prompt_cache_key"),
    ({"prompt_cache_retention": "1h"}, "prompt_cache_retention"),
    ({"safety_identifier": ["u"]}, "safety_identifier"),
    ({"safety_identifier": "u" * 129}, "safety_identifier"),
]


def test_one_definition_on_both_routes():
    for cls in (ChatCompletionRequest, ResponsesRequest):
        assert issubclass(cls, OpenAIServiceFields)
        for name in SHARED:
            assert cls.model_fields[name].annotation == OpenAIServiceFields.model_fields[name].annotation, name
    assert ChatCompletionRequest.model_fields["store"].default is None  # Responses: stored unless false
    assert ResponsesRequest.model_fields["store"].default is True


def _err(r, param):
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["param"] == param and err["type"] == "BadRequestError", err


def test_values_openai_takes_pass_and_others_are_400s_naming_the_field(app_and_engine):
    client, engine = app_and_engine()
    for fields in GOOD:
        engine.outputs = [_output("ok", "stop")]
        assert client.post("/v1/chat/completions", json={**CHAT, **fields}).status_code == 200, fields
        engine.outputs = [_output("ok", "stop")]
        assert client.post("/v1/responses", json={**RESPONSES, **fields}).status_code == 200, fields
    for verbosity in ("low", "medium", "high"):
        engine.outputs = [_output("ok", "stop")]
        assert client.post("/v1/chat/completions", json={**CHAT, "verbosity": verbosity}).status_code == 200
    for fields, param in BAD:
        _err(client.post("/v1/chat/completions", json={**CHAT, **fields}), param)
        _err(client.post("/v1/responses", json={**RESPONSES, **fields}), param)
    _err(client.post("/v1/chat/completions", json={**CHAT, "verbosity": "max"}), "verbosity")
    _err(client.post("/v1/chat/completions", json={**CHAT, "verbosity": 1}), "verbosity")
    _err(client.post("/v1/responses", json={**RESPONSES, "text": {"verbosity": "max"}}), "text.verbosity")
