"""The model's generation_config.json takes effect offline: its default output budget
(max_new_tokens) and its extra EOS ids, through ``LLM`` in-process and with the engine in
its own process (where the request's SamplingParams cross the process boundary)."""
from __future__ import annotations

import json

import pytest

from llmserve import LLM, SamplingParams

REF_TOKENS = 24
BUDGET = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory, save_tiny_model_fn):
    """(model dir, prompt ids, greedy reference continuation, extra EOS id, its position k).

    The generation config sets a greedy default (temperature 0), a budget of BUDGET tokens
    and, next to the tokenizer's EOS (2), an extra EOS: the token the greedy continuation
    produces first (k = 0; this random model repeats one token)."""
    path = tmp_path_factory.mktemp("genconf")
    save_tiny_model_fn("llama", str(path), seed=3)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    prompt = [100 + 37 * i for i in range(12)]
    llm = _llm(str(path), multiprocess=False)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=REF_TOKENS, ignore_eos=True)
        ref = list(llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    finally:
        llm.shutdown()
    k = 0
    assert ref[k] != 2 and len(ref) == REF_TOKENS
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, ref[k]], "max_new_tokens": BUDGET, "temperature": 0.0}))
    return str(path), prompt, ref, ref[k], k


def _llm(path: str, multiprocess: bool, **kw) -> LLM:
    return LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=multiprocess,
               kv_cache_memory="32MiB", max_num_batched_tokens=64, max_model_len=128, **kw)


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inprocess", "multiprocess"])
def test_generation_config_budget_and_extra_eos_take_effect_offline(model, multiprocess):
    path, prompt, ref, eos, k = model
    llm = _llm(path, multiprocess)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.max_tokens, defaults.temperature) == (BUDGET, 0.0)
        # no sampling_params: the model's defaults; greedy stops at the extra EOS
        out = llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == ref[:k + 1]
        assert (out.finish_reason, out.stop_reason) == ("stop", eos)
        # the user's own params with max_tokens unset: the default budget still applies and
        # the extra EOS still stops, here ignored (ignore_eos) so the budget ends it
        sp = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == ref[:BUDGET] and out.finish_reason == "length"
        sp = SamplingParams(temperature=0.0, max_tokens=REF_TOKENS)
        out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == ref[:k + 1] and out.stop_reason == eos
    finally:
        llm.shutdown()


def test_generation_config_vllm_ignores_the_defaults_but_keeps_the_eos(model):
    path, prompt, ref, eos, k = model
    llm = _llm(path, multiprocess=False, generation_config="vllm")
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
        sp = SamplingParams(temperature=0.0, max_tokens=None)
        out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == ref[:k + 1] and out.stop_reason == eos
    finally:
        llm.shutdown()
