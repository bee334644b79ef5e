"""Logprobs: raw log_softmax of the model's logits (independent of the sampling
settings), the top-K in order, and 1-based ranks; prompt logprobs (cases C10, C21)."""
import pytest
import torch

from llmserve.sample import (SamplingMetadata, SamplingRequestState, Sampler,
                             compute_prompt_logprobs, make_generator)
from llmserve.sampling_params import SamplingParams


def _state(sp, prompt=(1, 2), output=None):
    gen = make_generator(sp.seed, "cpu") if sp.seed is not None else None
    return SamplingRequestState(sp, list(prompt), output or [], gen, 0)


def _run(x, sps, **kw):
    meta = SamplingMetadata.build([_state(sp, **kw) for sp in sps], x.shape[1], "cpu")
    return Sampler()(x, meta)


def _check_row(raw_row, token, ids, lps, rank, k):
    ref = torch.log_softmax(raw_row.double(), -1)
    assert ids[0] == token
    assert lps[0] == pytest.approx(float(ref[token]), abs=2e-5)
    assert rank == 1 + int((raw_row > raw_row[token]).sum())
    order = torch.sort(raw_row, descending=True, stable=True).indices[:k]
    assert ids[1:k + 1].tolist() == order.tolist()
    assert torch.allclose(lps[1:k + 1].double(), ref[order], atol=2e-5)


@pytest.mark.parametrize("V", [49152, 1000])
def test_logprobs_are_raw_and_ranked(V):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, V, generator=g) * 3
    x[2, :10] = x[2].max() + 1  # ten-way tie at the top
    low = int(x[4].argmin())
    sps = [SamplingParams(temperature=0.0, logprobs=5),
           SamplingParams(temperature=0.5, top_k=3, repetition_penalty=2.0, logprobs=2),
           SamplingParams(temperature=0.0, logprobs=3),
           SamplingParams(temperature=1.0, logprobs=None),
           SamplingParams(temperature=0.0, logit_bias={low: 100.0}, logprobs=4),  # sampled far outside top-K
           SamplingParams(temperature=1.3, top_p=0.5, min_p=0.1, seed=1, logprobs=0)]
    out = _run(x, sps, prompt=list(range(50)))
    lt = out.logprobs_tensors
    assert lt.logprob_token_ids.shape == (6, 6) and lt.logprobs.shape == (6, 6)
    for i, sp in enumerate(sps):
        if sp.logprobs is None:
            continue
        _check_row(x[i], int(out.sampled_token_ids[i]), lt.logprob_token_ids[i], lt.logprobs[i],
                   int(lt.selected_token_ranks[i]), sp.logprobs)
    assert lt.selected_token_ranks[2] == 1  # greedy pick of a tied maximum
    assert out.sampled_token_ids[4] == low and lt.selected_token_ranks[4] == V


def test_logprobs_do_not_depend_on_sampling_settings():
    # C10 A5: the same logits give the same logprobs whatever the sampling settings.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4096, generator=g) * 2
    tok = int(x.argmax())
    a = _run(x, [SamplingParams(temperature=0.0, logprobs=3)]).logprobs_tensors
    b = _run(x, [SamplingParams(temperature=1.0, top_k=1, logprobs=3, presence_penalty=2.0,
                                repetition_penalty=3.0)], output=[tok]).logprobs_tensors
    assert torch.equal(a.logprob_token_ids[:, 1:], b.logprob_token_ids[:, 1:])
    assert torch.equal(a.logprobs[:, 1:], b.logprobs[:, 1:])


def test_no_logprobs_requested_gives_none():
    x = torch.randn(2, 128)
    assert _run(x, [SamplingParams(), SamplingParams(temperature=0.0)]).logprobs_tensors is None


def test_logprobs_minus_one_is_the_whole_vocabulary():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 300, generator=g)
    out = _run(x, [SamplingParams(temperature=0.0, logprobs=-1), SamplingParams(temperature=0.0, logprobs=2)])
    lt = out.logprobs_tensors
    assert lt.logprobs.shape == (2, 301)
    _check_row(x[0], int(out.sampled_token_ids[0]), lt.logprob_token_ids[0], lt.logprobs[0],
               int(lt.selected_token_ranks[0]), 300)
    assert torch.logsumexp(lt.logprobs[0, 1:].double(), 0).item() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("k", [0, 3, -1])
def test_prompt_logprobs(k):
    g = torch.Generator().manual_seed(3)
    N, V = 7, 640
    x = torch.randn(N, V, generator=g) * 2
    targets = torch.randint(0, V, (N,), generator=g)
    targets[0] = int(x[0].argmax())
    lt = compute_prompt_logprobs(x, targets, k)
    width = (V if k == -1 else k) + 1
    assert lt.logprob_token_ids.shape == (N, width)
    for i in range(N):
        _check_row(x[i], int(targets[i]), lt.logprob_token_ids[i], lt.logprobs[i],
                   int(lt.selected_token_ranks[i]), width - 1)
    assert lt.selected_token_ranks[0] == 1
    # bf16 logits are accepted (upcast)
    lt16 = compute_prompt_logprobs(x.to(torch.bfloat16), targets, k)
    assert lt16.logprobs.dtype == torch.float32


def test_prompt_logprobs_rejects_bad_arguments():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError):
        compute_prompt_logprobs(x, torch.tensor([1, 2]), 1)
    with pytest.raises(ValueError):
        compute_prompt_logprobs(x, torch.tensor([1, 2, 3]), -2)
