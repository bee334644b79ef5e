"""InputProcessor: the one owner of request validation and derived fields (context checks,
max_tokens when unset, stop/EOS ids, logprobs limits, vocabulary checks), reading the
generation-config defaults that create_engine_config() computed once into ModelConfig."""
from __future__ import annotations

import json

import pytest

from llmserve import EngineArgs, SamplingParams
from llmserve.engine.input_processor import InputProcessor
from llmserve.sampling_params import SamplingParamsError

MAX_LEN = 64
EXTRA_EOS = 7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, save_tiny_model_fn):
    """A tiny Llama whose generation_config.json sets a default budget, sampling defaults
    and an extra EOS id next to the tokenizer's (SmolLM2's, id 2)."""
    path = tmp_path_factory.mktemp("ip_model")
    save_tiny_model_fn("llama", str(path))
    (path / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": 5, "temperature": 0.5, "top_k": 20, "eos_token_id": [2, EXTRA_EOS],
         "do_sample": True}))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer("SmolLM2-135M-Instruct")


def _config(model_dir, **kw):
    args = dict(model=model_dir, tokenizer="SmolLM2-135M-Instruct", max_model_len=MAX_LEN, device="cpu")
    return EngineArgs(**{**args, **kw}).create_engine_config()


@pytest.fixture(scope="module")
def config(model_dir):
    return _config(model_dir)


def _proc(config, tokenizer, strict=False):
    return InputProcessor(config.model_config, tokenizer, strict_max_tokens=strict,
                          cache_config=config.cache_config)


def test_generation_defaults_are_computed_once_into_the_model_config(config, model_dir, tmp_path):
    mc = config.model_config
    assert mc.get_diff_sampling_param() == {"temperature": 0.5, "top_k": 20, "max_tokens": 5}
    assert mc.extra_eos_token_ids == (2, EXTRA_EOS)
    # a copy each call: callers cannot change the config
    mc.get_diff_sampling_param()["temperature"] = 9
    assert mc.get_diff_sampling_param()["temperature"] == 0.5
    over = _config(model_dir, override_generation_config={"temperature": 0.1, "max_new_tokens": 9})
    assert over.model_config.get_diff_sampling_param() == {"temperature": 0.1, "top_k": 20, "max_tokens": 9}
    vllm = _config(model_dir, generation_config="vllm").model_config
    assert vllm.get_diff_sampling_param() == {} and vllm.extra_eos_token_ids == (2, EXTRA_EOS)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.8, "eos_token_id": 11}))
    other = _config(model_dir, generation_config=str(tmp_path)).model_config
    assert other.get_diff_sampling_param() == {"top_p": 0.8} and other.extra_eos_token_ids == (11,)
    with pytest.raises(ValueError, match="generation_config"):
        _config(model_dir, generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="generation_config.*temperature"):
        _config(model_dir, override_generation_config={"temperature": -1})


def test_max_tokens_when_unset_is_the_smaller_of_room_and_default_budget(config, tokenizer):
    proc = _proc(config, tokenizer)
    req, _ = proc.process_inputs("a", [5] * 10, SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == 5
    req, _ = proc.process_inputs("b", [5] * (MAX_LEN - 3), SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == 3
    req, _ = proc.process_inputs("c", [5] * 10, SamplingParams(max_tokens=40))
    assert req.sampling_params.max_tokens == 40
    plain = InputProcessor(_config_vllm(config), tokenizer)
    req, _ = plain.process_inputs("d", [5] * 10, SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == MAX_LEN - 10


def _config_vllm(config):
    import dataclasses

    return dataclasses.replace(config.model_config, diff_sampling_param={})


def test_strict_mode_refuses_what_offline_caps(config, tokenizer):
    sp = SamplingParams(max_tokens=MAX_LEN - 10)
    with pytest.raises(SamplingParamsError, match="maximum context length is 64") as e:
        _proc(config, tokenizer, strict=True).process_inputs("a", [5] * 11, sp)
    assert e.value.param == "max_tokens"
    req, _ = _proc(config, tokenizer).process_inputs("a", [5] * 11, sp)  # offline: stops at the limit
    assert req.sampling_params.max_tokens == MAX_LEN - 10


@pytest.mark.parametrize("prompt,match", [([], "cannot be empty"), ([5, 10 ** 6], "out of vocabulary"),
                                         ([5, -1], "out of vocabulary"), ([5] * MAX_LEN, "no room"),
                                         ("", "cannot be empty")])
def test_bad_prompts_name_the_prompt(config, tokenizer, prompt, match):
    with pytest.raises(SamplingParamsError, match=match) as e:
        _proc(config, tokenizer).process_inputs("a", prompt, SamplingParams())
    assert e.value.param == "prompt"
    if match == "out of vocabulary":  # the position, not the client's value
        assert "position 1" in str(e.value) and str(prompt[1]) not in str(e.value)


def test_a_field_set_to_a_bad_type_after_construction_names_the_field(config, tokenizer):
    """SamplingParams validates at construction; a float logprobs set afterwards reached
    the sampler's topk (a TypeError in the engine step). The InputProcessor checks again."""
    sp = SamplingParams(logprobs=2)
    sp.logprobs = 1.5
    with pytest.raises(SamplingParamsError) as e:
        _proc(config, tokenizer).process_inputs("a", [5, 6], sp)
    assert e.value.param == "logprobs"


def test_stop_ids_hold_the_generation_configs_extra_eos(config, tokenizer):
    proc = _proc(config, tokenizer)
    user = SamplingParams(stop_token_ids=[40])
    req, _ = proc.process_inputs("a", [5, 6], user)
    assert req.sampling_params.all_stop_token_ids == {40, EXTRA_EOS}
    assert req.eos_token_id == tokenizer.eos_token_id == 2
    assert user.all_stop_token_ids == {40}  # the caller's params are not changed
    req, _ = proc.process_inputs("b", [5, 6], SamplingParams(ignore_eos=True, stop_token_ids=[40]))
    assert req.sampling_params.all_stop_token_ids == {40}


def test_logprobs_limits(model_dir, config, tokenizer):
    proc = _proc(config, tokenizer)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(SamplingParamsError, match="greater than max allowed: 20") as e:
            proc.process_inputs("a", [5, 6], SamplingParams(**{name: 21}))
        assert e.value.param == name
        with pytest.raises(SamplingParamsError) as e:
            proc.process_inputs("a", [5, 6], SamplingParams(**{name: -1}))  # the whole vocabulary
        assert e.value.param == name
    proc.process_inputs("a", [5, 6], SamplingParams(logprobs=20, prompt_logprobs=20))
    unlimited = _config(model_dir, max_logprobs=-1)
    _proc(unlimited, tokenizer).process_inputs("a", [5, 6], SamplingParams(logprobs=-1))
    fast = _config(model_dir, kv_sharing_fast_prefill=True)
    with pytest.raises(SamplingParamsError, match="kv_sharing_fast_prefill") as e:
        _proc(fast, tokenizer).process_inputs("a", [5, 6], SamplingParams(prompt_logprobs=1))
    assert e.value.param == "prompt_logprobs"
    _proc(fast, tokenizer).process_inputs("a", [5, 6], SamplingParams(logprobs=1))


def test_vocabulary_checks_and_bad_words(config, tokenizer):
    proc = _proc(config, tokenizer)
    for name, value in (("allowed_token_ids", [1, 49152]), ("logit_bias", {49152: 1.0})):
        with pytest.raises(SamplingParamsError, match="out of vocabulary") as e:
            proc.process_inputs("a", [5, 6], SamplingParams(**{name: value}))
        assert e.value.param == name
    req, _ = proc.process_inputs("a", "hello", SamplingParams(bad_words=["world"]))
    ids = req.sampling_params.bad_words_token_ids
    assert tokenizer.encode(" world", add_special_tokens=False) in ids
    with pytest.raises(SamplingParamsError) as e:
        proc.process_inputs("a", "hello", SamplingParams(bad_words=["\ud800"]))
    assert e.value.param == "bad_words"


def test_every_token_id_field_names_each_bad_id_and_the_vocabulary(config, tokenizer):
    # issue 10: stop_token_ids is checked like the other token-id fields; the error lists
    # every bad id and the vocabulary size.
    proc = _proc(config, tokenizer)
    with pytest.raises(SamplingParamsError) as e:
        proc.process_inputs("a", [5, 6], SamplingParams(stop_token_ids=[-1, 3, 49152]))
    assert e.value.param == "stop_token_ids"
    assert str(e.value) == ("stop_token_ids: token ids out of vocabulary: -1, 49152 (the vocabulary has "
                            "49152 tokens, valid ids are 0..49151).")
    with pytest.raises(SamplingParamsError) as e:
        proc.process_inputs("a", [5, 6], SamplingParams(logit_bias={-5: 1.0, 7: 1.0, 60000: 2.0, 49152: 0.5}))
    assert e.value.param == "logit_bias"
    assert "-5, 60000, 49152 (the vocabulary has 49152 tokens" in str(e.value)
    many = list(range(49152, 49152 + 300))
    with pytest.raises(SamplingParamsError) as e:
        proc.process_inputs("a", [5, 6], SamplingParams(allowed_token_ids=many))
    assert str(e.value).endswith(", ... (300 in all) (the vocabulary has 49152 tokens, valid ids are 0..49151).")


def test_min_tokens_above_the_room_is_clamped_when_max_tokens_is_unset(config, tokenizer):
    plain = InputProcessor(_config_vllm(config), tokenizer, strict_max_tokens=True)
    req, _ = plain.process_inputs("a", [5] * (MAX_LEN - 4), SamplingParams(max_tokens=None, min_tokens=10))
    assert (req.sampling_params.max_tokens, req.sampling_params.min_tokens) == (4, 4)
    req, _ = plain.process_inputs("b", [5] * 10, SamplingParams(max_tokens=None, min_tokens=10))
    assert (req.sampling_params.max_tokens, req.sampling_params.min_tokens) == (MAX_LEN - 10, 10)
    with pytest.raises(SamplingParamsError) as e:  # max_tokens given: the context check stands
        plain.process_inputs("c", [5] * (MAX_LEN - 4), SamplingParams(max_tokens=10, min_tokens=10))
    assert e.value.param == "max_tokens"


def test_priority_needs_the_priority_policy_and_truncation(config, model_dir, tokenizer):
    proc = InputProcessor(config.model_config, tokenizer, scheduler_config=config.scheduler_config)
    with pytest.raises(SamplingParamsError, match="priority scheduling is not enabled") as e:
        proc.process_inputs("a", [5, 6], SamplingParams(), priority=3)
    assert e.value.param == "priority"
    prio = _config(model_dir, scheduling_policy="priority")
    req, _ = InputProcessor(prio.model_config, tokenizer, scheduler_config=prio.scheduler_config).process_inputs(
        "a", [5, 6], SamplingParams(), priority=3)
    assert req.priority == 3
    # truncate_prompt_tokens (vLLM): the last N prompt tokens; -1 = max_model_len
    req, text = proc.process_inputs("t", {"prompt_token_ids": [1, 2, 3, 4, 5], "prompt": "x"},
                                    SamplingParams(truncate_prompt_tokens=2))
    assert (req.prompt_token_ids, text) == ([4, 5], None)
    req, text = proc.process_inputs("t", {"prompt_token_ids": [1, 2, 3], "prompt": "x"},
                                    SamplingParams(truncate_prompt_tokens=-1))
    assert (req.prompt_token_ids, text) == ([1, 2, 3], "x")
    with pytest.raises(SamplingParamsError, match=r"truncate_prompt_tokens value \(65\) is greater than "
                                                  r"max_model_len \(64\)"):
        proc.process_inputs("t", [1, 2], SamplingParams(truncate_prompt_tokens=MAX_LEN + 1))
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(truncate_prompt_tokens=0)
    assert e.value.param == "truncate_prompt_tokens"
