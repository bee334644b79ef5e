"""The scheduler's side of n-gram speculative decoding (vLLM v1: the scheduler gets
``spec_token_ids`` from the proposer and, after the step, rolls back rejected tokens).

Per step, for a running request that decodes (one token to compute), ``propose`` picks a
draft length (spec_decode/adaptive.py) and drafts that many tokens by prompt lookup
(spec_decode/ngram_proposer.py); the scheduler then schedules 1 + len(draft) tokens for
it. After the forward, ``update`` takes the emitted tokens (accepted drafts + one bonus or
correction token, chosen by sample/rejection_sampler.py in the runner), appends them
one by one with the usual stop checks, and rolls the KV back over the rejected drafts:
``num_computed_tokens`` counts only the accepted positions, and blocks past what the
request needs next are freed (their slots are simply rewritten later).

Requests that never draft: beam search, pooling, streaming input (resumable), structured
outputs (the grammar would have to advance over drafts and roll back: not done), and
presence/frequency/repetition penalties (the sampler's per-request seen-token cache is
incremental). Logprobs, min_tokens, stop tokens/strings, bad_words, logit_bias,
allowed_token_ids and seeds stay exact (see rejection_sampler.py). No torch here.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional

from llmserve.core.outputs import EngineCoreOutput, LogprobsLists, ModelRunnerOutput
from llmserve.metrics.stats import SpecDecodingStats
from llmserve.spec_decode.adaptive import AcceptanceTracker
from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.ngram_proposer import NgramIndex

if TYPE_CHECKING:
    from llmserve.core.request import Request
    from llmserve.core.sched_output import ScheduledRequest


class _ReqSpec:
    __slots__ = ("index", "tracker")

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.index = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        self.tracker = AcceptanceTracker()


def can_draft(req: "Request") -> bool:
    """Whether speculation may run for this request (see the module docstring)."""
    sp = req.sampling_params
    return (req.pooling_params is None and req.beam_group is None and not req.resumable and req.encoder_inputs is None
            and req.structured_output_request is None and sp is not None
            and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0 and sp.repetition_penalty == 1.0)


class SpecDecodeScheduler:
    """Drafts, rollback and ``vllm:spec_decode_*`` counts for one Scheduler."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._states: "weakref.WeakKeyDictionary[Request, _ReqSpec]" = weakref.WeakKeyDictionary()
        self._stats = SpecDecodingStats(num_spec_tokens=config.num_speculative_tokens)
        # Counts since the engine started (benchmarks and tests read the acceptance here).
        self.totals = SpecDecodingStats(num_spec_tokens=config.num_speculative_tokens)

    def propose(self, req: "Request", max_tokens: int, batch_size: int) -> list[int]:
        """Draft tokens for ``req`` (which has one token to compute this step); at most
        ``max_tokens`` (the step's budget left over for drafts). Empty: decode as usual."""
        cfg = self.config
        if cfg.disable_by_batch_size is not None and batch_size >= cfg.disable_by_batch_size:
            return []
        # Emitted tokens are at most 1 + k: stay within max_tokens and max_model_len.
        k = min(cfg.num_speculative_tokens, max_tokens, req.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_computed_tokens - 1)
        if k <= 0 or not can_draft(req):
            return []
        st = self._states.get(req)
        if st is None:
            st = self._states[req] = _ReqSpec(cfg)
        k = st.tracker.draft_len(k)
        return st.index.propose(req.all_token_ids, k) if k else []

    def update(self, sched, s: "ScheduledRequest", runner_out: ModelRunnerOutput) -> tuple[Optional[EngineCoreOutput], bool]:
        """Apply one verified step of a request that had drafts: returns (its output, or
        None when the step produced nothing; whether it finished)."""
        req = s.request
        drafts = s.spec_token_ids
        toks = runner_out.spec_token_ids.get(req.request_id)
        if not toks:  # no sample (should not happen): keep only the real token's KV
            req.num_computed_tokens += s.num_scheduled_tokens - len(drafts)
            return None, False
        accepted = len(toks) - 1
        req.num_computed_tokens += s.num_scheduled_tokens - (len(drafts) - accepted)
        self._observe(req, len(drafts), accepted)
        emitted, stopped = [], False
        for tok in toks:
            req.append_output_token_ids(tok)
            emitted.append(tok)
            if sched._check_stop(req):
                stopped = True
                break
        if not stopped and sched.needs_kv:
            kv = sched.kv_cache_manager
            kv.trim(req, req.num_computed_tokens + 1)
            kv.cache_blocks(req, req.num_computed_tokens)
        lps = runner_out.logprobs.get(req.request_id)
        if lps is not None and len(emitted) < len(lps.ranks):
            n = len(emitted)
            lps = LogprobsLists(lps.token_ids[:n], lps.logprobs[:n], lps.ranks[:n])
        return EngineCoreOutput(
            req.request_id, emitted, lps, None, req.get_finished_reason() if stopped else None,
            req.stop_reason if stopped else None, max(req.num_cached_tokens, 0),
            req.take_events() if req.events else None), stopped

    def _observe(self, req: "Request", num_draft: int, num_accepted: int) -> None:
        st = self._states.get(req)
        if st is not None:
            st.tracker.observe(num_draft, num_accepted)
        self._stats.observe_draft(num_draft, num_accepted)
        self.totals.observe_draft(num_draft, num_accepted)

    def take_stats(self) -> Optional[SpecDecodingStats]:
        """The counts since the last call (None when nothing was drafted)."""
        st = self._stats
        if not st.num_drafts:
            return None
        self._stats = SpecDecodingStats(num_spec_tokens=self.config.num_speculative_tokens)
        return st
