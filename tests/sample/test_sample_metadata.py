"""SamplingMetadata, make_generator, validate_token_ids and the Sampler's input checks."""
import pytest
import torch

from llmserve.sample import (SamplingMetadata, SamplingRequestState, Sampler, make_generator,
                             validate_token_ids)
from llmserve.sampling_params import SamplingParams, SamplingParamsError


def _state(sp, output=None, eos=None):
    return SamplingRequestState(sp, [1, 2], output or [], None, eos)


def test_build_groups_rows_by_sampling_path():
    sps = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
           SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9),
           SamplingParams(temperature=1.0, top_k=40, logprobs=2),
           SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=0.5, logprobs=-1)]
    meta = SamplingMetadata.build([_state(sp) for sp in sps], 1000, "cpu")
    assert not meta.all_greedy
    assert meta.greedy_rows.tolist() == [0, 1]
    assert meta.full_group.rows.tolist() == [2, 5]
    assert meta.truncated_group.rows.tolist() == [3, 4]
    assert meta.truncated_group.initial_candidates == 80  # room for ties past top_k 40
    assert meta.max_num_logprobs == 1000 and meta.logprobs_rows.tolist() == [4, 5]
    assert meta.penalty_rows == [5] and meta.needs_processing
    assert meta.full_group.min_p_value is None  # rows 2 and 5 differ
    assert torch.allclose(meta.full_group.inv_temperature.flatten(), torch.tensor([1 / 0.8, 1.0]))


def test_build_all_greedy_and_min_tokens_rows():
    sps = [SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(temperature=0.0, min_tokens=2)]
    meta = SamplingMetadata.build([_state(sps[0], output=[5], eos=0), _state(sps[1], output=[5, 6], eos=0)],
                                  100, "cpu")
    assert meta.all_greedy and meta.full_group is None and meta.truncated_group is None
    assert meta.min_tokens_rows == [0]  # row 1 already has 2 tokens


def test_make_generator_is_reproducible():
    a, b = make_generator(3, "cpu"), make_generator(3, "cpu")
    assert [a.uniform(p) for p in range(4)] == [b.uniform(p) for p in range(4)]
    assert [make_generator(4).uniform(p) for p in range(4)] != [a.uniform(p) for p in range(4)]
    us = [a.uniform(p) for p in range(20000)]
    assert all(0.0 <= u < 1.0 for u in us) and len(set(us)) > 19900
    assert abs(sum(us) / len(us) - 0.5) < 0.01  # uniform: mean 1/2 (sd of the mean ~0.002)


def test_validate_token_ids_names_the_field():
    validate_token_ids(SamplingParams(allowed_token_ids=[0, 99], logit_bias={5: 1.0}), 100)
    with pytest.raises(SamplingParamsError) as e:
        validate_token_ids(SamplingParams(allowed_token_ids=[100]), 100)
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(SamplingParamsError) as e:
        validate_token_ids(SamplingParams(logit_bias={-1: 1.0}), 100)
    assert e.value.param == "logit_bias"


def test_sampler_checks_logits_shape_and_drops_padding():
    meta = SamplingMetadata.build([_state(SamplingParams(temperature=0.0))], 100, "cpu")
    with pytest.raises(ValueError):
        Sampler()(torch.randn(2, 100), meta)
    with pytest.raises(ValueError):
        Sampler()(torch.randn(1, 50), meta)
    x = torch.randn(1, 128)
    x[0, 120] = 100.0  # a padded column beyond the vocabulary is never sampled
    assert Sampler()(x, meta).sampled_token_ids.item() == int(x[0, :100].argmax())
