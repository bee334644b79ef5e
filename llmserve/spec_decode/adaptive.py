"""How many draft tokens a request gets: per request, from its measured acceptance.

Model (Leviathan et al. 2023, section 3.1): if each draft token is accepted with
probability ``alpha`` given the ones before it were, a step verifying ``k`` drafts emits
``E(k) = (1 - alpha^(k+1)) / (1 - alpha)`` tokens on average, and costs
``1 + c * k`` one-token steps, where ``c`` is the relative cost of one more query token in
a step. The request drafts the ``k`` (0..num_speculative_tokens) that maximises
``E(k) / (1 + c k)``; when that is ``k = 0`` (drafting does not pay) it stops drafting for
a back-off of 4, 8, ... 64 steps, then tries again from the prior.

``alpha`` is a decayed estimate: each verification adds its accepted drafts as successes
and, when a draft was rejected, one failure (positions after the first rejection are not
observed), with weight ``DECAY`` per step on the past.

``c`` on this project's 2-core AVX512 CPU (SmolLM2-135M Q4_1, one request, a quiet
machine, load 1.4): ``llmserve bench spec-decode --cost`` (forced, always-rejected drafts)
measured TPOT 1.10, 1.20, 1.26, 1.45, 1.52x the one-token step's for k = 1..5, i.e.
~0.1 per token (the packed 4-bit linear alone: 7.2, 8.7, 10.5, 12.5, 16.3 us at 1..5 rows
for 576x1536). ``VERIFY_COST_PER_TOKEN`` is set a little above, so that marginal drafts
are skipped; re-measure on another CPU with ``--cost``.
"""
from __future__ import annotations

VERIFY_COST_PER_TOKEN = 0.12
DECAY = 0.7
# The prior counts as PRIOR_TRIALS observations, so that one rejection (often the first
# draft, matched on the chat template's tail) does not stop drafting at once: measured on
# the edit workload, a prior worth one trial sent 2 of 3 requests into back-off at their
# first draft and they drafted in 2 and 22 of 26 and 71 steps.
PRIOR_ALPHA = 0.6
PRIOR_TRIALS = 3.0
MAX_BACKOFF = 64


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens emitted by a step verifying ``k`` drafts (accepted ones + the bonus)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_draft_len(alpha: float, max_k: int, cost: float = VERIFY_COST_PER_TOKEN) -> int:
    """The k in [0, max_k] with the most expected tokens per unit of step cost."""
    best_k, best = 0, 1.0
    for k in range(1, max_k + 1):
        gain = expected_tokens(alpha, k) / (1.0 + cost * k)
        if gain > best * 1.01:  # a 1% edge at least: ties and noise keep the shorter draft
            best_k, best = k, gain
    return best_k


class AcceptanceTracker:
    """One request's acceptance estimate and back-off (see the module docstring)."""

    __slots__ = ("accepted", "trials", "skip", "backoff")

    def __init__(self) -> None:
        self.accepted, self.trials = PRIOR_ALPHA * PRIOR_TRIALS, PRIOR_TRIALS
        self.skip = 0
        self.backoff = 0

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def draft_len(self, max_k: int) -> int:
        """Drafts to ask for this step (0: none). Counts down a back-off."""
        if self.skip > 0:
            self.skip -= 1
            return 0
        k = best_draft_len(self.alpha, max_k)
        if k == 0:
            self.backoff = min(MAX_BACKOFF, max(4, 2 * self.backoff))
            self.skip = self.backoff
            self.accepted, self.trials = PRIOR_ALPHA * PRIOR_TRIALS, PRIOR_TRIALS  # the next try: from the prior
        return k

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Record one verification: ``num_accepted`` of ``num_draft`` drafts accepted."""
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + num_accepted + (num_accepted < num_draft)
        if num_accepted:
            self.backoff = 0
