"""Error mapping, merging of per-prompt output streams, served model names and the
max_tokens / context checks of the serving layer."""
from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest

from llmserve.engine.exceptions import EngineDeadError, EngineGenerateError
from llmserve.entrypoints.openai.serving_engine import (
    OpenAIServing,
    error_response_from_exception,
    merge_async_iterators,
    sse,
)
from llmserve.entrypoints.openai.serving_models import BaseModelPath, ModelNotFoundError, OpenAIServingModels
from llmserve.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("exc,status,etype,param", [
    (ModelNotFoundError("x", ["m"]), 404, "NotFoundError", "model"),
    (SamplingParamsError("bad top_p", "top_p"), 400, "BadRequestError", "top_p"),
    (ValueError("bad"), 400, "BadRequestError", None),
    (NotImplementedError("later"), 501, "NotImplementedError", None),
    (EngineDeadError(), 503, "EngineDeadError", None),
    (EngineGenerateError("oops"), 500, "InternalServerError", None),
    (RuntimeError("boom"), 500, "InternalServerError", None),
])
def test_error_mapping(exc, status, etype, param):
    code, body = error_response_from_exception(exc)
    assert code == status == body.error.code
    assert body.error.type == etype and body.error.param == param and body.error.message


def test_model_not_found_lists_served_names():
    models = OpenAIServingModels([BaseModelPath("a", "/p"), BaseModelPath("b", "/p")], 2048)
    assert models.resolve(None) == "a" and models.resolve("") == "a" and models.resolve("b") == "b"
    with pytest.raises(ModelNotFoundError) as e:
        models.resolve("zzz")
    assert "zzz" in str(e.value) and "`a`" in str(e.value) and "`b`" in str(e.value)
    cards = models.show_available_models()
    assert [c.id for c in cards.data] == ["a", "b"] and all(c.max_model_len == 2048 for c in cards.data)


def test_sse_framing():
    assert sse('{"a":1}') == 'data: {"a":1}\n\n'


async def test_merge_async_iterators_tags_items_and_closes_on_error():
    closed = []

    async def gen(name, items, fail=False):
        try:
            for x in items:
                await asyncio.sleep(0)
                yield x
            if fail:
                raise ValueError("bad prompt")
            await asyncio.sleep(10)  # a slow request still running when another fails
        finally:
            closed.append(name)

    seen = []
    with pytest.raises(ValueError):
        async for i, x in merge_async_iterators(gen("a", [1, 2]), gen("b", [3], fail=True)):
            seen.append((i, x))
    assert (1, 3) in seen and set(seen) <= {(0, 1), (0, 2), (1, 3)}  # the error may overtake a's items
    assert sorted(closed) == ["a", "b"]  # the slow iterator was closed too


async def test_merge_async_iterators_all_items():
    async def gen(items):
        for x in items:
            await asyncio.sleep(0)
            yield x

    out = [item async for item in merge_async_iterators(gen([1, 2, 3]), gen([4]), gen([]))]
    assert sorted(out) == [(0, 1), (0, 2), (0, 3), (1, 4)]
    assert [x for i, x in out if i == 0] == [1, 2, 3]  # order within one iterator is kept


def _serving(max_model_len=512, defaults=None):
    engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len, vocab_size=100),
                             tokenizer=SimpleNamespace(all_special_ids=[]),
                             generation_config_defaults=defaults or {})
    models = OpenAIServingModels([BaseModelPath("m", "/p")], max_model_len)
    return OpenAIServing(engine, models)


def test_resolve_max_tokens():
    s = _serving()
    assert s.resolve_max_tokens(12, None, None, "messages") == 500  # chat: rest of the context
    assert s.resolve_max_tokens(12, None, 16, "prompt") == 16  # completions: 16
    assert s.resolve_max_tokens(500, None, 16, "prompt") == 12  # clamped to the room left
    assert s.resolve_max_tokens(12, 500, None, "prompt") == 500
    with pytest.raises(SamplingParamsError) as e:
        s.resolve_max_tokens(12, 612, None, "prompt")
    msg = str(e.value)
    assert "512" in msg and "612" in msg and "624" in msg and e.value.param == "max_tokens"
    for n in (512, 600):
        with pytest.raises(SamplingParamsError) as e:
            s.resolve_max_tokens(n, 5, None, "prompt")
        assert "512" in str(e.value) and str(n) in str(e.value) and not re.search(r"-\d", str(e.value))
    with pytest.raises(SamplingParamsError):
        s.resolve_max_tokens(0, None, None, "prompt")
    assert _serving(defaults={"max_new_tokens": 7}).resolve_max_tokens(12, None, None, "messages") == 7


def test_check_token_ids_and_zero_token_requests():
    s = _serving()
    assert s.check_token_ids([0, 99], "prompt") == [0, 99]
    for bad in ([100], [-1], [True]):
        with pytest.raises(SamplingParamsError) as e:
            s.check_token_ids(bad, "prompt")
        assert e.value.param == "prompt"
    sp = SamplingParams(max_tokens=0)
    run = s.engine_params(sp)
    assert run.max_tokens == 1 and sp.max_tokens == 0  # the request's own params are untouched
    assert s.engine_params(SamplingParams(max_tokens=3)).max_tokens == 3
