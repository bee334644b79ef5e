"""``logit_bias`` in every path (issue 10): values clamped to [-100, 100] as vLLM does,
keys that are not token ids named (every one) with the vocabulary size. The online paths
are pinned in tests/e2e/test_trial_fixes.py; these are SamplingParams, the
InputProcessor and the offline ``LLM`` on a tiny checkpoint."""
from __future__ import annotations

import math

import msgspec
import pytest

from llmserve import SamplingParams
from llmserve.sampling_params import SamplingParamsError


def test_values_are_clamped_and_keys_made_ints():
    sp = SamplingParams(logit_bias={"5": 1e6, 6: -1e9, 7: math.inf, "8": 3.5})
    assert sp.logit_bias == {5: 100.0, 6: -100.0, 7: 100.0, 8: 3.5}
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert back.logit_bias == {5: 100.0, 6: -100.0, 7: 100.0, 8: 3.5}
    assert sp.clone().logit_bias == sp.logit_bias


def test_values_that_are_not_numbers_name_every_key():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(logit_bias={1: "x", 2: 1.0, 3: math.nan})
    assert e.value.param == "logit_bias"
    assert str(e.value) == "logit_bias values must be numbers; bad values at keys: 1, 3."


def test_keys_that_are_not_token_ids_are_named_with_the_vocabulary(tiny_llm):
    llm = tiny_llm
    with pytest.raises(SamplingParamsError) as e:
        llm.generate("Hi", SamplingParams(max_tokens=1, logit_bias={"abc": 1, "5": 1, -3: 2, 60000: 1, "b c": 2}),
                     use_tqdm=False)
    assert e.value.param == "logit_bias"
    assert str(e.value) == ("logit_bias: token ids out of vocabulary: 'abc', -3, 60000, 'b c' (the vocabulary "
                            "has 49152 tokens, valid ids are 0..49151).")


def test_offline_generation_clamps(tiny_llm):
    """Of two allowed tokens, greedy picks the better W; a bias of 1e6 on the other (L)
    against 100 on W is a tie of +100 each once clamped, so W still wins (unclamped, L
    would); likewise -1e6 on W against -100 on L."""
    llm = tiny_llm
    a, b = 1000, 2000
    base = dict(temperature=0.0, max_tokens=1, allowed_token_ids=[a, b])
    w = llm.generate("Hi", SamplingParams(**base), use_tqdm=False)[0].outputs[0].token_ids[0]
    loser = b if w == a else a
    for bias in ({loser: 1e6, w: 100}, {w: -1e6, loser: -100}, {str(loser): 1e9, str(w): 100.0}):
        out = llm.generate("Hi", SamplingParams(**base, logit_bias=bias), use_tqdm=False)
        assert out[0].outputs[0].token_ids == [w], bias
    # the clamp does not hide a real bias: +100 on the loser alone wins
    out = llm.generate("Hi", SamplingParams(**base, logit_bias={loser: 100}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [loser]


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, save_tiny_model_fn):
    from llmserve import LLM

    path = str(tmp_path_factory.mktemp("logit_bias"))
    save_tiny_model_fn("llama", path, seed=3)
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="32MiB", max_num_batched_tokens=64, block_size=16)
    yield llm
    llm.shutdown()
