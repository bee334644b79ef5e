"""SamplingParams across the process boundary: an EngineCoreRequest encoded and decoded by
engine/serial.py keeps every field, the derived ones included (the engine process's
decoder calls __post_init__ again; it must neither re-validate nor rebuild them)."""
from __future__ import annotations

import dataclasses

import pytest

from llmserve.engine.messages import EngineCoreRequest
from llmserve.engine.serial import MsgpackDecoder, MsgpackEncoder
from llmserve.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError


def _roundtrip(params: SamplingParams) -> SamplingParams:
    req = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=params,
                            eos_token_id=2, arrival_time=1.5, priority=3)
    back = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(req))
    assert (back.request_id, back.prompt_token_ids, back.eos_token_id, back.arrival_time, back.priority) == \
        ("r", [1, 2], 2, 1.5, 3)
    return back.sampling_params


def _every_field_set() -> SamplingParams:
    sp = SamplingParams(n=2, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                        temperature=0.7, top_p=0.9, top_k=30, min_p=0.05, seed=1234, stop=["\n\n", "END"],
                        stop_token_ids=[40, 41], ignore_eos=True, max_tokens=33, min_tokens=3, logprobs=4,
                        prompt_logprobs=2, detokenize=False, skip_special_tokens=False,
                        spaces_between_special_tokens=False, include_stop_str_in_output=True,
                        logit_bias={5: 2.5, 6: -100.0}, allowed_token_ids=[5, 6, 7], bad_words=["foo"],
                        output_kind=RequestOutputKind.DELTA)
    # what the InputProcessor derives
    sp.all_stop_token_ids |= {7, 99}
    sp.bad_words_token_ids = [[11, 12], [13]]
    return sp


def test_every_field_survives_the_round_trip():
    sp = _every_field_set()
    back = _roundtrip(sp)
    for f in dataclasses.fields(SamplingParams):
        assert getattr(back, f.name) == getattr(sp, f.name), f.name
    assert back.all_stop_token_ids == {40, 41, 7, 99}  # the derived extra EOS ids are kept
    assert isinstance(back.all_stop_token_ids, set) and isinstance(back.output_kind, RequestOutputKind)
    assert isinstance(next(iter(back.logit_bias)), int)


def test_defaults_survive_the_round_trip():
    sp = SamplingParams()
    back = _roundtrip(sp)
    assert [getattr(back, f.name) for f in dataclasses.fields(SamplingParams)] == \
        [getattr(sp, f.name) for f in dataclasses.fields(SamplingParams)]


def test_decoding_does_not_re_validate_but_new_params_still_do():
    """Values the front end set after validation (max_tokens resolved by the
    InputProcessor) arrive as they were; building or replacing params still validates."""
    sp = SamplingParams(max_tokens=4, min_tokens=2)
    sp.max_tokens = 1  # as a resolved budget may end below min_tokens: not the engine's call
    assert _roundtrip(sp).max_tokens == 1
    with pytest.raises(SamplingParamsError):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError):
        dataclasses.replace(SamplingParams(), top_p=0.0)


def test_clone_keeps_derived_stop_ids():
    sp = SamplingParams(stop_token_ids=[3])
    sp.all_stop_token_ids.add(9)
    assert sp.clone().all_stop_token_ids == {3, 9}


@pytest.mark.parametrize("field,value", [
    ("logprobs", 1.5), ("logprobs", "3"), ("prompt_logprobs", 1.5), ("max_tokens", 2.5), ("min_tokens", 1.5),
    ("top_k", 1.5), ("truncate_prompt_tokens", 1.5), ("n", True), ("n", "2"), ("seed", True), ("seed", 1.5),
    ("stop", 5), ("stop", ["a", 1]), ("stop_token_ids", 5), ("bad_words", [1]), ("bad_words", 7),
    ("allowed_token_ids", 5), ("temperature", float("inf")), ("repetition_penalty", float("inf")),
    ("temperature", "0.5"), ("output_kind", 7), ("min_tokens", None),
])
def test_a_value_of_the_wrong_type_is_a_value_error_naming_the_field(field, value):
    """vLLM's SamplingParams fields and types: a float logprobs reached the sampler's topk
    and failed the engine step, stop=5 was Python's 'not iterable' TypeError; each is now
    a ValueError naming the field, without the value."""
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and repr(value) not in str(e.value).replace(field, "")


def test_numpy_numbers_and_a_lone_bad_word_are_taken():
    np = pytest.importorskip("numpy")
    sp = SamplingParams(seed=np.int64(3), max_tokens=np.int32(4), temperature=np.float32(0.5), bad_words="foo")
    assert (sp.seed, sp.max_tokens, sp.temperature, sp.bad_words) == (3, 4, 0.5, ["foo"])
    assert type(sp.seed) is int and type(sp.temperature) is float
