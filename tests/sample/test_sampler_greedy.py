"""Greedy sampling: argmax with the first maximum on ties (as HF), and the settings that
must reduce to it (top_k=1, tiny temperature, tiny top_p, min_p=1; cases C17, C18)."""
import pytest
import torch

from llmserve.sample import (SamplingMetadata, SamplingRequestState, Sampler, greedy_argmax,
                             make_generator)
from llmserve.sample.logprobs import sorted_topk
from llmserve.sampling_params import SamplingParams

V_BIG = 49152  # SmolLM2's vocabulary: the chunked CPU paths
V_SMALL = 100  # not a multiple of 64: the plain torch paths


def _state(sp: SamplingParams) -> SamplingRequestState:
    gen = make_generator(sp.seed, "cpu") if sp.seed is not None else None
    return SamplingRequestState(sp, [1, 2, 3], [], gen, None)


def _sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    meta = SamplingMetadata.build([_state(sp) for sp in params], logits.shape[1], "cpu")
    return Sampler()(logits, meta).sampled_token_ids


def _tied_logits(B: int, V: int, seed: int = 0) -> torch.Tensor:
    """Logits rounded to a coarse grid (many ties, like bf16 logits), each row's maximum
    placed at two positions so the first one must win."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=g) * 4).round() / 4
    top = x.amax(-1) + 1.0
    lo = torch.randint(0, V // 2, (B,), generator=g)
    hi = torch.randint(V // 2, V, (B,), generator=g)
    rows = torch.arange(B)
    x[rows, lo] = top
    x[rows, hi] = top
    return x


@pytest.mark.parametrize("V", [V_BIG, V_SMALL, 64 * 20])
def test_greedy_argmax_first_max_on_ties(V):
    x = _tied_logits(8, V)
    x[3, :] = float("-inf")  # a fully masked row: index 0, like torch.argmax
    x[4, :] = 1.0  # all equal
    ref = x.argmax(-1)
    assert torch.equal(greedy_argmax(x), ref)
    first = torch.tensor([int((row == row.max()).nonzero()[0]) if torch.isfinite(row.max()) else 0 for row in x])
    assert torch.equal(ref, first)


@pytest.mark.parametrize("V", [V_BIG, V_SMALL])
def test_temperature_zero_is_argmax_in_mixed_batch(V):
    x = _tied_logits(6, V, seed=1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, seed=5, top_p=0.5, top_k=10),  # C17 G2
              SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=3)]
    out = _sample(x, params)
    for i in (0, 2, 4):
        assert out[i] == x[i].argmax()


@pytest.mark.parametrize("V", [V_BIG, V_SMALL])
def test_top_k_1_always_argmax(V):
    # C17 G1: temperature 1 with top_k 1 must equal greedy, ties included, over 200 draws.
    x = _tied_logits(4, V, seed=2)
    rows = x.repeat_interleave(50, dim=0)  # 200 rows
    out = _sample(rows, [SamplingParams(temperature=1.0, top_k=1)] * len(rows))
    assert torch.equal(out, rows.argmax(-1))


@pytest.mark.parametrize("V", [V_BIG, V_SMALL])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-4),  # C18 T1 (above the 1e-5 greedy cut-off)
    SamplingParams(temperature=1.0, top_p=1e-4),  # C18 T2
    SamplingParams(temperature=1e-6, top_p=1e-6),  # C18 T3 (greedy by SamplingParams)
    SamplingParams(temperature=1.0, top_p=1e-4, top_k=40, seed=9),
], ids=["tiny-temperature", "tiny-top-p", "tiny-both", "tiny-top-p-top-k-seed"])
def test_degenerate_random_settings_give_argmax(V, params):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, V, generator=g) * 3
    out = _sample(x, [params] * 40)
    assert torch.equal(out, x.argmax(-1))


def test_tiny_top_p_with_tied_maximum_takes_first():
    x = _tied_logits(30, V_BIG, seed=4)
    out = _sample(x, [SamplingParams(temperature=1.0, top_p=1e-4)] * 30)
    assert torch.equal(out, x.argmax(-1))


def test_min_p_one_keeps_only_the_top_token():
    # C18 T5: with min_p = 1 only tokens as likely as the best survive.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(50, V_BIG, generator=g) * 3
    out = _sample(x, [SamplingParams(temperature=1.0, min_p=1.0)] * 50)
    assert torch.equal(out, x.argmax(-1))


@pytest.mark.parametrize("V", [V_BIG, V_SMALL, 64 * 20])
@pytest.mark.parametrize("k", [1, 5, 64, 300])
@pytest.mark.parametrize("exact", [True, False])
def test_sorted_topk_is_canonical(V, k, exact):
    """sorted_topk orders like a stable descending sort; with exact ties the set is the
    same too, otherwise everything above the k-th value is."""
    x = _tied_logits(6, V, seed=6)
    x[0, 7] = float("-inf")
    k = min(k, V)
    vals, idx = sorted_topk(x, k, exact_ties=exact)
    ref_vals, ref_idx = x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(vals, ref_vals[:, :k])
    if exact:
        assert torch.equal(idx, ref_idx[:, :k])
    else:
        above = vals > vals[:, -1:]
        assert torch.equal(idx[above], ref_idx[:, :k][above])
        # within each run of equal values the indices ascend
        same = vals[:, 1:] == vals[:, :-1]
        assert bool((idx[:, 1:][same] > idx[:, :-1][same]).all())
