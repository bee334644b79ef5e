"""Beam search inside the engine: the beams of a request are rows of the same steps.

A beam-search request (``Request.beam_search_params``) enters the scheduler as one beam,
a Request of its own (id ``<request id>#0``), that prefills the prompt once. Each beam
asks the runner for its top-K logprobs (K = beams_to_keep, below) instead of a
sampled token: ``log_softmax(logits / temperature)`` (``Request.beam_temperature``; vLLM
scores beams on the logprobs of the temperature-scaled logits), the raw logprobs with
temperature 0 (the default) or 1. When every live beam of the group has its row, ``BeamGroup.step`` picks the
next beams exactly as transformers' ``_beam_search`` (generation/utils.py, 5.x) does:

* candidates: every (beam, token) with score cum_logprob + logprob; the best
  K = max(2, 1 + number of stop ids) * beam_width of them, best first;
* a candidate hits a stop when its token is a stop id (EOS, unless ignore_eos) or the
  generated length reaches max_tokens (or max_model_len); among the best beam_width
  candidates, those are finished hypotheses scored ``cum / generated_len **
  length_penalty``; the beam_width best hypotheses are kept (not added once the list is
  full with early_stopping=True, nor once the early-stop heuristic says no improvement
  is possible); the best beam_width candidates that did not hit a stop run on;
* the search ends when no running beam can improve the hypotheses (heuristic: the best
  running score over the current generated length, or max_tokens for "never" with a
  positive length_penalty, against the worst kept hypothesis), when the hypotheses are
  full under early_stopping=True, or when every candidate hit a stop.

Forks: a parent with m surviving continuations keeps its Request for the first one; the
other m - 1 are new Requests that share the parent's full KV blocks by reference count,
with the last partial block copied (``KVCacheManager.fork``, the runner copies it before
the step's forward: ``SchedulerOutput.blocks_to_copy``). A parent with no continuation is
freed at once. Every beam is a running request, so ``max_num_seqs`` counts beams
(admission reserves beam_width seats per group), preemption by recompute works per beam
(the group waits for a preempted beam's row; the prefix cache finds the shared blocks
again), and beam rows sit in the same batch as ordinary requests. No torch here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from llmserve.core.outputs import BeamSequenceOutput, EngineCoreOutput, FinishReason, LogprobsLists
from llmserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from llmserve.core.scheduler import Scheduler

__all__ = ["BeamGroup", "BeamSearchManager"]


@dataclass(slots=True)
class _Hypothesis:
    score: float
    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    finish_reason: FinishReason
    stop_reason: Optional[int]


class BeamGroup:
    """The live beams (Requests, best first) and the finished hypotheses of one request.

    ``beams[i].beam_cum`` is beam i's cumulative logprob, ``beams[i].beam_logprobs`` the
    logprob of each of its generated tokens; ``rows`` holds the top-K (ids, logprobs) of
    the beams whose row came back and that still wait for the rest of the group."""

    def __init__(self, request: Request, stop_ids: frozenset[int], max_model_len: int) -> None:
        p = request.beam_search_params
        self.request_id = request.request_id
        self.params = p
        self.width = p.beam_width
        self.stop_ids = stop_ids
        self.keep = max(2, 1 + len(stop_ids)) * p.beam_width
        self.max_new = min(request.max_tokens, p.max_tokens, max_model_len - request.num_prompt_tokens)
        self.num_generated = 0
        self.hyps: list[_Hypothesis] = []
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.rows: dict[str, tuple[list[int], list[float]]] = {}
        self.beams: list[Request] = []
        self.started = False  # admitted once: holds beam_width seats
        self.first_token_ts = 0.0  # time.monotonic() of the first step (the timeline's first_token)
        self._next_id = 0

    def new_beam_id(self) -> str:
        rid = f"{self.request_id}#{self._next_id}"
        self._next_id += 1
        return rid

    def has_all_rows(self) -> bool:
        return all(b.request_id in self.rows for b in self.beams)

    # ---- one step (transformers' _beam_search loop body) --------------------
    def _candidates(self) -> list[tuple[float, int, int, float]]:
        """The best K (score, beam index, token, logprob), best first (ties: lower beam
        index, then lower token id, as topk over the flattened [beam, vocab] scores)."""
        cands = []
        for i, b in enumerate(self.beams):
            ids, lps = self.rows[b.request_id]
            cands.extend((b.beam_cum + lp, i, t, lp) for t, lp in zip(ids[:self.keep], lps[:self.keep]))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        return cands[:self.keep]

    def _add_hypotheses(self, cands, hits: list[bool]) -> None:
        full = len(self.hyps) == self.width
        if (full and self.params.early_stopping is True) or not self.improvable:
            return
        gen_len = self.num_generated + 1
        for (score, i, tok, lp), hit in zip(cands[:self.width], hits):
            if not hit:
                continue
            b = self.beams[i]
            stop = tok in self.stop_ids
            self.hyps.append(_Hypothesis(
                score / gen_len ** self.params.length_penalty, b.output_token_ids + [tok],
                b.beam_logprobs + [lp], score, FinishReason.STOP if stop else FinishReason.LENGTH,
                tok if stop and tok != b.eos_token_id else None))
        self.hyps.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        del self.hyps[self.width:]

    def _update_improvable(self, running) -> None:
        if len(self.hyps) < self.width or not running:
            return
        p = self.params
        hyp_len = self.max_new if p.early_stopping == "never" and p.length_penalty > 0 else self.num_generated
        best = running[0][0] / hyp_len ** p.length_penalty
        self.improvable = self.improvable and best > self.hyps[-1].score

    def step(self) -> Optional[list[tuple[float, int, int, float]]]:
        """Choose the next beams from the rows of this step. Returns them (score, parent
        index, token, logprob), best first, or None when the search is over."""
        if not self.num_generated:
            self.first_token_ts = time.monotonic()
        cands = self._candidates()
        at_max = self.num_generated + 1 >= self.max_new
        hits = [at_max or c[2] in self.stop_ids for c in cands]
        running = [c for c, h in zip(cands, hits) if not h][:self.width]
        self._add_hypotheses(cands, hits)
        self.num_generated += 1
        self.rows.clear()
        self._update_improvable(running)
        if not running or not self.improvable or (
                self.params.early_stopping is True and len(self.hyps) == self.width):
            return None
        return running

    def result(self) -> list[BeamSequenceOutput]:
        return [BeamSequenceOutput(h.token_ids, h.logprobs, h.cum_logprob, h.score, h.finish_reason, h.stop_reason)
                for h in self.hyps]

    def result_so_far(self) -> list[BeamSequenceOutput]:
        """The best ``width`` sequences of a search ended early (aborted: a deadline, the
        server's shutdown), best first, ranked as the search ranks them at its end
        (transformers' ``finalize``): the finished hypotheses and every running beam,
        scored ``cum_logprob / generated_len ** length_penalty``; on a tie a finished
        hypothesis comes first. A running beam's finish_reason is ABORT; a finished
        one keeps its own (``beam_completions`` drops its EOS by it). Padded with empty
        ABORT sequences to ``width`` (a search stopped before its first step)."""
        lp = self.params.length_penalty
        hyps = [(h.score, h.token_ids, h.logprobs, h.cum_logprob, h.finish_reason, h.stop_reason) for h in self.hyps]
        run = [(b.beam_cum / len(b.beam_logprobs) ** lp if b.beam_logprobs else 0.0, list(b.output_token_ids),
                list(b.beam_logprobs), b.beam_cum, FinishReason.ABORT, None) for b in self.beams]
        ranked = sorted(hyps + run, key=lambda h: -h[0])[:self.width]  # stable: hypotheses win ties
        ranked += [(0.0, [], [], 0.0, FinishReason.ABORT, None)] * (self.width - len(ranked))
        return [BeamSequenceOutput(t, l, c, s, f, r) for s, t, l, c, f, r in ranked]


def _clone_beam(parent: Request, rid: str) -> Request:
    """A new beam with the parent's tokens, state and logprobs (before this step's token)."""
    child = Request(rid, parent.prompt_token_ids, parent.sampling_params, parent.eos_token_id,
                    parent.arrival_time, parent.priority, encoder_inputs=parent.encoder_inputs)
    for tok in parent.output_token_ids:
        child.append_output_token_ids(tok)
    child.block_hashes = list(parent.block_hashes)
    child.beam_group = parent.beam_group
    child.beam_cum, child.beam_logprobs = parent.beam_cum, list(parent.beam_logprobs)
    child.encoder_scheduled = parent.encoder_scheduled
    child.encoder_cache_key = parent.encoder_cache_key
    child.num_cached_tokens = parent.num_cached_tokens
    child.tenant, child.tenant_weight = getattr(parent, "tenant", None), getattr(parent, "tenant_weight", 1.0)
    child.lora_request = parent.lora_request  # every beam runs with the request's adapter
    child.beam_temperature = parent.beam_temperature
    return child


class BeamSearchManager:
    """The scheduler's beam groups: creates the first beam of a request, collects the
    beams' rows, runs the groups' steps (forking and freeing beams) and reports finished
    groups. ``scheduler`` is the owning Scheduler (its queues and KV cache manager)."""

    def __init__(self, scheduler: "Scheduler") -> None:
        self.sched = scheduler
        self.groups: dict[str, BeamGroup] = {}

    def first_beam(self, request: Request) -> Request:
        """Register a beam-search request; returns its first beam (to be queued)."""
        sp = request.sampling_params
        stop = set() if request.beam_search_params.ignore_eos or request.eos_token_id is None \
            else {request.eos_token_id}
        stop |= set(sp.all_stop_token_ids)
        group = BeamGroup(request, frozenset(stop), self.sched.max_model_len)
        beam = _clone_beam_from_request(request, group)
        self.groups[group.request_id] = group
        group.beams.append(beam)
        return beam

    def seats_needed(self, req: Request) -> int:
        """Seats (``max_num_seqs``) admitting ``req`` takes beyond those already reserved:
        beam_width for a group's first admission, 0 for a (preempted) beam of a started
        group, 1 for any other request."""
        g = req.beam_group
        if g is None:
            return 1
        return 0 if g.started else g.width

    def reserved_seats(self) -> int:
        """Seats held by started groups for beams not running now."""
        running = RequestStatus.RUNNING
        return sum(g.width - sum(1 for b in g.beams if b.status == running)
                   for g in self.groups.values() if g.started)

    def on_row(self, beam: Request, logprobs: Optional[LogprobsLists]) -> None:
        """A beam's top-K row of this step (the first entry, the sampled token, is skipped)."""
        if logprobs is None:
            return
        self.beam_row(beam, logprobs.token_ids[0][1:], logprobs.logprobs[0][1:])

    def beam_row(self, beam: Request, ids: list[int], lps: list[float]) -> None:
        beam.beam_group.rows[beam.request_id] = (ids, lps)

    def step_ready_groups(self, groups: set) -> list[EngineCoreOutput]:
        """Run the step of each group in ``groups`` that has all its rows; returns the
        outputs of the groups that finished."""
        outs = []
        for g in groups:
            if g.request_id not in self.groups or not g.has_all_rows():
                continue
            nxt = g.step()
            if nxt is None:
                outs.append(self._finish(g))
            else:
                self._advance(g, nxt)
        return outs

    def _advance(self, g: BeamGroup, nxt) -> None:
        """Apply the chosen continuations: fork, extend, free."""
        children: dict[int, list] = {}
        for c in nxt:
            children.setdefault(c[1], []).append(c)
        new_beams: list[tuple[float, Request]] = []
        for i, parent in enumerate(g.beams):
            conts = children.get(i)
            if not conts:
                self._drop(parent)
                continue
            for score, _, tok, lp in conts[1:]:
                child = self._fork(g, parent)
                self._extend(child, score, tok, lp)
                new_beams.append((score, child))
            score, _, tok, lp = conts[0]
            self._extend(parent, score, tok, lp)
            new_beams.append((score, parent))
        new_beams.sort(key=lambda sb: -sb[0])
        g.beams = [b for _, b in new_beams]

    @staticmethod
    def _extend(beam: Request, score: float, tok: int, lp: float) -> None:
        beam.append_output_token_ids(tok)
        beam.beam_cum = score
        beam.beam_logprobs.append(lp)

    def _fork(self, g: BeamGroup, parent: Request) -> Request:
        s = self.sched
        child = _clone_beam(parent, g.new_beam_id())
        s.requests[child.request_id] = child
        if parent.status != RequestStatus.RUNNING:  # preempted after its row came back
            child.status = parent.status
            s.waiting.appendleft(child)
            return child
        copy = s.kv_cache_manager.fork(parent, child)
        if copy is not None:  # one (src, dst), or a list of them (one per KV cache group)
            s.pending_block_copies.extend(copy if isinstance(copy, list) else [copy])
        n_blocks = len(s.kv_cache_manager.req_to_blocks[child.request_id])
        child.num_computed_tokens = min(parent.num_computed_tokens, n_blocks * s.block_size)
        child.status = RequestStatus.RUNNING
        s.running.append(child)
        return child

    def _drop(self, beam: Request) -> None:
        """A pruned beam: out of its queue, its blocks freed now."""
        s = self.sched
        if beam.status == RequestStatus.RUNNING:
            s.running.remove(beam)
        else:
            try:
                s.waiting.remove(beam)
            except ValueError:
                pass
        beam.status = RequestStatus.FINISHED_STOPPED
        s.kv_cache_manager.free(beam)
        s.finished_req_ids.add(beam.request_id)
        s.requests.pop(beam.request_id, None)

    def _release(self, g: BeamGroup) -> None:
        """The group leaves the scheduler: the fair share counted it as one request."""
        if self.sched.fair_share is not None and g.beams:
            self.sched.fair_share.remove(g.beams[0])

    def _finish(self, g: BeamGroup, aborted: bool = False) -> EngineCoreOutput:
        seqs = g.result_so_far() if aborted else g.result()
        self._release(g)
        for b in list(g.beams):
            self._drop(b)
            if aborted:
                b.status = RequestStatus.FINISHED_ABORTED
        self.groups.pop(g.request_id, None)
        self.sched.finished_req_ids.add(g.request_id)  # its encoder output (Whisper)
        cached = max(min((b.num_cached_tokens for b in g.beams), default=0), 0)
        events = [e for b in g.beams for e in (b.take_events() or ())] or None
        reason = FinishReason.ABORT if aborted else seqs[0].finish_reason if seqs else FinishReason.LENGTH
        return EngineCoreOutput(g.request_id, [], finish_reason=reason,
                                num_cached_tokens=cached, events=events, beam_sequences=seqs,
                                beam_first_token_ts=g.first_token_ts)

    def abort(self, request_id: str) -> bool:
        """Abort a beam-search request by its id: every beam freed, and its final output
        (finish_reason ABORT, the best ``beam_width`` sequences so far:
        ``BeamGroup.result_so_far``) queued for the next step's outputs, so a timed-out
        request keeps its beams (``AsyncLLM.abort`` waits for it). False if unknown."""
        g = self.groups.get(request_id)
        if g is None:
            return False
        self.sched._pending_outputs.append(self._finish(g, aborted=True))
        return True


def _clone_beam_from_request(request: Request, group: BeamGroup) -> Request:
    """The first beam of a request: its prompt, with sampling params asking the runner
    for greedy rows with ``group.keep`` logprobs. It carries the request's timeline
    events (QUEUED) and records its own (SCHEDULED, PREEMPTED), sent under the request's
    id (Scheduler.update_from_output); forked beams record none."""
    sp = request.sampling_params.clone()
    sp.temperature, sp.logprobs, sp.n = 0.0, group.keep, 1
    beam = Request(group.new_beam_id(), request.prompt_token_ids, sp, request.eos_token_id,
                   request.arrival_time, request.priority, log_stats=request.log_stats,
                   encoder_inputs=request.encoder_inputs)
    beam.events = request.events
    beam.beam_group = group
    beam.beam_cum, beam.beam_logprobs = 0.0, []
    beam.encoder_cache_key = request.request_id
    beam.tenant, beam.tenant_weight = getattr(request, "tenant", None), getattr(request, "tenant_weight", 1.0)
    beam.lora_request = request.lora_request  # the beams' rows run with the request's adapter
    beam.beam_temperature = request.beam_search_params.temperature  # rows of log_softmax(logits / T)
    return beam

