"""Draft verification keeps the target distribution (a statistical check on an 8-token
vocabulary), and seeded/greedy verification emits exactly what one-token-at-a-time
sampling emits."""
from __future__ import annotations

import torch

from llmserve.sample import Sampler
from llmserve.sample.metadata import SamplingMetadata, SamplingRequestState, make_generator
from llmserve.sample.rejection_sampler import accepted_prefix, sample_and_verify
from llmserve.sampling_params import SamplingParams

V = 8
P0 = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])
P1 = torch.tensor([0.05, 0.05, 0.40, 0.20, 0.10, 0.10, 0.05, 0.05])


def _state(sp, out=None, seed=None):
    return SamplingRequestState(sampling_params=sp, prompt_token_ids=[1, 2], output_token_ids=list(out or []),
                                generator=make_generator(seed) if seed is not None else None)


def test_accepted_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5]) == [4, 5, 6]  # all accepted + bonus
    assert accepted_prefix([4, 7, 6], [4, 5]) == [4, 7]  # correction at the first mismatch
    assert accepted_prefix([3], []) == [3]


def test_verified_tokens_follow_the_target_distribution():
    torch.manual_seed(0)
    n = 6000
    sp = SamplingParams(temperature=1.0, seed=None)
    logits = torch.stack([P0.log(), P1.log(), P1.log()]).repeat(n, 1)  # rows: real token, draft 1, draft 2
    entries = [(_state(sp), [0, 2], 3 * i) for i in range(n)]  # drafts: token 0, then token 2
    emitted, _ = sample_and_verify(Sampler(), logits, entries, V)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=V).float() / n
    # Each frequency within 4 standard deviations of the target probability.
    assert (first - P0).abs().le(4 * (P0 * (1 - P0) / n).sqrt()).all(), first
    accepted = sum(e[0] == 0 for e in emitted) / n  # accept draft 0 with probability p(0)
    assert abs(accepted - 0.30) < 4 * (0.3 * 0.7 / n) ** 0.5
    second = [e[1] for e in emitted if e[0] == 0]
    m = len(second)
    freq = torch.bincount(torch.tensor(second), minlength=V).float() / m
    assert (freq - P1).abs().le(4 * (P1 * (1 - P1) / m).sqrt()).all(), freq
    assert all(len(e) == 3 for e in emitted if e[:2] == [0, 2])  # both accepted: a bonus token


def _one_at_a_time(sp, logits_rows, drafts, seed):
    """Sample position by position as without speculation; stop where it leaves the drafts."""
    out = []
    for j, row in enumerate(logits_rows):
        meta = SamplingMetadata.build([_state(sp, out, seed)], V, "cpu")
        tok = int(Sampler()(row.unsqueeze(0), meta).sampled_token_ids[0])
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            break
    return out


def test_seeded_and_greedy_verification_equal_sequential_sampling():
    gen = torch.Generator().manual_seed(1)
    for trial in range(40):
        rows = torch.randn(4, V, generator=gen) * 2
        drafts = [int(rows[j].argmax()) if trial % 2 else trial % V for j in range(3)]
        for sp in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=trial),
                   SamplingParams(temperature=1.0, seed=trial, min_tokens=2, stop_token_ids=[3])):
            seed = sp.seed
            entries = [(_state(sp, seed=seed), drafts, 0)]
            emitted, _ = sample_and_verify(Sampler(), rows, entries, V)
            assert emitted[0] == _one_at_a_time(sp, rows, drafts, seed), (trial, sp)


def test_logprobs_for_each_emitted_token():
    rows = torch.stack([P0.log(), P1.log(), P0.log()])
    sp = SamplingParams(temperature=0.0, logprobs=2)
    emitted, lps = sample_and_verify(Sampler(), rows, [(_state(sp), [0, 2], 0)], V)
    assert emitted == [[0, 2, 0]]
    ids, vals, ranks = lps[0]
    assert [r[0] for r in ids] == [0, 2, 0] and ranks == [1, 1, 1]
    assert abs(vals[1][0] - float(P1.log()[2])) < 1e-5
