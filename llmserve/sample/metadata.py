"""Per-request sampling state and the per-step batch description the Sampler reads.

Source: vLLM v1 ``SamplingMetadata`` / ``InputBatch`` (vllm/v1/sample/metadata.py), reduced
to what llmserve's sampler uses. The runner keeps one :class:`SamplingRequestState` per
request for its whole life and calls :meth:`SamplingMetadata.build` every step with the
states of the rows it samples, in row order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from llmserve.sampling_params import SamplingParams, SamplingParamsError

# Candidate count the truncated (top-k / top-p) path starts with; see sampler.py.
_MIN_CANDIDATES = 64


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser (Steele et al. 2014): a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SeededStream:
    """The random stream of a seeded request: counter-based, so the uniform for output
    position ``p`` is a pure function of (seed, p) (SplitMix64 of both).

    A request's draws thus never depend on its batch slot, on the step count, on
    chunking, or on preemption and recompute: a preempted request resumes its stream where
    it stopped (issue 18). n > 1 children carry derived seeds (seed + i, see
    ``ParentRequest``). vLLM keys a ``torch.Generator`` per request instead, which a
    recompute restarts.
    """

    __slots__ = ("seed", "_key")

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self._key = _splitmix64(self.seed & _MASK64)

    def uniform(self, position: int) -> float:
        """The uniform in [0, 1) (24 random bits, exact in float32) for output ``position``
        (0 for the first generated token)."""
        return (_splitmix64(self._key ^ (int(position) & _MASK64)) >> 40) * (1.0 / (1 << 24))


def make_generator(seed: int, device: torch.device | str = "cpu") -> SeededStream:
    """The :class:`SeededStream` of ``seed`` (SamplingParams.seed); ``device`` is unused
    (draws are made on the host and copied with the step's other uniforms)."""
    return SeededStream(seed)


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Check the token ids a request names against the vocabulary (vLLM's processor check).

    For the InputProcessor to call before a request reaches the engine core; the sampler
    itself only ignores out-of-range ids so that one bad request cannot crash a step.

    Raises:
      SamplingParamsError (a ValueError) naming ``allowed_token_ids`` or ``logit_bias`` when
      an id is outside ``[0, vocab_size)``.
    """
    if params.allowed_token_ids is not None:
        bad = [t for t in params.allowed_token_ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise SamplingParamsError(
                f"allowed_token_ids contains out-of-vocab token ids {bad[:5]} "
                f"(vocab size {vocab_size}).", "allowed_token_ids")
    if params.logit_bias:
        bad = [t for t in params.logit_bias if not 0 <= int(t) < vocab_size]
        if bad:
            raise SamplingParamsError(
                f"logit_bias contains out-of-vocab token ids {bad[:5]} "
                f"(vocab size {vocab_size}).", "logit_bias")


def _inv_temperature(t: float) -> float:
    """1 / t, and 1.0 for t == 0 (greedy rows keep the raw logprobs)."""
    return 1.0 / t if t > 0 else 1.0


@dataclass
class RequestSamplingCache:
    """Tensors the sampler derives from one request and keeps between steps.

    All are built lazily, on the sampler's device:
      penalty: ``penalties.SeenTokens``, the distinct prompt and output tokens with their
        output counts (for the three penalties).
      allowed_mask: bool [vocab_size], True for ``allowed_token_ids``.
      bias_ids / bias_values: int64 / float32 [n], the in-vocab ``logit_bias`` entries.
    """

    penalty: Optional[Any] = None
    allowed_mask: Optional[torch.Tensor] = None
    bias_ids: Optional[torch.Tensor] = None
    bias_values: Optional[torch.Tensor] = None


@dataclass
class SamplingRequestState:
    """One request as the sampler sees it; built once by the runner and kept.

    sampling_params: the request's SamplingParams. prompt_token_ids: the prompt.
    output_token_ids: tokens generated so far; the runner appends each sampled token to
    this same list. generator: the request's :class:`SeededStream` when
    ``sampling_params.seed`` is set, else None (the default RNG is used). eos_token_id: the
    model's EOS id, blocked together with ``all_stop_token_ids`` until ``min_tokens``.
    cache: tensors the sampler derives lazily (private to ``llmserve.sample``).
    logprobs_temperature: the temperature its logprobs are computed at,
    ``log_softmax(logits / T)``; 0 or 1: the raw logprobs (every request but a beam of a
    beam search with a temperature: core/beam_search.py).
    """

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: Optional[SeededStream] = None
    eos_token_id: Optional[int] = None
    cache: RequestSamplingCache = field(default_factory=RequestSamplingCache, repr=False)
    logprobs_temperature: float = 0.0


@dataclass
class RandomGroup:
    """Randomly sampled rows that share one sampling path.

    rows: batch row indices ([n] int64 on the device; ``None`` when the group is the
      whole batch in order). inv_temperature: float32 [n, 1], 1/temperature.
    top_k: int64 [n], vocab_size where unused (None when no row of the group uses it).
    top_p: float32 [n], 1.0 where unused (None when no row uses it).
    min_p: float32 [n], 0.0 where unused (None when no row uses it); min_p_value: the
      common min_p when every row of the group has the same one (a faster path).
    generators: (position in the group, uniform) for seeded rows: each one's draw for
      this step, from its SeededStream at its output position.
    initial_candidates: how many top tokens the truncated path looks at first.
    """

    rows: Optional[torch.Tensor]
    inv_temperature: torch.Tensor
    top_k: Optional[torch.Tensor]
    top_p: Optional[torch.Tensor]
    min_p: Optional[torch.Tensor]
    min_p_value: Optional[float]
    generators: list[tuple[int, float]]
    initial_candidates: int
    size: int


@dataclass
class SamplingMetadata:
    """What the Sampler needs for one step of B rows (vLLM v1 ``SamplingMetadata``).

    reqs: the B request states, in row order. vocab_size / device: of the logits.
    all_greedy: every row takes the argmax (temperature 0 or top_k 1).
    greedy_rows: int64 [G] row indices taking the argmax (None if none or all).
    full_group: random rows without top-k/top-p (temperature and min-p only).
    truncated_group: random rows using top-k and/or top-p (and maybe min-p).
    max_num_logprobs: K for the sampled-token logprobs (-1 is turned into vocab_size);
      None when no row asks. logprobs_rows: rows that ask (None = all rows).
    logprobs_scale: float32 [B, 1], 1 / logprobs_temperature per row (1.0 for raw rows);
      None when every row's logprobs are raw.
    penalty_rows, allowed_rows, bad_words_rows, min_tokens_rows, logit_bias_rows: rows
      using each logits-processing feature (empty lists when none: the work is skipped).
    presence/frequency/repetition_penalties: float32 [P] for ``penalty_rows``.
    """

    reqs: list[SamplingRequestState]
    vocab_size: int
    device: torch.device
    all_greedy: bool
    greedy_rows: Optional[torch.Tensor]
    full_group: Optional[RandomGroup]
    truncated_group: Optional[RandomGroup]
    max_num_logprobs: Optional[int]
    logprobs_rows: Optional[torch.Tensor]
    penalty_rows: list[int]
    presence_penalties: Optional[torch.Tensor]
    frequency_penalties: Optional[torch.Tensor]
    repetition_penalties: Optional[torch.Tensor]
    allowed_rows: list[int]
    bad_words_rows: list[int]
    min_tokens_rows: list[int]
    logit_bias_rows: list[int]
    logprobs_scale: Optional[torch.Tensor] = None

    @property
    def num_rows(self) -> int:
        return len(self.reqs)

    @property
    def needs_processing(self) -> bool:
        """True when some row uses a feature that changes logits before sampling."""
        return bool(self.penalty_rows or self.allowed_rows or self.bad_words_rows
                    or self.min_tokens_rows or self.logit_bias_rows)

    @classmethod
    def build(cls, reqs: list[SamplingRequestState], vocab_size: int,
              device: torch.device | str) -> "SamplingMetadata":
        """Describe one step: ``reqs[i]`` is the request of logits row ``i``.

        Cost is one Python pass over the rows plus a few small tensors; nothing of size
        ``vocab_size`` is built here (per-request masks are built lazily by the sampler).
        """
        device = torch.device(device)
        greedy: list[int] = []
        full: list[int] = []
        trunc: list[int] = []
        lp_rows: list[int] = []
        max_lp: Optional[int] = None
        penalty_rows: list[int] = []
        pres: list[float] = []
        freq: list[float] = []
        rep: list[float] = []
        allowed_rows: list[int] = []
        bad_rows: list[int] = []
        min_rows: list[int] = []
        bias_rows: list[int] = []
        scaled = False
        for i, st in enumerate(reqs):
            sp = st.sampling_params
            if sp.temperature < 1e-5 or sp.top_k == 1:
                greedy.append(i)
            elif (0 < sp.top_k < vocab_size) or sp.top_p < 1.0:
                trunc.append(i)
            else:
                full.append(i)
            if sp.logprobs is not None:
                lp_rows.append(i)
                if st.logprobs_temperature not in (0.0, 1.0):
                    scaled = True
                k = vocab_size if sp.logprobs == -1 else min(sp.logprobs, vocab_size)
                max_lp = k if max_lp is None else max(max_lp, k)
            if sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0:
                penalty_rows.append(i)
                pres.append(sp.presence_penalty)
                freq.append(sp.frequency_penalty)
                rep.append(sp.repetition_penalty)
            if sp.allowed_token_ids:
                allowed_rows.append(i)
            if sp.bad_words_token_ids:
                bad_rows.append(i)
            if len(st.output_token_ids) < sp.min_tokens and (
                    st.eos_token_id is not None or sp.all_stop_token_ids):
                min_rows.append(i)
            if sp.logit_bias:
                bias_rows.append(i)

        n = len(reqs)

        def f32(vals: list[float]) -> torch.Tensor:
            return torch.tensor(vals, dtype=torch.float32, device=device)

        def rows_tensor(rows: list[int]) -> Optional[torch.Tensor]:
            if len(rows) == n:  # the whole batch, in order
                return None
            return torch.tensor(rows, dtype=torch.long, device=device)

        def group(rows: list[int]) -> Optional[RandomGroup]:
            if not rows:
                return None
            sps = [reqs[i].sampling_params for i in rows]
            ks = [sp.top_k if 0 < sp.top_k < vocab_size else vocab_size for sp in sps]
            any_k = any(k < vocab_size for k in ks)
            any_p = any(sp.top_p < 1.0 for sp in sps)
            any_min_p = any(sp.min_p > 0.0 for sp in sps)
            # Rows using top-k alone need k candidates plus room for ties at the k-th
            # place (see sampler._cut_and_draw); top-p rows start small.
            only_k = [2 * k for k, sp in zip(ks, sps) if k < vocab_size and sp.top_p >= 1.0]
            cand = min(vocab_size, max([_MIN_CANDIDATES] + only_k))
            gens = [(j, reqs[i].generator.uniform(len(reqs[i].output_token_ids)))
                    for j, i in enumerate(rows) if reqs[i].generator is not None]
            return RandomGroup(
                rows=rows_tensor(rows),
                inv_temperature=f32([1.0 / sp.temperature for sp in sps]).unsqueeze(1),
                top_k=torch.tensor(ks, dtype=torch.long, device=device) if any_k else None,
                top_p=f32([sp.top_p for sp in sps]) if any_p else None,
                min_p=f32([sp.min_p for sp in sps]) if any_min_p else None,
                min_p_value=sps[0].min_p if any_min_p and all(sp.min_p == sps[0].min_p for sp in sps) else None,
                generators=gens,
                initial_candidates=cand,
                size=len(rows),
            )

        return cls(
            reqs=reqs,
            vocab_size=vocab_size,
            device=device,
            all_greedy=len(greedy) == n,
            greedy_rows=rows_tensor(greedy) if greedy else None,
            full_group=group(full),
            truncated_group=group(trunc),
            max_num_logprobs=max_lp,
            logprobs_rows=rows_tensor(lp_rows) if lp_rows else None,
            penalty_rows=penalty_rows,
            presence_penalties=f32(pres) if penalty_rows else None,
            frequency_penalties=f32(freq) if penalty_rows else None,
            repetition_penalties=f32(rep) if penalty_rows else None,
            allowed_rows=allowed_rows,
            bad_words_rows=bad_rows,
            min_tokens_rows=min_rows,
            logit_bias_rows=bias_rows,
            logprobs_scale=f32([_inv_temperature(st.logprobs_temperature) for st in reqs]).unsqueeze(1)
            if scaled else None,
        )

