"""Front-end processing of EngineCoreOutputs (vLLM's OutputProcessor): incremental
detokenization, stop strings, logprobs with decoded tokens, RequestOutput per output
kind, n>1 merging, per-request timing stats."""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

from llmserve.core.outputs import EngineCoreEvent, EngineCoreEventType, FinishReason
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.exceptions import EngineGenerateError
from llmserve.engine.messages import EngineCoreOutput, EngineCoreRejection, EngineCoreRequest, LogprobsLists
from llmserve.engine.parallel_sampling import ParentRequest
from llmserve.engine.request_timeline import RequestTimelines, TimelineRecord
from llmserve.lora.errors import error_from_text
from llmserve.metrics.stats import FinishedRequestStats, IterationStats
from llmserve.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                              RequestOutput)
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import RequestOutputKind, SamplingParams


class RequestOutputCollector:
    """Where AsyncLLM.generate() waits for outputs of one request. If the consumer falls
    behind, outputs are merged (DELTA: concatenated; CUMULATIVE: replaced) instead of
    queued, so memory stays flat. An exception put here is raised in the consumer."""

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: Optional[RequestOutput | BaseException] = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if self.output is None or isinstance(output, BaseException):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            self.output.add(output, aggregate=self.aggregate)

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self.get_nowait()

    def get_nowait(self) -> Optional[RequestOutput]:
        """Take the pending output (None if there is none); raises a pending error."""
        out = self.output
        self.output = None
        self.ready.clear()
        if isinstance(out, BaseException):
            raise out
        return out


class _DecodedTokens:
    """Token id -> display text for logprobs, cached per tokenizer. A token that is not
    valid UTF-8 on its own is shown as its bytes (``bytes:\\xe2\\x80``), like vLLM."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decode = lru_cache(maxsize=1 << 16)(self._decode_one)

    def _decode_one(self, tid: int) -> str:
        s = self.tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if "\ufffd" in s:
            tok = self.tokenizer.convert_ids_to_tokens(tid)
            try:
                from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

                inv = {v: k for k, v in bytes_to_unicode().items()}
                raw = bytes(inv[c] for c in tok)
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            except Exception:
                return s
        return s

    def __call__(self, tid: int) -> str:
        return self._decode(tid)


@dataclass
class RequestState:
    request_id: str  # the engine's id: the caller's id plus an incarnation suffix
    external_req_id: str  # the caller's id (a child's ``i_<parent id>`` for n > 1)
    parent: Optional[ParentRequest]
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams  # PoolingParams for a pooling request
    detokenizer: Optional[IncrementalDetokenizer]  # None for a pooling request
    collector: Optional[RequestOutputCollector]
    arrival_time: float
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    prompt_logprobs: Optional[list] = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    # Engine-side time.monotonic() stamps (EngineCoreEvents, output timestamps), for the
    # queue / prefill / decode / inference times of the finished-request stats.
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    sent_token_ids: int = 0
    sent_logprobs: int = 0
    # The EngineCoreRequest as first sent, kept so that an engine restart can resume it
    # (``self_heal.resume_request``); a reference, no copy.
    engine_request: Optional[EngineCoreRequest] = None
    # Its TimelineRecord (engine/request_timeline.py) when the front end keeps timelines.
    timeline: Optional[TimelineRecord] = None

    def record_events(self, events: list[EngineCoreEvent]) -> None:
        for ev in events:
            if ev.type == EngineCoreEventType.QUEUED:
                self.queued_ts = ev.timestamp
            elif ev.type == EngineCoreEventType.SCHEDULED and not self.scheduled_ts:
                self.scheduled_ts = ev.timestamp  # the first scheduling ends the queue time

    def finished_stats(self, finish_reason: str, now: float, dropped: bool = False) -> FinishedRequestStats:
        """This request's FinishedRequestStats (``now``: time.time()). dropped: the
        caller went away (no TTFT unless a token came, no TPOT)."""
        n_gen = len(self.detokenizer.token_ids) if self.detokenizer is not None else 0
        ftt = self.first_token_time
        if dropped:
            ttft, tpot = (ftt - self.arrival_time if ftt else 0.0), 0.0
        else:
            ttft = (ftt or now) - self.arrival_time
            tpot = (now - ftt) / (n_gen - 1) if n_gen > 1 and ftt else 0.0
        sched = self.scheduled_ts
        queued = sched - self.queued_ts if sched and self.queued_ts else 0.0
        prefill = self.first_token_ts - sched if sched and self.first_token_ts else 0.0
        decode = self.last_token_ts - self.first_token_ts if self.first_token_ts else 0.0
        inference = self.last_token_ts - sched if sched and self.last_token_ts else 0.0
        return FinishedRequestStats(finish_reason, now - self.arrival_time, len(self.prompt_token_ids), n_gen,
                                    ttft, tpot, queued, prefill, decode, inference,
                                    # PoolingParams have neither field: a pooling request counts as n=1.
                                    max_tokens_param=getattr(self.params, "max_tokens", None),
                                    n_param=self.parent.n if self.parent is not None else getattr(self.params, "n", 1))


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Args: tokenizer (HF); log_stats: collect IterationStats."""

    def __init__(self, tokenizer, log_stats: bool = True) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        # The caller's request id -> the engine's id of its live incarnation. Outputs of
        # an aborted incarnation still in flight then find no state and are dropped, even
        # when a new request reuses the id at once (vLLM tags internal request ids too).
        self.external_to_internal: dict[str, str] = {}
        self._incarnations = itertools.count()
        self.decoded = _DecodedTokens(tokenizer)
        # Per-request timelines for GET /v1/requests (set by AsyncLLM; None: not kept).
        self.timelines: Optional[RequestTimelines] = None

    def engine_request_id(self, request_id: str) -> str:
        """A fresh engine-side id for a new incarnation of ``request_id`` (the caller's id)."""
        return f"{request_id}#{next(self._incarnations)}"

    def engine_ids(self, request_ids: list[str]) -> list[str]:
        """The engine ids of the live requests among ``request_ids`` (the callers' ids;
        a parent id stands for its children)."""
        out = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            for cid in (parent.child_ids if parent is not None else [rid]):
                iid = self.external_to_internal.get(cid)
                if iid is not None:
                    out.append(iid)
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float,
                    parent: Optional[ParentRequest] = None,
                    collector: Optional[RequestOutputCollector] = None,
                    external_req_id: Optional[str] = None, model: Optional[str] = None) -> None:
        """Track a request. ``request_id``: the engine's id; ``external_req_id``: the
        caller's id (default: the same); ``model``: its LoRA adapter's name, the model its
        timeline is listed under (None: the base model). Raises ValueError if the caller's
        id is live."""
        external_req_id = external_req_id or request_id
        if request_id in self.states or external_req_id in self.external_to_internal:
            raise ValueError(f"Request id {external_req_id!r} is already running.")
        self.external_to_internal[external_req_id] = request_id
        if isinstance(params, PoolingParams):  # one output, the pooled vector: nothing to detokenize
            self.states[request_id] = RequestState(
                request_id=request_id, external_req_id=external_req_id, parent=None, prompt=prompt,
                prompt_token_ids=prompt_token_ids, params=params, detokenizer=None, collector=collector,
                arrival_time=arrival_time)
            self._start_timeline(self.states[request_id], external_req_id, model)
            return
        self.states[request_id] = RequestState(
            request_id=request_id, external_req_id=external_req_id, parent=parent, prompt=prompt, prompt_token_ids=prompt_token_ids,
            params=params, detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
            collector=collector, arrival_time=arrival_time,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        if parent is not None:
            self.parents[parent.request_id] = parent
        self._start_timeline(self.states[request_id], external_req_id, model)

    def _start_timeline(self, st: RequestState, external_req_id: str, model: Optional[str] = None) -> None:
        if self.timelines is not None:
            st.timeline = self.timelines.start(external_req_id, st.arrival_time, len(st.prompt_token_ids), st.params,
                                               st.parent.request_id if st.parent is not None else None, model)

    def _forget(self, st: RequestState, reason: str = "abort", now: Optional[float] = None) -> None:
        self.states.pop(st.request_id, None)
        if self.external_to_internal.get(st.external_req_id) == st.request_id:
            del self.external_to_internal[st.external_req_id]
        if st.timeline is not None:
            self.timelines.finish(st.timeline, reason, now)

    def abort_requests(self, request_ids: list[str],
                       iteration_stats: Optional[IterationStats] = None) -> list[str]:
        """Forget requests (the callers' ids; a parent's id stands for its children), with
        no output. Returns the engine request ids. With ``iteration_stats``, each request
        still in flight is recorded there as finished with reason "abort" (so
        ``request_success_total{finished_reason="abort"}`` counts client disconnects and
        cancellations)."""
        out = []
        now = time.time()
        for iid in self.engine_ids(request_ids):
            st = self.states.get(iid)
            if st is not None:
                self._forget(st)
                if st.parent is not None:
                    self.parents.pop(st.parent.request_id, None)
                out.append(iid)
                if iteration_stats is not None:
                    iteration_stats.finished_requests.append(st.finished_stats(str(FinishReason.ABORT), now, dropped=True))
        return out

    def finish_aborted(self, request_ids: list[str],
                       iteration_stats: Optional[IterationStats] = None) -> OutputProcessorOutput:
        """End requests (the callers' ids; a parent's id stands for its children) with a
        final output whose finish_reason is "abort", carrying the tokens so far (vLLM PR
        22283: ``AsyncLLM.abort`` ends the request's ``generate()``). The outputs go to the
        collectors, or into the result when there is none (LLMEngine); the result's
        ``reqs_to_abort`` holds the engine ids to abort."""
        ids = self.engine_ids(request_ids)
        outs = [EngineCoreOutput(request_id=iid, new_token_ids=[], finish_reason=FinishReason.ABORT)
                for iid in ids]
        result = self.process_outputs(outs, None, iteration_stats)
        result.reqs_to_abort = ids
        return result

    def reject_requests(self, rejections: list[EngineCoreRejection]) -> None:
        """The engine refused these requests: each caller gets ValueError(message), or
        EngineGenerateError when the engine holding it was lost (in its collector;
        without one, e.g. LLMEngine, it is raised here)."""
        for rej in rejections:
            st = self.states.get(rej.request_id)
            if st is None:
                continue  # aborted already
            self._forget(st, "error")
            if st.parent is not None:
                self.parents.pop(st.parent.request_id, None)
            exc = EngineGenerateError(rej.message) if rej.engine_lost else error_from_text(rej.message)
            if st.collector is None:
                raise exc
            st.collector.put(exc)

    def reincarnate(self, st: RequestState) -> str:
        """Give the live request ``st`` a fresh engine id (after an engine restart, before
        it is resubmitted) and return it; its client-side state (detokenizer, stop
        strings, logprobs, sent counts) stays, so its output continues seamlessly."""
        new_id = self.engine_request_id(st.external_req_id)
        self.states.pop(st.request_id, None)
        st.request_id = new_id
        self.states[new_id] = st
        self.external_to_internal[st.external_req_id] = new_id
        return new_id

    def fail_request(self, st: RequestState, exc: BaseException) -> None:
        """End the live request ``st`` with ``exc`` (raised in its consumer) and forget it;
        without a collector (LLMEngine) the error is raised here."""
        self._forget(st, "error")
        if st.parent is not None:
            self.parents.pop(st.parent.request_id, None)
        if st.collector is None:
            raise exc
        st.collector.put(exc)

    def propagate_error(self, exc: BaseException) -> None:
        for st in self.states.values():
            if st.collector is not None:
                st.collector.put(exc)

    # ---- logprobs ------------------------------------------------------------
    def _to_logprob_dicts(self, lists: LogprobsLists, num: int) -> list[dict[int, Logprob]]:
        out = []
        dec = self.decoded
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            d: dict[int, Logprob] = {ids[0]: Logprob(lps[0], rank, dec(ids[0]))}
            for j in range(1, min(len(ids), num + 1)):
                if ids[j] not in d:
                    d[ids[j]] = Logprob(lps[j], j, dec(ids[j]))
            out.append(d)
        return out

    # ---- main ------------------------------------------------------------------
    def process_outputs(self, outputs: list[EngineCoreOutput], timestamp: Optional[float] = None,
                        iteration_stats: Optional[IterationStats] = None) -> OutputProcessorOutput:
        result = OutputProcessorOutput()
        now = time.time()
        for eco in outputs:
            st = self.states.get(eco.request_id)
            if st is None:
                continue  # aborted already
            if st.detokenizer is None:
                self._pooling_output(st, eco, result, now, iteration_stats)
                continue
            if eco.beam_sequences is not None:
                self._beam_output(st, eco, result, now, iteration_stats, timestamp)
                continue
            p = st.params
            finish = FinishReason(eco.finish_reason) if eco.finish_reason is not None else None
            stop_reason = eco.stop_reason
            if eco.events is not None:
                st.record_events(eco.events)
            st.num_cached_tokens = eco.num_cached_tokens
            if st.timeline is not None:
                self.timelines.observe(st.timeline, eco.events, len(eco.new_token_ids), eco.num_cached_tokens,
                                       timestamp, eco.model_execute_time)
            if not eco.new_token_ids and finish is None and eco.new_prompt_logprobs is None:
                continue  # only events (a prefill chunk ran): nothing new for the caller
            new_ids, new_lps = eco.new_token_ids, eco.new_logprobs
            if p.max_tokens == 0 and eco.new_token_ids:
                # A 0-token budget (scoring the prompt): the engine samples once after the
                # prefill; that token is not output, and the request ends on "length".
                new_ids, new_lps, stop_reason = [], None, None
                if finish is None:
                    result.reqs_to_abort.append(eco.request_id)
                finish = FinishReason.LENGTH
            if eco.new_token_ids:
                if st.first_token_time is None:
                    st.first_token_time = now
                    if iteration_stats is not None:
                        st.first_token_ts = timestamp or 0.0
                        iteration_stats.num_prompt_tokens += len(st.prompt_token_ids)
                        iteration_stats.time_to_first_tokens_iter.append(now - st.arrival_time)
                elif iteration_stats is not None and st.last_token_time is not None:
                    iteration_stats.inter_token_latencies_iter.append(now - st.last_token_time)
                st.last_token_time = now
                if iteration_stats is not None:
                    st.last_token_ts = timestamp or 0.0
                    iteration_stats.num_generation_tokens += len(new_ids)
            stop_terminated = finish == FinishReason.STOP and stop_reason is None or (
                finish == FinishReason.STOP and isinstance(stop_reason, int))
            stop_str = st.detokenizer.update(new_ids, stop_terminated)
            if stop_str is not None:
                if finish is None:
                    result.reqs_to_abort.append(eco.request_id)
                finish, stop_reason = FinishReason.STOP, stop_str
            if st.logprobs is not None and new_lps is not None:
                new = self._to_logprob_dicts(new_lps, p.logprobs if p.logprobs >= 0 else 1 << 30)
                if st.detokenizer.num_dropped:  # tokens past a stop string (speculative decoding)
                    del new[len(new) - st.detokenizer.num_dropped:]
                st.logprobs.extend(new)
                for lists in new_lps.logprobs[:len(new)]:
                    st.cumulative_logprob += lists[0]
            if st.prompt_logprobs is not None and eco.new_prompt_logprobs is not None:
                k = p.prompt_logprobs if p.prompt_logprobs >= 0 else 1 << 30
                st.prompt_logprobs.extend(self._to_logprob_dicts(eco.new_prompt_logprobs, k))
            out = self._make_output(st, finish, stop_reason, stop_str is not None)
            if out is not None:
                if st.collector is not None:
                    st.collector.put(out)
                else:
                    result.request_outputs.append(out)
            if finish is not None:
                self._forget(st, str(finish), now)
                if st.parent is not None and len(st.parent.finished) == st.parent.n:
                    self.parents.pop(st.parent.request_id, None)
                if iteration_stats is not None:
                    iteration_stats.finished_requests.append(st.finished_stats(str(finish), now))
        return result

    def _beam_output(self, st: RequestState, eco: EngineCoreOutput, result: OutputProcessorOutput,
                     now: float, iteration_stats: Optional[IterationStats], timestamp: Optional[float]) -> None:
        """A beam search's one output: every returned beam as a CompletionOutput."""
        from llmserve.engine.beam_output import beam_completions

        outs = beam_completions(eco.beam_sequences, st.params, self.tokenizer,
                                st.engine_request.beam_search_params if st.engine_request else None,
                                aborted=eco.finish_reason == FinishReason.ABORT)
        ntok = sum(len(c.token_ids) for c in outs)
        self._beam_times(st, eco, ntok, now, timestamp)
        self._forget(st, str(FinishReason(eco.finish_reason)), now)
        metrics = RequestMetrics(arrival_time=st.arrival_time, first_token_time=st.first_token_time,
                                 last_token_time=now,
                                 finished_time=time.time(), num_generation_tokens=ntok)
        out = RequestOutput(request_id=st.external_req_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
                            prompt_logprobs=None, outputs=outs, finished=True, metrics=metrics,
                            num_cached_tokens=eco.num_cached_tokens)
        if st.collector is not None:
            st.collector.put(out)
        else:
            result.request_outputs.append(out)
        if iteration_stats is not None:
            iteration_stats.num_prompt_tokens += len(st.prompt_token_ids)
            iteration_stats.num_generation_tokens += ntok
            iteration_stats.finished_requests.append(st.finished_stats(str(FinishReason(eco.finish_reason)), now))

    def _beam_times(self, st: RequestState, eco: EngineCoreOutput, ntok: int, now: float,
                    timestamp: Optional[float]) -> None:
        """A finished beam search's times: its first token at the search's first step
        (``beam_first_token_ts``, engine monotonic seconds), its events and, on the
        timeline, ``ntok`` generated tokens (those of the returned beams, as usage)."""
        first_ts = eco.beam_first_token_ts
        st.first_token_time = now - (time.monotonic() - first_ts) if first_ts else now
        st.first_token_ts, st.last_token_ts = first_ts, timestamp or 0.0
        if eco.events is not None:
            st.record_events(eco.events)
        if st.timeline is not None:
            self.timelines.observe(st.timeline, eco.events, min(ntok, 1), eco.num_cached_tokens,
                                   first_ts or None, eco.model_execute_time)
            self.timelines.observe(st.timeline, None, ntok - 1, eco.num_cached_tokens, timestamp)

    def _pooling_output(self, st: RequestState, eco: EngineCoreOutput, result: OutputProcessorOutput,
                        now: float, iteration_stats: Optional[IterationStats]) -> None:
        """A pooling request's one output: the pooled vector, as PoolingRequestOutput."""
        self._forget(st, "stop", now)
        out = PoolingRequestOutput(st.external_req_id, PoolingOutput(eco.pooling_output), st.prompt_token_ids,
                                   True, eco.num_cached_tokens)
        if st.collector is not None:
            st.collector.put(out)
        else:
            result.request_outputs.append(out)
        if iteration_stats is not None:
            iteration_stats.num_prompt_tokens += len(st.prompt_token_ids)
            finish = FinishReason(eco.finish_reason) if eco.finish_reason is not None else FinishReason.STOP
            iteration_stats.finished_requests.append(st.finished_stats(str(finish), now))

    def _make_output(self, st: RequestState, finish: Optional[FinishReason], stop_reason,
                     stopped_by_str: bool) -> Optional[RequestOutput]:
        p = st.params
        kind = p.output_kind
        finished = finish is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        det = st.detokenizer
        text = det.get_next_output_text(finished, delta)
        toks = det.token_ids
        if delta:
            token_ids = toks[st.sent_token_ids:]
            st.sent_token_ids = len(toks)
            logprobs = None
            if st.logprobs is not None:
                logprobs = st.logprobs[st.sent_logprobs:]
                st.sent_logprobs = len(st.logprobs)
            if not text and not token_ids and not finished and (
                    st.prompt_logprobs is None or st.prompt_logprobs_sent):
                return None
        else:
            token_ids = list(toks)
            logprobs = list(st.logprobs) if st.logprobs is not None else None
        comp = CompletionOutput(index=0, text=text, token_ids=token_ids,
                                cumulative_logprob=st.cumulative_logprob, logprobs=logprobs,
                                finish_reason=str(finish) if finished else None,
                                stop_reason=stop_reason if finished else None)
        prompt_lps = None
        if st.prompt_logprobs is not None and (not delta or not st.prompt_logprobs_sent):
            if len(st.prompt_logprobs) < len(st.prompt_token_ids) and not finished:
                if kind != RequestOutputKind.CUMULATIVE:
                    return None  # wait until all prompt logprobs are in
            prompt_lps = st.prompt_logprobs
            st.prompt_logprobs_sent = True
        elif st.prompt_logprobs is not None and not delta:
            prompt_lps = st.prompt_logprobs
        request_id = st.external_req_id
        if st.parent is not None:
            outs, done = st.parent.get_outputs(st.external_req_id, comp)
            if not outs:
                return None
            request_id = st.parent.request_id
            finished = done
        else:
            outs = [comp]
        metrics = RequestMetrics(arrival_time=st.arrival_time, first_token_time=st.first_token_time,
                                 last_token_time=st.last_token_time,
                                 finished_time=time.time() if finished else None,
                                 num_generation_tokens=len(toks))
        tl = st.timeline
        if tl is not None and tl.scheduled_time is not None:
            metrics.first_scheduled_time = tl.scheduled_time
            metrics.time_in_queue = tl.scheduled_time - tl.queued_time if tl.queued_time is not None else None
        return RequestOutput(request_id=request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
                             prompt_logprobs=prompt_lps, outputs=outs, finished=finished,
                             metrics=metrics, num_cached_tokens=st.num_cached_tokens)


def register_incarnations(output_processor: OutputProcessor, reqs: list, parent: Optional[ParentRequest],
                          collector: Optional[RequestOutputCollector] = None, lora_request: Any = None) -> list:
    """Add ``reqs`` ((EngineCoreRequest, prompt text) pairs, ids as the caller gave them)
    to ``output_processor`` and return the EngineCoreRequests to send, each renamed to a
    fresh engine id (an incarnation), so no output of an aborted request with the same id
    can reach them. ``lora_request`` (else each request's own): its adapter's name is the
    model the timelines list the request under, as the response's ``model`` names it.
    Raises ValueError if an id is live (nothing is added then)."""
    import msgspec

    for req, _ in reqs:
        if req.request_id in output_processor.external_to_internal:
            raise ValueError(f"Request id {req.request_id!r} is already running.")
    out = []
    for req, text in reqs:
        ext = req.request_id
        req = msgspec.structs.replace(req, request_id=output_processor.engine_request_id(ext))
        lora = lora_request or getattr(req, "lora_request", None)
        output_processor.add_request(req.request_id, text, req.prompt_token_ids,
                                     req.sampling_params or req.pooling_params,
                                     req.arrival_time, parent=parent, collector=collector, external_req_id=ext,
                                     model=lora.lora_name if lora is not None else None)
        output_processor.states[req.request_id].engine_request = req
        out.append(req)
    return out
