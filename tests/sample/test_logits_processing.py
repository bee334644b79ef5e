"""Logits processing before sampling: allowed_token_ids, bad_words, min_tokens,
logit_bias and the repetition / frequency / presence penalties (case C21)."""
from collections import Counter

import pytest
import torch

from llmserve.sample import SamplingMetadata, SamplingRequestState, Sampler
from llmserve.sampling_params import SamplingParams

V = 1024
NEG_INF = float("-inf")


def _state(sp, prompt=(), output=None, eos=None) -> SamplingRequestState:
    return SamplingRequestState(sp, list(prompt), output if output is not None else [], None, eos)


def _meta(states):
    return SamplingMetadata.build(states, V, "cpu")


def _logits(B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 2


def _process(logits, states):
    return Sampler.process_logits(logits, _meta(states))


def _sample(logits, states):
    return Sampler()(logits, _meta(states)).sampled_token_ids


# ---- allowed_token_ids / bad_words / min_tokens / logit_bias --------------------------

def test_allowed_token_ids_restrict_sampling():
    allowed = [3, 500, 1000]
    x = _logits(200, seed=1)
    for sp in (SamplingParams(temperature=1.0, allowed_token_ids=allowed),
               SamplingParams(temperature=0.0, allowed_token_ids=allowed),
               SamplingParams(temperature=2.0, top_p=0.9, allowed_token_ids=allowed)):
        out = _sample(x, [_state(sp) for _ in range(200)])
        assert set(out.tolist()) <= set(allowed)
        if sp.temperature == 0.0:
            assert torch.equal(out, torch.tensor(allowed)[x[:, allowed].argmax(-1)])
    assert len(set(_sample(x, [_state(SamplingParams(temperature=1.0)) for _ in range(200)]).tolist())) > 3


def test_bad_words_block_completion_only():
    x = torch.zeros(1, V)
    x[0, 5] = 10.0  # single-token bad word: always blocked
    x[0, 8] = 9.0  # second token of the bad word [7, 8]
    x[0, 9] = 8.0
    sp = SamplingParams(temperature=0.0)
    sp.bad_words_token_ids = [[5], [7, 8]]
    assert _sample(x, [_state(sp, output=[1, 2])]).item() == 8  # prefix [7] not generated
    assert _sample(x, [_state(sp, output=[1, 7])]).item() == 9  # [7] generated: 8 blocked
    assert _sample(x, [_state(sp, prompt=[7], output=[])]).item() == 8  # the prompt does not count
    y = _process(x, [_state(sp, output=[7])])
    assert y[0, 5] == NEG_INF and y[0, 8] == NEG_INF and y[0, 9] == 8.0


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_blocks_eos_and_stop_ids(ignore_eos):
    eos, stop = 2, 11
    x = torch.zeros(1, V)
    x[0, eos], x[0, stop], x[0, 40] = 10.0, 9.0, 8.0
    sp = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], ignore_eos=ignore_eos)
    assert _sample(x, [_state(sp, output=[7, 7], eos=eos)]).item() == 40
    assert _sample(x, [_state(sp, output=[7, 7, 7], eos=eos)]).item() == eos
    blocked = _process(x, [_state(sp, output=[], eos=eos)])
    assert blocked[0, eos] == NEG_INF and blocked[0, stop] == NEG_INF


def test_logit_bias_forces_and_bans():
    x = _logits(100, seed=2)
    low = int(x[0].argmin())
    force = SamplingParams(temperature=1.0, logit_bias={low: 100.0})
    assert torch.equal(_sample(x[:1].expand(100, -1).contiguous(), [_state(force) for _ in range(100)]),
                       torch.full((100,), low))
    best = int(x[0].argmax())
    ban = SamplingParams(temperature=0.0, logit_bias={best: -100.0, V + 5: 3.0})  # out-of-vocab id ignored
    y = x[:1].clone()
    y[0, best] = -1e9
    assert _sample(x[:1], [_state(ban)]).item() == int(y.argmax())
    assert _process(x[:1], [_state(ban)])[0, best] == pytest.approx(float(x[0, best]) - 100.0)


def test_everything_blocked_falls_back_to_raw_logits():
    eos = 4
    x = _logits(1, seed=3)
    sp = SamplingParams(temperature=0.0, allowed_token_ids=[eos], min_tokens=2)
    assert _sample(x, [_state(sp, eos=eos)]).item() == int(x.argmax())


def test_sampler_does_not_modify_input_logits():
    x = _logits(3, seed=4)
    keep = x.clone()
    sps = [SamplingParams(temperature=0.7, logit_bias={1: 5.0}, repetition_penalty=1.5, presence_penalty=1.0),
           SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]),
           SamplingParams(temperature=1.0, top_k=3, min_p=0.1)]
    _sample(x, [_state(sp, prompt=[1, 2, 3], output=[1]) for sp in sps])
    assert torch.equal(x, keep)


# ---- penalties ----------------------------------------------------------------------

def _reference_penalties(row, prompt, output, rep, freq, pres):
    out = row.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t, c in Counter(output).items():
        out[t] -= freq * c + pres
    return out


def test_penalties_match_reference_per_row():
    x = _logits(4, seed=5)
    x[0, 3] = NEG_INF
    prompt = [1, 2, 3, 3, 900]
    outputs = [[2, 2, 7, 7, 7], [900], [], [5, 6]]
    sps = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25),
           SamplingParams(repetition_penalty=0.8),
           SamplingParams(frequency_penalty=-1.0, presence_penalty=2.0),
           SamplingParams()]  # no penalties: row untouched
    y = _process(x, [_state(sp, prompt, out) for sp, out in zip(sps, outputs)])
    for i, (sp, out) in enumerate(zip(sps, outputs)):
        ref = _reference_penalties(x[i], prompt, out, sp.repetition_penalty, sp.frequency_penalty,
                                   sp.presence_penalty)
        assert torch.allclose(y[i], ref, atol=1e-6), i
    assert torch.equal(y[3], x[3])
    assert y[0, 3] == NEG_INF


def test_repetition_penalty_changes_argmax_and_sees_the_prompt():
    # C21 A2: a repeated prompt token loses its lead on the very first step.
    x = torch.full((1, V), -5.0)
    x[0, 10], x[0, 20] = 2.0, 1.5
    assert _sample(x, [_state(SamplingParams(temperature=0.0), prompt=[10, 10])]).item() == 10
    sp = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert _sample(x, [_state(sp, prompt=[10, 10])]).item() == 20  # 2.0 / 2 = 1.0 < 1.5
    neg = torch.full((1, V), -5.0)
    neg[0, 10], neg[0, 20] = -0.5, -0.6
    assert _sample(neg, [_state(sp, prompt=[10])]).item() == 20  # -0.5 * 2 = -1.0 < -0.6


def test_presence_and_frequency_ignore_the_prompt():
    # C21 A1: with nothing generated yet, presence/frequency penalties change nothing.
    x = torch.full((1, V), -5.0)
    x[0, 10], x[0, 20] = 2.0, 1.5
    sp = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert _sample(x, [_state(sp, prompt=[10] * 8, output=[])]).item() == 10
    assert _sample(x, [_state(sp, prompt=[10] * 8, output=[10])]).item() == 20  # 2 - 4 < 1.5


def test_frequency_counts_occurrences_presence_does_not():
    x = torch.full((1, V), -5.0)
    x[0, 10], x[0, 20] = 3.0, 1.0
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.8)
    pres = SamplingParams(temperature=0.0, presence_penalty=0.8)
    assert _sample(x, [_state(freq, output=[10])]).item() == 10  # 3 - 0.8 > 1
    assert _sample(x, [_state(freq, output=[10, 10, 10])]).item() == 20  # 3 - 2.4 < 1
    assert _sample(x, [_state(pres, output=[10, 10, 10])]).item() == 10  # 3 - 0.8 > 1


def test_penalty_counts_follow_the_growing_output():
    """Counts are kept between steps and updated with appended (or rolled back) tokens."""
    x = _logits(2, seed=6)
    prompt = [1, 2, 3]
    sps = [SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.2),
           SamplingParams(temperature=0.0, frequency_penalty=0.3)]
    states = [_state(sp, prompt, []) for sp in sps]
    sampler = Sampler()
    for _ in range(6):
        out = sampler(x, _meta(states)).sampled_token_ids.tolist()
        for st, tok in zip(states, out):
            st.output_token_ids.append(tok)
        y = Sampler.process_logits(x, _meta(states))
        for i, (st, sp) in enumerate(zip(states, sps)):
            ref = _reference_penalties(x[i], prompt, st.output_token_ids, sp.repetition_penalty,
                                       sp.frequency_penalty, sp.presence_penalty)
            assert torch.allclose(y[i], ref, atol=1e-5)
    assert len(set(states[0].output_token_ids)) > 1  # the penalties moved greedy off its first pick
    del states[0].output_token_ids[2:]  # roll back
    y = Sampler.process_logits(x, _meta(states))
    ref = _reference_penalties(x[0], prompt, states[0].output_token_ids, 1.2, 1.0, 0.5)
    assert torch.allclose(y[0], ref, atol=1e-5)
