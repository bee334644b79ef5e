"""Request models -> SamplingParams, request-level validation (param named), wire shapes."""
from __future__ import annotations

import importlib
import json
import types
import typing

import pytest
from pydantic import ValidationError

from llmserve.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from llmserve.entrypoints.openai.completion.protocol import CompletionRequest
from llmserve.entrypoints.openai.tokenize.protocol import TokenizeRequest
from llmserve.sampling_params import RequestOutputKind, SamplingParamsError

HI = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return ChatCompletionRequest(messages=HI, **kw)


def test_chat_fields_map_to_sampling_params():
    req = chat(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
               frequency_penalty=-0.5, seed=3, stop="END", stop_token_ids=[7], ignore_eos=True, min_tokens=2,
               skip_special_tokens=False, spaces_between_special_tokens=False, include_stop_str_in_output=True,
               logit_bias={"42": 200}, n=2, logprobs=True, top_logprobs=4)
    req.check()
    sp = req.to_sampling_params(max_tokens=10, defaults={})
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.7, 0.9, 5, 0.1)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.2, 0.5, -0.5)
    assert sp.seed == 3 and sp.stop == ["END"] and sp.stop_token_ids == [7] and sp.ignore_eos
    assert sp.min_tokens == 2 and sp.max_tokens == 10 and sp.n == 2
    assert not sp.skip_special_tokens and not sp.spaces_between_special_tokens and sp.include_stop_str_in_output
    assert sp.logit_bias == {42: 100.0}  # OpenAI's clamp to [-100, 100]
    assert sp.logprobs == 4 and sp.prompt_logprobs is None
    assert sp.output_kind == RequestOutputKind.FINAL_ONLY
    assert chat(stream=True).to_sampling_params(5, {}).output_kind == RequestOutputKind.DELTA
    assert chat().to_sampling_params(5, {}).logprobs is None
    assert chat(logprobs=True).to_sampling_params(5, {}).logprobs == 0


def test_generation_config_defaults_apply_only_when_unset():
    defaults = {"temperature": 0.3, "top_k": 20, "repetition_penalty": 1.1}
    sp = chat().to_sampling_params(5, defaults)
    assert (sp.temperature, sp.top_k, sp.repetition_penalty) == (0.3, 20, 1.1)
    sp = chat(temperature=0.9, top_k=3).to_sampling_params(5, defaults)
    assert (sp.temperature, sp.top_k) == (0.9, 3)
    assert chat().to_sampling_params(5, {}).temperature == 1.0  # OpenAI's default


def test_unset_chat_budget_is_left_to_the_engine():
    """No max_tokens / max_completion_tokens: SamplingParams.max_tokens is None, so the
    engine's InputProcessor resolves it (room left, capped by the model's budget)."""
    req = chat()
    assert req.requested_max_tokens() is None
    assert req.to_sampling_params(req.requested_max_tokens(), {"max_tokens": 7}).max_tokens is None
    both = chat(max_tokens=9, max_completion_tokens=4)
    assert both.to_sampling_params(both.requested_max_tokens(), {}).max_tokens == 4


@pytest.mark.parametrize("kw,param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"temperature": 3.0}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_completion_tokens": -2}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": {"name": "g"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_chat_check_names_the_param(kw, param):
    with pytest.raises(SamplingParamsError) as e:
        chat(**kw).check()
    assert e.value.param == param


def test_tool_errors_do_not_quote_the_clients_values_back():
    secret = "secret_" + "x" * 60
    for kw in ({"tools": [{"type": "function", "function": {"name": secret + " !"}}]},
               {"tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": secret}}}):
        with pytest.raises(SamplingParamsError) as e:
            chat(**kw).check()
        assert "secret" not in str(e.value), e.value
    with pytest.raises(SamplingParamsError) as e:
        chat(modalities=["text", secret]).check()
    assert e.value.param == "modalities" and "secret" not in str(e.value) and "modalities[1]" in str(e.value)


@pytest.mark.parametrize("kw,param", [({"top_k": -5}, "top_k"), ({"top_p": 0}, "top_p"), ({"stop": [""]}, "stop"),
                                      ({"presence_penalty": 2.5}, "presence_penalty"),
                                      ({"repetition_penalty": 0}, "repetition_penalty")])
def test_sampling_params_errors_keep_param(kw, param):
    req = chat(**kw)
    req.check()
    with pytest.raises(SamplingParamsError) as e:
        req.to_sampling_params(4, {})
    assert e.value.param == param


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [-1, 0])
def test_chat_budget_below_one_names_the_real_bound(field, value):
    """Chat's bound is >= 1 (0 only with echo): -1 was told "at least 0", and 0 was then
    refused too (fresh-user trial). The route's checks, in the route's order."""
    from llmserve.entrypoints.openai.admission_precheck import _check_chat

    with pytest.raises(SamplingParamsError) as e:
        _check_chat(None, chat(**{field: value}))
    assert e.value.param == field and ">= 1" in str(e.value) and "at least 0" not in str(e.value)
    echo = chat(**{field: value}, echo=True)
    if value == 0:
        _check_chat(None, echo)  # scoring the prompt: 0 is allowed
    else:
        with pytest.raises(SamplingParamsError, match="at least 0"):  # with echo 0 is the real bound
            _check_chat(None, echo)


def test_accepted_edge_values():
    for kw in ({"top_k": -1}, {"temperature": 0}, {"temperature": 2.0}, {"response_format": {"type": "text"}},
               {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
               {"stream": True, "stream_options": {}}):
        req = chat(**kw)
        req.check()
        req.to_sampling_params(4, {})
    assert chat(max_tokens=50, max_completion_tokens=3).requested_max_tokens() == 3
    assert chat(max_tokens=50).requested_max_tokens() == 50


def test_completion_request_checks_and_echo_prompt_logprobs():
    # (``suffix`` is checked by the handler against the model's FIM tokens: tests/e2e/test_fim_infill.py)
    for kw, param in (({"logprobs": 25}, "logprobs"), ({"best_of": 3}, "best_of")):
        with pytest.raises(SamplingParamsError) as e:
            CompletionRequest(prompt="a", **kw).check()
        assert e.value.param == param
    sp = CompletionRequest(prompt="a", echo=True, logprobs=2).to_sampling_params(1, {})
    assert sp.logprobs == 2 and sp.prompt_logprobs == 2
    sp = CompletionRequest(prompt="a", logprobs=2).to_sampling_params(1, {})
    assert sp.prompt_logprobs is None


def test_best_of_other_than_n_names_both_values():
    """best_of is accepted only equal to n; the 400 says so with both values (it said
    "best_of is not supported" while best_of == n works and the README counts it)."""
    for best_of, n in ((4, 2), (1, 2), (3, None)):
        with pytest.raises(SamplingParamsError) as e:
            CompletionRequest(prompt="a", best_of=best_of, n=n).check()
        assert e.value.param == "best_of"
        assert str(e.value).startswith(f"best_of ({best_of}) must equal n ({n or 1}): "), str(e.value)
        assert "not supported" in str(e.value) and "leave best_of out or set it to n" in str(e.value)
    CompletionRequest(prompt="a", best_of=2, n=2).check()


@pytest.mark.parametrize("prompt", ["x", ["a", "b"], [1, 2], [[1], [2, 3]]])
def test_prompt_forms_accepted(prompt):
    assert CompletionRequest(prompt=prompt).prompt == prompt


@pytest.mark.parametrize("prompt", [[1.5], ["a", 3], [[1], "x"], None, {"a": 1}])
def test_prompt_forms_rejected(prompt):
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=prompt)


def test_messages_must_be_a_non_empty_list():
    for bad in ("not-a-list", [], [{"content": "no role"}]):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(messages=bad)


def test_stream_chunk_wire_shape():
    chunk = ChatCompletionStreamResponse(id="x", created=1, model="m", choices=[
        ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    d = json.loads(chunk.model_dump_json())
    ch = d["choices"][0]
    assert ch["delta"] == {"role": "assistant", "content": ""}
    assert "finish_reason" in ch and ch["finish_reason"] is None
    assert json.loads(DeltaMessage(content="a").model_dump_json()) == {"content": "a"}


def test_tokenize_request_exactly_one_input():
    with pytest.raises(SamplingParamsError):
        TokenizeRequest(prompt="a", messages=HI).check()
    with pytest.raises(SamplingParamsError):
        TokenizeRequest().check()
    TokenizeRequest(prompt="a").check()
    with pytest.raises(SamplingParamsError) as e:
        TokenizeRequest(messages=HI, continue_final_message=True).check()
    assert e.value.param == "continue_final_message"


def test_non_finite_and_oversized_numbers_rejected():
    for kw in ({"temperature": float("nan")}, {"top_p": float("inf")}, {"seed": 2**70}, {"top_k": 2**64},
               {"max_tokens": 10**30}, {"stop_token_ids": [2**64]}):
        with pytest.raises(ValidationError):
            chat(**kw)
    assert chat(seed=-(2**63)).seed == -(2**63)
    from llmserve.entrypoints.openai.common.protocol import MAX_N

    with pytest.raises(SamplingParamsError) as e:
        chat(n=MAX_N + 1).check()
    assert e.value.param == "n" and str(MAX_N) in str(e.value)


@pytest.mark.parametrize("kw,param", [({"audio": {"voice": "alloy"}}, "audio"),
                                      ({"modalities": ["text", "audio"]}, "modalities"),
                                      ({"web_search_options": {}}, "web_search_options"),
                                      ({"functions": [{"name": "f"}]}, "functions"),
                                      ({"function_call": {"name": "f"}}, "function_call")])
def test_openai_fields_this_server_cannot_honour(kw, param):
    with pytest.raises(SamplingParamsError) as e:
        chat(**kw).check()
    assert e.value.param == param
    chat(modalities=["text"], function_call="auto", reasoning_effort="low").check()


def test_reasoning_effort_is_a_template_variable():
    from llmserve.entrypoints.openai.chat_completion.openai_fields import template_kwargs

    assert template_kwargs(chat(reasoning_effort="high")) == {"reasoning_effort": "high"}
    assert template_kwargs(chat(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low", "x": 1})) \
        == {"reasoning_effort": "low", "x": 1}
    assert template_kwargs(chat()) is None


def _request_models():
    """Every request body model of the server (the subclasses of OpenAIRequestModel, once
    each front door's protocol is imported, and the LoRA routes' bodies) and every model
    reachable from their fields."""
    from pydantic import BaseModel

    from llmserve.entrypoints.openai.common.protocol import OpenAIRequestModel
    from llmserve.entrypoints.openai.models.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

    for name in ("openai.chat_completion", "openai.completion", "openai.responses", "openai.embeddings",
                 "openai.score", "openai.classify", "openai.tokenize", "openai.infill", "openai.models",
                 "anthropic", "ollama"):
        importlib.import_module(f"llmserve.entrypoints.{name}.protocol")
    todo, seen = [OpenAIRequestModel, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest], set()
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls in seen:
            continue
        seen.add(cls)
        for f in cls.model_fields.values():
            kinds = [f.annotation]
            while kinds:
                kind = kinds.pop()
                kinds += [a for a in typing.get_args(kind) if a is not None]
                if isinstance(kind, type) and issubclass(kind, BaseModel) and kind not in seen:
                    todo.append(kind)
    return seen


# a JSON value of the wrong type for each scalar type, as a careless client sends it
_WRONG_JSON = {int: ["5", True], float: ["0.5", True], bool: ["true", 1], str: [5, True]}


def _scalar(annotation):
    """The scalar type (int, float, bool, str) a field takes, alone or with null; else None."""
    kinds = [annotation]
    while typing.get_origin(kinds[0]) is typing.Annotated:
        kinds = [typing.get_args(kinds[0])[0]]
    if typing.get_origin(kinds[0]) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(kinds[0]) if a is not type(None)]
    if len(kinds) != 1:
        return None
    kind = kinds[0]
    while typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    return kind if kind in _WRONG_JSON else None


def test_every_request_model_takes_each_fields_json_type_only():
    """The fault as a kind, not one field (fresh-user trial: ``"max_tokens": "5"`` ran as 5):
    every model a request body is validated with, at any depth, is strict, and each scalar
    field of each refuses a string for a number or boolean, a number for a boolean and a
    number or boolean for a string (a type error at that field, a 400 naming it). A new
    request model, or a model inside one, that is not strict fails here."""
    models = _request_models()
    assert len(models) > 30
    lax = sorted(m.__name__ for m in models if m.model_config.get("strict") is not True)
    assert lax == [], f"request models that coerce JSON types: {lax}"
    checked = 0
    for model in models:
        for name, field in model.model_fields.items():
            kind = _scalar(field.annotation)
            for value in _WRONG_JSON.get(kind, ()):
                key = field.alias or name
                try:
                    model.model_validate({key: value})
                    errors = []
                except ValidationError as e:
                    errors = [err for err in e.errors() if err["loc"] == (key,)]
                assert errors and errors[0]["type"].endswith("_type"), (model.__name__, key, value, errors)
                checked += 1
    assert checked > 300
    # what still passes: an integer where a number goes, an integral number where an integer goes
    req = chat(temperature=1, max_tokens=5.0, logit_bias={"5": 1}, stream_options=None)
    assert (req.temperature, req.max_tokens, req.logit_bias) == (1.0, 5, {"5": 1.0})
    assert isinstance(req.temperature, float) and isinstance(req.max_tokens, int)
