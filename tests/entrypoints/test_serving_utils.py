"""Error mapping, starting and merging per-prompt output streams, served model names,
the server's own budget policy (completions' default 16) and 0-token requests."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from llmserve.engine.exceptions import EngineDeadError, EngineGenerateError
from llmserve.entrypoints.openai.common.errors import error_response_from_exception
from llmserve.entrypoints.openai.common.serving import (
    GenerateBaseServing,
    default_sampling_params,
    first_items,
    merge_async_iterators,
    renamed_param,
    sse,
)
from llmserve.entrypoints.openai.completion.serving import OpenAIServingCompletion
from llmserve.entrypoints.openai.models.serving import BaseModelPath, ModelNotFoundError, OpenAIServingModels
from llmserve.entrypoints.openai.tokenize.serving import OpenAIServingTokenization
from llmserve.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("exc,status,etype,param", [
    (ModelNotFoundError("x", ["m"]), 404, "NotFoundError", "model"),
    (SamplingParamsError("bad top_p", "top_p"), 400, "BadRequestError", "top_p"),
    (ValueError("bad"), 400, "BadRequestError", None),
    (NotImplementedError("later"), 400, "BadRequestError", None),  # never 5xx: clients retry those
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


def _engine(max_model_len=512, defaults=None):
    return SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len, vocab_size=100),
                           tokenizer=SimpleNamespace(all_special_ids=[]),
                           generation_config_defaults=defaults or {})


def _models(max_model_len=512):
    return OpenAIServingModels([BaseModelPath("m", "/p")], max_model_len)


def test_completion_default_budget():
    """OpenAI's legacy 16 (or the model's smaller budget), clamped to the room left; a
    prompt with no room keeps 16 so that the engine reports the context error."""
    s = OpenAIServingCompletion(_engine(), _models(), renderer=None)
    assert s.default_max_tokens(12) == 16
    assert s.default_max_tokens(500) == 12
    assert s.default_max_tokens(512) == 16 and s.default_max_tokens(600) == 16
    small = OpenAIServingCompletion(_engine(defaults={"max_new_tokens": 7}), _models(), renderer=None)
    assert small.default_max_tokens(12) == 7 and small.default_sampling_params == {"max_tokens": 7}


def test_default_sampling_params_prefers_the_model_config():
    engine = _engine(defaults={"max_new_tokens": 3, "temperature": 0.5})
    assert default_sampling_params(engine) == {"max_tokens": 3, "temperature": 0.5}
    engine.model_config.get_diff_sampling_param = lambda: {"max_tokens": 9, "top_k": 4}
    assert default_sampling_params(engine) == {"max_tokens": 9, "top_k": 4}


async def test_first_items_cancels_and_closes_the_others_on_a_bad_prompt():
    """A prompt the engine rejects (raised from its first __anext__) fails the request
    before any output is used; the running one is cancelled and closed (aborted)."""
    events = []

    async def good():
        try:
            await asyncio.sleep(10)
            yield "never"
        finally:
            events.append("good closed")

    async def bad():
        raise SamplingParamsError("too long", "prompt")
        yield  # pragma: no cover

    s = GenerateBaseServing(_engine(), _models(), renderer=None)
    with pytest.raises(SamplingParamsError) as e:
        await s.start_generation([good(), bad()], {"prompt": "messages"})
    assert e.value.param == "messages" and events == ["good closed"]

    async def items(*xs):
        for x in xs:
            yield x

    assert await first_items([items(1, 2), items(), items(3)]) == [1, None, 3]


def test_check_token_ids_and_zero_token_requests():
    s = OpenAIServingTokenization(_engine(), _models(), renderer=None)
    assert s.check_token_ids([0, 99], "prompt") == [0, 99]
    for bad in ([100], [-1], [True]):
        with pytest.raises(SamplingParamsError) as e:
            s.check_token_ids(bad, "prompt")
        assert e.value.param == "prompt"
    sp = SamplingParams(max_tokens=0)
    # a 0-token request reaches the engine as it is (the engine outputs no token for it)
    assert GenerateBaseServing.engine_params(sp).max_tokens == 0
    assert GenerateBaseServing.engine_params(SamplingParams(max_tokens=3)).max_tokens == 3


def _context_length_error() -> SamplingParamsError:
    """The engine's own context-length 400 (strict mode), which names ``max_tokens``."""
    from llmserve.engine.input_processor import InputProcessor

    fake = SimpleNamespace(model_config=SimpleNamespace(max_model_len=2048), strict_max_tokens=True,
                           default_max_tokens=None)
    with pytest.raises(SamplingParamsError) as info:
        InputProcessor._max_tokens(fake, 10, 10**12)
    assert info.value.param == "max_tokens" and "of max_tokens." in str(info.value)
    return info.value


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_output_tokens", "max_tokens"])
def test_context_length_400_names_the_field_sent(field):
    # param was renamed but the message said "reduce ... max_tokens" for
    # max_completion_tokens (chat) and max_output_tokens (Responses)
    async def gen():
        raise _context_length_error()
        yield  # pragma: no cover

    names = {"prompt": "messages", "max_tokens": field}
    with pytest.raises(SamplingParamsError) as info:
        asyncio.run(GenerateBaseServing.start_generation(None, [gen()], names))
    e = info.value
    assert e.param == field and str(e).endswith(f"Please reduce the length of the prompt or of {field}.")
    assert "maximum context length is 2048 tokens" in str(e)
    if field != "max_tokens":
        assert "max_tokens" not in str(e).replace(field, "")


def test_renamed_param_keeps_prose_words_and_other_fields():
    e = renamed_param(SamplingParamsError("The prompt cannot be empty.", "prompt"), {"prompt": "messages"})
    assert (str(e), e.param) == ("The prompt cannot be empty.", "messages")
    e = renamed_param(SamplingParamsError("prompt: too long", "prompt"), {"prompt": "input"})
    assert str(e) == "input: too long"
    e = renamed_param(SamplingParamsError("`max_tokens` must be >= 1 (max_tokens_x stays)", "max_tokens"),
                      {"max_tokens": "max_output_tokens"})
    assert str(e) == "`max_output_tokens` must be >= 1 (max_tokens_x stays)"
    same = SamplingParamsError("n must be 1", "n")
    assert renamed_param(same, {"max_tokens": "max_output_tokens"}) is same


def test_context_char_limit_names_the_responses_field():
    """The character guard's overflow on /v1/responses (found with Codex): the message and
    param both say `input`, and it stays a context overflow."""
    from llmserve.entrypoints.openai.common.limits import PromptCharLimit
    from llmserve.sampling_params import ContextLengthExceededError
    with pytest.raises(ContextLengthExceededError) as info:
        PromptCharLimit(16, 4, True).check(["x" * 300_000], "messages")
    e = renamed_param(info.value, {"messages": "input"})
    assert isinstance(e, ContextLengthExceededError) and e.param == "input"
    assert "`input` holds 300000 characters" in str(e) and str(e).endswith("reduce the length of `input`.")
    assert "messages" not in str(e)
    sub = SamplingParamsError("structured_outputs.json is nested too deeply.", "structured_outputs")
    assert str(renamed_param(sub, {"structured_outputs": "tools"})) == str(sub)
