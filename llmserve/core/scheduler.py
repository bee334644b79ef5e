"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

One step: first the running requests (decodes, and prompts part-way through a chunked
prefill), then waiting ones while the token budget (max_num_batched_tokens), the request
cap (max_num_seqs) and the KV blocks allow. When a running request cannot get a block,
the lowest-priority, latest-arriving running request is preempted: its blocks are freed
and it goes back to the front of the waiting queue, to be recomputed later with the same
tokens. Follows vLLM's v1 Scheduler. No torch here.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Iterable, Optional

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.fair_share import FairShare
from llmserve.core.beam_search import BeamSearchManager
from llmserve.core.kv_cache_coordinator import HybridKVCacheManager
from llmserve.core.kv_cache_manager import KVCacheManager, max_blocks_held
from llmserve.core.outputs import EngineCoreOutput, ModelRunnerOutput
from llmserve.core.request import Request, RequestStatus
from llmserve.core.sched_output import ScheduledRequest, SchedulerOutput
from llmserve.core.timeline import (PREEMPTED_FAIR_SHARE, PREEMPTED_KV_CACHE_FULL, record_preempted,
                                    record_scheduled)
from llmserve.lora import scheduling as lora_sched
from llmserve.metrics.stats import SchedulerStats
from llmserve.sampling_params import SamplingParams

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest", "ModelRunnerOutput"]

logger = logging.getLogger(__name__)


class Scheduler:
    """Args: scheduler_config, cache_config, num_blocks (KV blocks available).

    Streaming-input (resumable) requests: when one answers its chunk it is kept, with its
    KV blocks, in ``WAITING_FOR_STREAMING_INPUT`` (outside ``running``/``waiting``) until
    ``update_streaming_request`` gives it the next chunk or closes its input.

    Pooling requests (``request.pooling_params``) are scheduled whole (never chunked) and
    finish in the step that runs them, with the pooled vector; a generating model's
    embedding (``hidden_state_embed``) is chunked like a prompt and finishes with its last chunk. ``needs_kv=False`` (an
    encoder model) allocates and caches no KV blocks at all. ``enable_kv_cache_events``:
    the KV cache manager records block events (``--kv-events-config``).
    ``kv_sliding_window``: the window of a model whose every layer is windowed; blocks it
    has left are freed while requests run (``KVCacheManager``); None: kept to the end.
    ``kv_cache_groups``: the window (None: full attention) of each KV cache group the model
    runner laid out; two or more (a hybrid model, e.g. Gemma 2/3) give each request one
    block table per group (``HybridKVCacheManager``, ``ScheduledRequest.group_block_ids``);
    one is the same as ``kv_sliding_window``."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 needs_kv: bool = True, structured_output_manager=None, lora_config=None,
                 speculative_config=None, kv_connector=None, enable_kv_cache_events: bool = False,
                 kv_sliding_window: Optional[int] = None,
                 kv_cache_groups: Optional[list[Optional[int]]] = None) -> None:
        self.config = scheduler_config
        # The scheduler side of a KV connector (llmserve/kv_transfer); None: off.
        self.connector = kv_connector
        # n-gram speculative decoding (llmserve/spec_decode/scheduling.py); None: off.
        self.spec = None
        if speculative_config is not None:
            from llmserve.spec_decode.scheduling import SpecDecodeScheduler
            self.spec = SpecDecodeScheduler(speculative_config, scheduler_config.max_model_len)
        # Distinct adapters one step may hold (llmserve/lora/scheduling.py); 0: LoRA off.
        self.max_loras = lora_config.max_loras if lora_config is not None else 0
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        if kv_cache_groups is not None and len(kv_cache_groups) > 1:
            if kv_connector is not None:
                raise ValueError("kv_cache_groups: a KV connector needs one KV cache group "
                                 "(it saves and loads one block table per request)")
            self.kv_cache_manager = HybridKVCacheManager(num_blocks, cache_config.block_size, kv_cache_groups,
                                                         cache_config.enable_prefix_caching,
                                                         enable_kv_cache_events=enable_kv_cache_events)
        else:
            if kv_cache_groups:
                kv_sliding_window = kv_cache_groups[0]
            self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                                   cache_config.enable_prefix_caching,
                                                   enable_kv_cache_events=enable_kv_cache_events,
                                                   sliding_window=kv_sliding_window)
        self.kv_group_windows = getattr(self.kv_cache_manager, "group_windows", None) or [kv_sliding_window]
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.needs_kv = needs_kv
        self._priority = scheduler_config.policy == "priority"
        # Tenants' weighted fair share of admissions and preemptions (core/fair_share.py).
        self.fair_share = FairShare() if getattr(scheduler_config, "tenant_fair_share", True) else None
        self.num_preemptions_total = 0
        self._step_preemptions = 0
        # Outputs produced outside a step (a closed streaming session), sent with the next.
        self._pending_outputs: list[EngineCoreOutput] = []
        # Structured outputs (see structured_output/manager.py): requests whose grammar is
        # compiling wait in waiting_for_fsm, outside ``waiting``; _num_structured counts the
        # live constrained requests so that steps without any do no grammar work at all.
        self.structured_output_manager = structured_output_manager
        self.waiting_for_fsm: list[Request] = []
        self._num_structured = 0
        # Beam search (core/beam_search.py): groups of beams, and the partial KV blocks
        # their forks copy before the next forward.
        self.beam = BeamSearchManager(self)
        self.pending_block_copies: list[tuple[int, int]] = []

    # ---- queue management --------------------------------------------------
    def add_request(self, request: Request) -> None:
        max_blocks = self.kv_cache_manager.pool.num_blocks - 1
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"The prompt ({request.num_prompt_tokens} tokens) is longer than the maximum "
                f"model length of {self.max_model_len}.")
        if self._max_blocks_held(request) > max_blocks:
            # It could never run to completion even alone; preemption would loop forever.
            raise ValueError(
                f"The request needs up to {min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)} "
                f"tokens of KV cache but the cache holds only {max_blocks * self.block_size} tokens.")
        if request.beam_search_params is not None:
            request = self.beam.first_beam(request)  # the group's first beam is what runs
        self.requests[request.request_id] = request
        if self.fair_share is not None:
            self.fair_share.add(request)
        if request.structured_output_request is not None:
            self._num_structured += 1
            if not request.structured_output_request.is_ready():
                request.status = RequestStatus.WAITING_FOR_FSM
                self.waiting_for_fsm.append(request)
                return
        self.waiting.append(request)

    def _max_blocks_held(self, request: Request) -> int:
        """The most KV blocks ``request`` can hold at once: all of its tokens' blocks, or
        fewer in groups with a sliding window (``max_blocks_held``: a step runs at
        most max_num_batched_tokens tokens)."""
        return max_blocks_held(self.kv_group_windows,
                               min(request.num_prompt_tokens + request.max_tokens, self.max_model_len),
                               self.block_size, self.config.max_num_batched_tokens)

    def _scheduled(self, req: Request, n: int, draft: list[int]) -> ScheduledRequest:
        """The step's entry for ``req`` (``n`` tokens): its block table, and with several
        KV cache groups (a hybrid model) every group's."""
        kv = self.kv_cache_manager
        s = ScheduledRequest(req, req.num_computed_tokens, n, kv.get_block_ids(req.request_id), draft)
        if isinstance(kv, HybridKVCacheManager):
            s.group_block_ids = kv.get_group_block_ids(req.request_id)
        return s

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests: their blocks are freed at once."""
        done = []
        for rid in request_ids:
            if self.beam.groups and self.beam.abort(rid):
                continue
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_FSM:
                self.waiting_for_fsm.remove(req)
                req.structured_output_request.cancel()
            else:
                try:
                    self.waiting.remove(req)
                except ValueError:
                    pass
            req.status = status
            self._free_request(req)
            done.append(req)
        return done

    def _free_request(self, req: Request) -> None:
        if req.structured_output_request is not None:
            self._num_structured -= 1
        if self.connector is not None:
            self.connector.request_finished(req, self.kv_cache_manager.get_block_ids(req.request_id))
        self.kv_cache_manager.free(req)
        if self.fair_share is not None and req.request_id in self.requests:
            self.fair_share.remove(req)
        self.finished_req_ids.add(req.request_id)
        self.requests.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._pending_outputs or self.waiting_for_fsm)

    def has_requests_to_schedule(self) -> bool:
        if self.waiting_for_fsm:
            self._promote_compiled()
        return bool(self.waiting or self.running)

    def _promote_compiled(self) -> None:
        """Move requests whose grammar finished compiling to the waiting queue; one whose
        grammar failed to compile finishes (aborted) with the error logged."""
        for req in [r for r in self.waiting_for_fsm if r.structured_output_request.is_ready()]:
            self.waiting_for_fsm.remove(req)
            err = req.structured_output_request.error
            if err is None:
                req.status = RequestStatus.WAITING
                self.waiting.append(req)
                continue
            logger.error("Request %s: its grammar failed to compile: %s", req.request_id, err)
            req.status = RequestStatus.FINISHED_ABORTED
            self._free_request(req)
            self._pending_outputs.append(EngineCoreOutput(
                req.request_id, [], finish_reason=req.get_finished_reason(), events=req.take_events()))

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outs, self._pending_outputs = self._pending_outputs, []
        return outs

    # ---- streaming input ---------------------------------------------------
    def update_streaming_request(self, request_id: str, token_ids: list[int],
                                 sampling_params: Optional[SamplingParams], final: bool) -> None:
        """Queue the next input chunk of a resumable request (and/or close its input).
        Raises ValueError when the request is not resumable or the chunk would take it
        past max_model_len. A request already finished or aborted is ignored."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished():
            return
        if not req.resumable:
            raise ValueError(f"Request {request_id!r} does not take streaming input.")
        if token_ids:
            total = req.num_computed_tokens + sum(len(t) for t, _ in req.streaming_queue) + len(token_ids)
            if total > self.max_model_len:
                raise ValueError(f"The streamed prompt ({total} tokens) is longer than the maximum "
                                 f"model length of {self.max_model_len}.")
            req.streaming_queue.append((list(token_ids), sampling_params))
        if final:
            req.input_closed = True
        if req.status == RequestStatus.WAITING_FOR_STREAMING_INPUT:
            self._resume_session(req)

    def _next_chunk(self, req: Request) -> bool:
        """Start the request's next input chunk. Returns True when it must first wait for
        a new grammar to compile (its chunk brought another structured-outputs constraint)."""
        token_ids, params = req.streaming_queue.popleft()
        req.append_prompt_chunk(token_ids, params, self.block_size)
        self.finished_req_ids.add(req.request_id)  # the runner rebuilds its state for it
        had = req.structured_output_request is not None
        if not had and req.sampling_params.structured_outputs is None:
            return False
        # The new generation starts its grammar over (a matcher left at the end of the
        # previous answer would forbid or wrongly allow the new answer's tokens).
        self.structured_output_manager.grammar_restart(req)
        sor = req.structured_output_request
        self._num_structured += (sor is not None) - had
        return sor is not None and not sor.is_ready()

    def _resume_session(self, req: Request) -> None:
        """A parked session got input: schedule its next chunk, or finish it."""
        if req.streaming_queue:
            if self._next_chunk(req):
                req.status = RequestStatus.WAITING_FOR_FSM
                self.waiting_for_fsm.append(req)
                return
            req.status = RequestStatus.WAITING
            self.waiting.append(req)
        elif req.input_closed:
            req.status = req.session_stop_status
            self._free_request(req)
            self._pending_outputs.append(EngineCoreOutput(
                req.request_id, [], finish_reason=req.get_finished_reason(), stop_reason=req.stop_reason,
                num_cached_tokens=max(req.num_cached_tokens, 0), events=req.take_events()))

    def _continue_session(self, req: Request) -> bool:
        """A resumable request answered its chunk (``_check_stop`` set its finished
        status). Returns True when it goes on: with the next queued chunk at once, or
        parked until one arrives; False when its input is closed and it is done."""
        if req.streaming_queue:
            # Waiting for a new grammar: update_from_output moves it to waiting_for_fsm.
            req.status = RequestStatus.WAITING_FOR_FSM if self._next_chunk(req) else RequestStatus.RUNNING
            return True
        if req.input_closed:
            return False
        req.session_stop_status = req.status
        req.status = RequestStatus.WAITING_FOR_STREAMING_INPUT
        return True

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_fsm)

    # ---- scheduling --------------------------------------------------------
    def _pick_victim(self) -> Request:
        victim = self.fair_share.victim(self.running, self._priority) if self.fair_share else None
        if victim is not None:
            return victim
        if self._priority:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt_for_fair_share(self) -> Optional[str]:
        """Fair share: free a seat of a full batch for a tenant below its weighted share
        (``FairShare.seat_victim``); the id of the request preempted, or None. Not with
        beam groups (their seats are reserved as a block) or LoRA seat limits."""
        if self.fair_share is None or not self.waiting or self.beam.groups or self.max_loras:
            return None
        victim = self.fair_share.seat_victim(self.waiting, self.running, self.config.max_num_seqs, self._priority)
        if victim is None or victim.status != RequestStatus.RUNNING:
            return None
        self._preempt(victim, PREEMPTED_FAIR_SHARE)
        return victim.request_id

    def _preempt(self, req: Request, reason: str = PREEMPTED_KV_CACHE_FULL) -> None:
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        record_preempted(req, reason)
        self.num_preemptions_total += 1
        self._step_preemptions += 1
        self.waiting.appendleft(req)

    def _next_waiting(self) -> Request:
        fair = self.fair_share.pick(self.waiting, self._priority, self.running, self.config.max_num_seqs) \
            if self.fair_share else None
        if fair is not None:
            return fair
        if self._priority:
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return self.waiting[0]

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their KV blocks."""
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput()
        scheduled: dict[str, int] = {}
        admitted: dict[str, int] = {}  # left the waiting queue: id -> prefix-cache hit tokens
        preempted: set[str] = set()
        self._step_preemptions = 0
        if self.waiting_for_fsm:
            self._promote_compiled()

        fair_preempted = self._preempt_for_fair_share()
        if self._priority:
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        i = 0
        drafts: dict[str, list[int]] = {}  # speculative decoding: request id -> draft tokens
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = req.num_tokens - req.num_computed_tokens
            n = min(n, budget, self.max_model_len - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            if self.spec is not None and n == 1:
                draft = self.spec.propose(req, budget - 1, len(self.running))
                if draft:
                    drafts[req.request_id] = draft
                    n += len(draft)
            while True:
                if self.kv_cache_manager.allocate_slots(req, n) is not None:
                    break
                if drafts.pop(req.request_id, None):  # drop the drafts before preempting anyone
                    n = 1
                    continue
                victim = self._pick_victim()
                self._preempt(victim)
                preempted.add(victim.request_id)
                scheduled.pop(victim.request_id, None)
                if victim is req:
                    break
            if req.request_id in preempted:
                continue  # req left self.running; index i now points at the next one
            scheduled[req.request_id] = n
            budget -= n
            i += 1
        # Budget given back by requests preempted after being scheduled.
        budget = self.config.max_num_batched_tokens - sum(scheduled.values())

        if not preempted:
            encoder_budget = self.config.max_num_encoder_input_tokens
            lora_active = lora_sched.active_lora_ids(self.running) if self.max_loras else None
            lora_skipped: list[Request] = []  # their adapter would exceed max_loras: next step
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self._next_waiting()
                if lora_active is not None and not lora_sched.admits(req, lora_active, self.max_loras):
                    self.waiting.remove(req)
                    lora_skipped.append(req)
                    continue
                if self.beam.groups and len(self.running) + self.beam.reserved_seats() + \
                        self.beam.seats_needed(req) > self.config.max_num_seqs:
                    break  # max_num_seqs counts beams: a group reserves beam_width seats
                enc = req.num_encoder_tokens if not req.encoder_scheduled else 0
                if enc and enc > encoder_budget and encoder_budget < self.config.max_num_encoder_input_tokens:
                    break  # its encoder waits for the next step's budget
                computed_blocks, num_hit, num_ext = [], 0, 0
                if req.num_computed_tokens == 0:
                    computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(req)
                    if self.connector is not None:  # tokens an external KV tier holds past the RAM hit
                        num_ext = self.connector.get_num_new_matched_tokens(req, num_hit)[0]
                n = req.num_tokens - req.num_computed_tokens - num_hit - num_ext
                # a pooling model's request runs whole; a generating model's embedding
                # (hidden_state_embed) is chunked like any prompt and pools at its end
                whole = req.pooling_params is not None and not req.pooling_params.hidden_state_embed
                if n > budget and (not self.config.enable_chunked_prefill or whole):
                    break
                n = min(n, budget)
                new_blocks = self.kv_cache_manager.allocate_slots(req, num_ext + n, computed_blocks) \
                    if self.needs_kv else []
                if new_blocks is None:
                    break
                if self.connector is not None:  # the first num_ext tokens' blocks are loaded, not computed
                    self.connector.update_state_after_alloc(req, [b.block_id for b in new_blocks], num_ext)
                self.waiting.remove(req)
                if enc:
                    encoder_budget -= enc
                    req.encoder_scheduled = True
                req.num_computed_tokens += num_hit + num_ext
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit + num_ext
                req.status = RequestStatus.RUNNING
                admitted[req.request_id] = num_hit + num_ext
                self.running.append(req)
                if req.beam_group is not None:
                    req.beam_group.started = True
                scheduled[req.request_id] = n
                budget -= n
                if self.fair_share is not None:  # charged now, so this step's next pick sees it
                    self.fair_share.charge(((req, n),))
            self.waiting.extendleft(reversed(lora_skipped))

        for req in self.running:
            n = scheduled.get(req.request_id)
            if n:
                out.scheduled.append(self._scheduled(req, n, drafts.get(req.request_id, [])))
        record_scheduled(out.scheduled, admitted)  # the timeline's prefill events (core/timeline.py)
        self._last_batch_size = len(out.scheduled)
        out.total_num_scheduled_tokens = sum(s.num_scheduled_tokens for s in out.scheduled)
        if self.fair_share is not None:
            self.fair_share.charge((s.request, s.num_scheduled_tokens) for s in out.scheduled
                                   if s.request.request_id not in admitted)  # admitted: charged above
        if self._num_structured:
            out.grammar_bitmask, out.structured_output_request_ids = \
                self.structured_output_manager.grammar_bitmask(out.scheduled)
        out.finished_req_ids = self.finished_req_ids
        out.preempted_req_ids = preempted | ({fair_preempted} if fair_preempted else set())
        self.finished_req_ids = set()
        if self.pending_block_copies:
            out.blocks_to_copy, self.pending_block_copies = self.pending_block_copies, []
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    # ---- results -----------------------------------------------------------
    def _check_stop(self, req: Request) -> bool:
        sp = req.sampling_params
        n_out = req.num_output_tokens
        if req.num_tokens >= self.max_model_len or n_out >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if n_out < sp.min_tokens:
            return False
        last = req.output_token_ids[-1]
        if not sp.ignore_eos and last == req.eos_token_id:
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in sp.all_stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = last
            return True
        return False

    def _roll_back_failed_loads(self, sched_out: SchedulerOutput, bad: set[int]) -> set[str]:
        """Requests of this step with a block whose KV the connector failed to load (a disk
        tier file that was corrupt or gone; vLLM's "recompute" load-failure policy): their
        computed tokens go back to the first such block and the rest is prefilled again,
        so this step's token is dropped. Returns their ids."""
        redo = set()
        for s in sched_out.scheduled:
            first = next((i for i, b in enumerate(s.block_ids) if b in bad), None)
            if first is None:
                continue
            req = s.request
            req.num_computed_tokens = min(req.num_computed_tokens, first * self.block_size)
            req.num_cached_tokens = min(req.num_cached_tokens, req.num_computed_tokens)
            redo.add(req.request_id)
        return redo

    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed-token counts, append sampled tokens, check stops, free
        finished requests. Returns one EngineCoreOutput (the wire struct itself) per
        request with news, after any pending outputs."""
        outputs = self.take_pending_outputs() if self._pending_outputs else []
        finished: list[Request] = []
        parked: list[Request] = []
        beam_groups: dict = {}  # BeamGroup -> None, in step order
        redo = self._roll_back_failed_loads(sched_out, runner_out.invalid_block_ids) \
            if runner_out.invalid_block_ids else ()
        for s in sched_out.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if req.request_id in redo:
                continue  # its step ran over KV that failed to load: no output, computed again
            if s.spec_token_ids:  # verified drafts: tokens appended, KV rolled back there
                eco, stopped = self.spec.update(self, s, runner_out)
                if eco is not None:
                    outputs.append(eco)
                if stopped:
                    finished.append(req)
                continue
            req.num_computed_tokens += s.num_scheduled_tokens
            if self.needs_kv:
                self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
            if req.pooling_params is not None:
                if req.num_computed_tokens >= req.num_tokens:  # else a chunk of its prompt ran
                    self._finish_pooling(req, runner_out, outputs, finished)
                continue
            tok = runner_out.sampled_token_ids.get(req.request_id)
            if req.beam_group is not None:
                if tok is not None:  # the beam's top-K row; its group steps below
                    self.beam.on_row(req, runner_out.logprobs.get(req.request_id))
                    beam_groups[req.beam_group] = None
                if req.events:  # the first beam's timeline events, under the request's id
                    outputs.append(EngineCoreOutput(req.beam_group.request_id, [], events=req.take_events()))
                continue
            plp = runner_out.prompt_logprobs.get(req.request_id)
            if tok is None:
                if plp is not None or req.events:  # a prefill chunk's events go out at once (live view)
                    outputs.append(EngineCoreOutput(req.request_id, [], None, plp,
                                                    num_cached_tokens=max(req.num_cached_tokens, 0),
                                                    events=req.take_events()))
                continue
            req.append_output_token_ids(tok)
            stopped = self._check_stop(req)
            if req.structured_output_request is not None and \
                    self.structured_output_manager.accept_token(req, tok) and not stopped:
                # The grammar is complete (it accepted a stop token, e.g. under ignore_eos).
                req.status = RequestStatus.FINISHED_STOPPED
                stopped = True
            if stopped and req.resumable and self._continue_session(req):
                stopped = False
                if req.status in (RequestStatus.WAITING_FOR_STREAMING_INPUT, RequestStatus.WAITING_FOR_FSM):
                    parked.append(req)
            outputs.append(EngineCoreOutput(
                req.request_id, [tok], runner_out.logprobs.get(req.request_id), plp,
                req.get_finished_reason() if stopped else None, req.stop_reason if stopped else None,
                max(req.num_cached_tokens, 0), req.take_events() if req.events else None))
            if stopped:
                finished.append(req)
        for req in finished:
            self.running.remove(req)
            self._free_request(req)
        for req in parked:
            self.running.remove(req)
            if req.status == RequestStatus.WAITING_FOR_FSM:
                self.waiting_for_fsm.append(req)
        if beam_groups:
            outputs.extend(self.beam.step_ready_groups(beam_groups))
        return outputs

    def _finish_pooling(self, req: Request, runner_out: ModelRunnerOutput, outputs: list[EngineCoreOutput],
                        finished: list[Request]) -> None:
        """A pooling request ran its whole prompt: it finishes with its pooled vector."""
        req.status = RequestStatus.FINISHED_STOPPED
        outputs.append(EngineCoreOutput(
            req.request_id, [], finish_reason=req.get_finished_reason(),
            num_cached_tokens=max(req.num_cached_tokens, 0), events=req.take_events() if req.events else None,
            pooling_output=runner_out.pooler_output.get(req.request_id)))
        finished.append(req)

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        st = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_used_blocks=kv.num_used_blocks,
            num_total_blocks=kv.pool.num_blocks - 1,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self._step_preemptions,
            num_scheduled_reqs=getattr(self, "_last_batch_size", 0),
        )
        if self.max_loras:
            st.max_lora = self.max_loras
            st.running_lora_adapters = lora_sched.adapter_counts(self.running)
            st.waiting_lora_adapters = lora_sched.adapter_counts(self.waiting)
        if self.spec is not None:
            st.spec_decoding_stats = self.spec.take_stats()
        if self.connector is not None:
            st.kv_connector_stats = self.connector.get_stats()
        kv.prefix_cache_queries = kv.prefix_cache_hits = 0
        return st
