"""Random benchmark requests: deterministic for a seed, lengths within the range, no
special tokens."""
from __future__ import annotations

import pytest

from llmserve.benchmarks.datasets import sample_random_requests, special_token_ids


@pytest.fixture
def sampler():
    """The sampler ``bench throughput`` and ``bench latency`` use."""
    return sample_random_requests


def test_same_seed_same_requests_other_seed_differs(sampler, real_tokenizer):
    a = sampler(real_tokenizer, 8, 32, 16, 0.5, 7)
    b = sampler(real_tokenizer, 8, 32, 16, 0.5, 7)
    c = sampler(real_tokenizer, 8, 32, 16, 0.5, 8)
    assert a == b
    assert a != c


def test_fixed_lengths_with_zero_ratio(sampler, real_tokenizer):
    reqs = sampler(real_tokenizer, 5, 20, 9, 0.0, 0)
    assert len(reqs) == 5
    assert all(len(ids) == 20 and out == 9 for ids, out in reqs)


def test_lengths_respect_the_range_and_vary(sampler, real_tokenizer):
    reqs = sampler(real_tokenizer, 64, 128, 128, 0.5, 0)
    in_lens = [len(ids) for ids, _ in reqs]
    out_lens = [out for _, out in reqs]
    for lens in (in_lens, out_lens):
        assert min(lens) >= 64 and max(lens) <= 192
        assert len(set(lens)) > 10  # actually spread, not fixed


def test_token_ids_are_in_vocab_and_not_special(sampler, real_tokenizer):
    special = special_token_ids(real_tokenizer)
    assert special  # SmolLM2 has special tokens to exclude
    ids = [t for p, _ in sampler(real_tokenizer, 16, 64, 4, 0.0, 3) for t in p]
    assert all(0 <= t < len(real_tokenizer) for t in ids)
    assert not special.intersection(ids)
