"""Random sampling: the distribution (temperature, top-k, top-p, min-p) and per-request
seeds that reproduce whatever else is in the batch."""
import math

import pytest
import torch

from llmserve.sample import SamplingMetadata, SamplingRequestState, Sampler, SeededStream, make_generator
from llmserve.sampling_params import SamplingParams

V_BIG = 49152


def _state(sp: SamplingParams, output=None) -> SamplingRequestState:
    gen = make_generator(sp.seed, "cpu") if sp.seed is not None else None
    return SamplingRequestState(sp, [], output if output is not None else [], gen, None)


def _sample_states(logits: torch.Tensor, states: list[SamplingRequestState]) -> torch.Tensor:
    meta = SamplingMetadata.build(states, logits.shape[1], "cpu")
    return Sampler()(logits, meta).sampled_token_ids


def _draws(logits_row: torch.Tensor, sp: SamplingParams, n: int) -> torch.Tensor:
    """n independent draws for one distribution: one step with n identical rows."""
    rows = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    return _sample_states(rows, [_state(sp) for _ in range(n)])


def reference_probs(logits_row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Textbook top-k -> top-p -> min-p on softmax(logits / T), float64, via a stable
    descending sort: the probability of each token."""
    x = logits_row.double()
    order = torch.sort(logits_row, descending=True, stable=True).indices
    p = torch.softmax(x / sp.temperature, -1)[order]
    keep = torch.ones_like(p, dtype=torch.bool)
    if sp.top_k > 0:
        keep[sp.top_k:] = False
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    if sp.top_p < 1.0:
        before = torch.cumsum(p, 0) - p
        keep &= before < sp.top_p
    p = torch.where(keep, p, 0.0)
    if sp.min_p > 0:
        keep &= p >= sp.min_p * p.max()
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    out = torch.zeros_like(p)
    out[order] = p
    return out


def assert_follows(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """No sample outside the support, and a chi-square statistic far from its tail
    (fixed RNG seeds make this deterministic)."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "sampled a token with zero probability"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] < 5:  # fold a small remainder into the largest bin
        j = int(exp[:-1].argmax())
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = max(1, obs.numel() - 1)
    assert chi2 < df + 6 * math.sqrt(2 * df), f"chi2 {chi2:.1f} for {df} degrees of freedom"


def _peaked_row(V: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(V, generator=g) * scale
    x[torch.randint(0, V, (12,), generator=g)] += torch.linspace(6, 1, 12)  # a few likely tokens
    return x


@pytest.mark.parametrize("V,T", [(16, 1.0), (16, 0.5), (1024, 1.0), (1024, 2.0)])
def test_temperature_sampling_follows_softmax(V, T):
    torch.manual_seed(1234)
    x = _peaked_row(V, seed=V, scale=1.0)
    sp = SamplingParams(temperature=T)
    samples = _draws(x, sp, 6000)
    probs = torch.softmax(x.double() / T, -1)
    assert_follows(samples, probs)
    # and would fail if temperature were ignored
    if T != 1.0:
        with pytest.raises(AssertionError):
            assert_follows(samples, torch.softmax(x.double(), -1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.5, top_p=0.95, min_p=0.05),
], ids=["top_k", "top_p", "top_k+top_p", "min_p", "top_p+min_p"])
def test_truncation_follows_reference(params):
    torch.manual_seed(99)
    x = _peaked_row(1024, seed=7)
    samples = _draws(x, params, 5000)
    probs = reference_probs(x, params)
    assert_follows(samples, probs)
    # the field matters: without it the sample would not follow the reference
    full = torch.softmax(x.double() / params.temperature, -1)
    assert (probs == 0).sum() > 0 and bool(((probs == 0) & (full > 1e-3)).any())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.97, top_k=3000),
    SamplingParams(temperature=0.8, top_k=200),
    SamplingParams(temperature=1.0, min_p=0.1),
], ids=["top_p", "top_p+top_k", "top_k", "min_p"])
def test_truncation_support_at_full_vocab(params):
    """V = 49152 with flat rows, so top-p needs far more than the first 64 candidates."""
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, V_BIG, generator=g) * torch.tensor([[0.5], [1.0], [2.0], [4.0]])
    rows = x.repeat_interleave(2, dim=0)
    out = _sample_states(rows, [_state(params) for _ in range(len(rows))])
    for i, tok in enumerate(out.tolist()):
        probs = reference_probs(rows[i], params)
        assert probs[tok] > 0, f"row {i}: token {tok} is outside the kept set"
    if params.top_p < 1.0 and params.top_k == 0:
        # a flat row's nucleus is big: the draws must spread over many tokens
        assert out[0] != out[1]


def test_top_k_and_min_p_cut_tokens_in_full_vocab():
    torch.manual_seed(6)
    x = _peaked_row(V_BIG, seed=8)
    for params in (SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, min_p=0.3)):
        samples = _draws(x, params, 300)
        allowed = set((reference_probs(x, params) > 0).nonzero().flatten().tolist())
        assert set(samples.tolist()) <= allowed
        assert len(allowed) <= 6


def _run_steps(states, step_logits, order):
    """Run len(step_logits) steps; per step, place the rows in the given order."""
    out = {i: [] for i in range(len(states))}
    for s, logits in enumerate(step_logits):
        perm = order[s % len(order)]
        toks = _sample_states(logits[perm].contiguous(), [states[i] for i in perm])
        for pos, i in enumerate(perm):
            out[i].append(int(toks[pos]))
            states[i].output_token_ids.append(int(toks[pos]))
    return out


@pytest.mark.parametrize("seeded", [
    SamplingParams(temperature=0.9, seed=7),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7),
    SamplingParams(temperature=1.0, top_k=20, min_p=0.01, seed=123),
], ids=["plain", "top_p", "top_k+min_p"])
def test_seeded_request_reproduces_in_any_batch(seeded):
    g = torch.Generator().manual_seed(21)
    steps = 4
    B = 5
    # Row 0 is the seeded request; its logits are the same in both runs.
    logits = [torch.randn(B, V_BIG, generator=g) * 2 for _ in range(steps)]
    alone = _run_steps([_state(seeded)], [lg[:1] for lg in logits], [[0]])[0]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=500, seed=1), SamplingParams(temperature=0.0)]
    states = [_state(seeded)] + [_state(sp) for sp in others]
    torch.manual_seed(0)
    batched = _run_steps(states, logits, [[0, 1, 2, 3, 4], [3, 1, 0, 4, 2], [4, 3, 2, 1, 0]])[0]
    assert batched == alone
    torch.manual_seed(1)  # a different default RNG state changes nothing either
    states = [_state(seeded)] + [_state(sp) for sp in reversed(others)]
    again = _run_steps(states, logits, [[2, 0, 1, 4, 3]])[0]
    assert again == alone
    # the seed matters: another seed gives another sequence on these flat logits
    other = seeded.clone()
    other.seed += 1
    assert _run_steps([_state(other)], [lg[:1] for lg in logits], [[0]])[0] != alone


def test_seeded_rows_with_tied_logits_reproduce():
    """bf16-like logits (many ties) and a batch whose top_k changes the candidate count."""
    g = torch.Generator().manual_seed(3)
    x = ((torch.randn(3, V_BIG, generator=g) * 2).to(torch.bfloat16).float())
    sp = SamplingParams(temperature=1.0, top_p=0.8, seed=42)
    alone = [_sample_states(x[:1].clone(), [_state(sp)]).item() for _ in range(1)]
    for other in (SamplingParams(temperature=1.0, top_k=1000), SamplingParams(temperature=1.0, top_k=30)):
        st = _state(sp)
        tok = _sample_states(x.clone(), [st, _state(other), _state(SamplingParams())])[0].item()
        assert tok == alone[0]


def test_seeded_draw_is_a_function_of_seed_and_position():
    """Issue 18: a seeded row's uniform is SeededStream(seed).uniform(output position),
    whatever the step or slot: a row that already holds 5 output tokens (e.g. recomputed
    after preemption) draws position 5's value, and picks the token that value selects."""
    sp = SamplingParams(temperature=1.0, seed=77)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1024, generator=g)
    resumed = _state(sp)
    resumed.output_token_ids.extend([1, 2, 3, 4, 5])
    t_resumed = _sample_states(x, [resumed])

    class Shifted(SeededStream):  # position 0 of this stream is position 5 of seed 77's
        def uniform(self, position):
            return SeededStream(77).uniform(position + 5)

    shifted = _state(sp)
    shifted.generator = Shifted(0)
    torch.manual_seed(0)
    x2 = torch.cat([torch.randn(1, 1024, generator=g), x])  # in another slot, beside another row
    assert torch.equal(_sample_states(x2, [_state(SamplingParams(temperature=1.0)), shifted])[1:], t_resumed)
    # the draw itself: u of position 5 lands in the resumed token's CDF interval
    w = torch.softmax(x[0].double(), -1)
    lo, hi = float(w[:int(t_resumed[0])].sum()), float(w[:int(t_resumed[0]) + 1].sum())
    assert lo - 1e-5 <= SeededStream(77).uniform(5) <= hi + 1e-5
    assert SeededStream(77).uniform(0) != SeededStream(77).uniform(5)
    assert SeededStream(77).uniform(3) != SeededStream(78).uniform(3)


def test_chunked_cpu_paths_agree_with_plain_paths(monkeypatch):
    """The 64-wide chunk paths (CPU) and the plain torch paths (other devices) pick the
    same tokens for the same draws."""
    import llmserve.sample.logprobs as lp_mod
    import llmserve.sample.sampler as s_mod

    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, V_BIG, generator=g) * 2.5
    sps = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0, seed=1),
           SamplingParams(temperature=0.7, top_p=0.9, seed=2), SamplingParams(temperature=1.0, top_k=50, seed=3),
           SamplingParams(temperature=1.0, min_p=0.05, seed=4), SamplingParams(temperature=1.2, top_p=0.3, seed=5)]

    def run():
        meta = SamplingMetadata.build([_state(sp) for sp in sps], V_BIG, "cpu")
        out = Sampler()(x, meta)
        return out.sampled_token_ids, out.logprobs_tensors.logprob_token_ids[0]

    chunked = run()
    monkeypatch.setattr(lp_mod, "chunkable", lambda *a, **k: False)
    monkeypatch.setattr(s_mod, "chunkable", lambda *a, **k: False)
    plain = run()
    assert torch.equal(chunked[0], plain[0])
    assert torch.equal(chunked[1], plain[1])


def test_fused_cpu_sampling_kernel_matches_torch_inverse_cdf():
    """The C++ sample_inverse_cdf draws the token the torch chunk path draws for the same
    uniforms (random rows, temperatures, masked -inf tokens and a ragged vocabulary), and
    never a -inf token."""
    from llmserve.ops.cpu_ops import get_cpu_ops
    import llmserve.sample.sampler as s_mod

    ops = get_cpu_ops()
    if ops is None:
        pytest.fail("the C++ kernels did not build on this machine")
    g = torch.Generator().manual_seed(21)
    for V in (V_BIG, 1000):
        n = 64
        x = torch.randn(n, V, generator=g) * 3
        x[:, ::7] = float("-inf")  # banned tokens
        x[0, :] = float("-inf")
        x[0, 5] = 2.0  # one allowed token
        temps = torch.rand(n, generator=g) * 1.5 + 0.3
        u = torch.rand(n, generator=g)
        u[1] = 0.0
        u[2] = 1.0 - 2 ** -24
        out = torch.empty(n, dtype=torch.long)
        k = (1.4426950408889634 / temps).contiguous()
        ops.sample_inverse_cdf(out, x, k, u)
        assert not torch.isneginf(x.gather(1, out.unsqueeze(1))).any()
        assert out[0] == 5
        ref = s_mod._inverse_cdf(s_mod._relative_weights(x, (1 / temps).unsqueeze(1)), u)
        assert (out == ref).float().mean() >= 0.98, "the fused kernel draws differently from the torch path"
