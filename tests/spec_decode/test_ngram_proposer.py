"""Prompt-lookup drafting, the adaptive draft length, SpeculativeConfig and the KV trim."""
from __future__ import annotations

import argparse
import random

import pytest

from llmserve.spec_decode.adaptive import AcceptanceTracker, best_draft_len, expected_tokens
from llmserve.spec_decode.config import SpeculativeConfig, make_speculative_config
from llmserve.spec_decode.ngram_proposer import NgramIndex


def _scan(tokens, n_min, n_max, k):
    """Reference: the latest earlier occurrence of the last n tokens, longest n first."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                ext = list(tokens)
                while len(ext) < start + n + k:  # the text repeats past its end
                    ext.append(ext[len(ext) - (L - start - n)])
                return ext[start + n:start + n + k]
    return []


def test_index_matches_a_scan_as_tokens_grow():
    rng = random.Random(0)
    for n_min, n_max in ((1, 1), (2, 4), (3, 3)):
        toks = [rng.randrange(6) for _ in range(8)]
        ix = NgramIndex(n_min, n_max)
        for _ in range(120):
            assert ix.propose(toks, 4) == _scan(toks, n_min, n_max, 4), (n_min, n_max, toks)
            toks.append(rng.randrange(6))


def test_latest_occurrence_and_no_self_match():
    ix = NgramIndex(2, 3)
    assert ix.propose([1, 2, 9, 1, 2, 8, 1, 2], 2) == [8, 1]  # the later "1 2" wins
    assert NgramIndex(2, 2).propose([5, 6, 7, 8], 3) == []  # the suffix alone is no match
    assert ix.propose([1, 2], 3) == []  # the sequence shrank: index rebuilt, no stale hit
    assert NgramIndex(2, 2).propose([4, 7, 7, 7], 3) == [7, 7, 7]  # a 1-token loop drafts k
    assert NgramIndex(2, 3).propose([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]


def test_expected_tokens_and_best_len():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert best_draft_len(0.95, 5, cost=0.1) == 5
    assert best_draft_len(0.05, 5, cost=0.1) == 0  # drafting does not pay
    assert 0 < best_draft_len(0.5, 5, cost=0.1) < 5


def test_tracker_backs_off_and_recovers():
    t = AcceptanceTracker()
    assert t.draft_len(5) > 0
    for _ in range(6):
        t.observe(3, 0)
    assert t.draft_len(5) == 0  # acceptance collapsed: stop drafting
    skipped = 0
    while t.draft_len(5) == 0:
        skipped += 1
    assert skipped == 4  # the first back-off, then a new try from the prior
    for _ in range(6):
        t.observe(5, 5)
    assert t.draft_len(5) == 5


def test_config_validation_and_defaults():
    c = make_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert make_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig(num_speculative_tokens=2, model="[ngram]").method == "ngram"
    bad = [({"method": "eagle", "num_speculative_tokens": 3}, "method"),
           ({"method": "ngram"}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min"),
           ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
           ({"model": "/some/draft", "num_speculative_tokens": 2}, "draft model"),
           ("{not json", "not valid JSON")]
    for value, word in bad:
        with pytest.raises(ValueError, match=word):
            make_speculative_config(value)


def test_cli_flag_builds_the_config():
    from llmserve.engine_args import EngineArgs
    from llmserve.entrypoints.openai.vllm_compat_args import COMPAT_FLAGS

    assert "--speculative-config" not in COMPAT_FLAGS
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                              '"prompt_lookup_min": 2, "prompt_lookup_max": 3}'])
    ea = EngineArgs.from_cli_args(args)
    assert ea.speculative_config == SpeculativeConfig(num_speculative_tokens=4, method="ngram",
                                                      prompt_lookup_min=2, prompt_lookup_max=3)


def test_kv_trim_frees_only_blocks_past_the_kept_tokens():
    from llmserve.core.kv_cache_manager import KVCacheManager
    from llmserve.core.request import Request
    from llmserve.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = Request("r", list(range(6)), SamplingParams(max_tokens=8), eos_token_id=None)
    kv.allocate_slots(req, 11)  # 3 blocks
    free = kv.pool.get_num_free_blocks()
    kv.trim(req, 7)  # 7 tokens need 2 blocks
    assert len(kv.get_block_ids("r")) == 2 and kv.pool.get_num_free_blocks() == free + 1
    kv.trim(req, 8)
    assert len(kv.get_block_ids("r")) == 2
