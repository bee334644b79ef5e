"""Front-end half of the per-request timeline (issue 33): what ``GET /v1/requests`` and
``GET /v1/requests/{id}/timeline`` serve, and what a finished request's trace span and
response ``metrics``/``timings`` are made from.

The OutputProcessor calls :class:`RequestTimelines` at three points of a request's life
(``start`` when it is added, ``observe`` for each engine output, ``finish`` when it
ends); the engine's events (core/timeline.py) carry ``time.monotonic()`` stamps, turned
into unix seconds here with one offset (CLOCK_MONOTONIC is system-wide, so the engine
process on the same host shares it). Live requests are held while they run; finished
ones stay in a ring of ``max_finished`` (bounded memory), oldest dropped first.

The HTTP layer says who is asking through :data:`current_request_labels` (a context
variable set per HTTP request: the tenant, the ids the client knows, the W3C trace
headers); the engine never imports the HTTP layer. The model shown is the engine's
served name, or the LoRA adapter's name the request was served as.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from llmserve.core.outputs import EngineCoreEventType

__all__ = ["RequestLabels", "current_request_labels", "TimelineRecord", "RequestTimelines", "make_request_timelines",
           "DEFAULT_MAX_FINISHED"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_FINISHED = 1000
DEFAULT_TENANT_NAME = "default"


@dataclass
class RequestLabels:
    """What the HTTP layer knows of the request it serves. tenant: the API key's tenant
    name; aliases: other ids the client may look its requests up by (its X-Request-Id);
    response_ids: engine request id -> the response id the client gets
    (``chatcmpl-...``), shown as the request's id; trace_headers: its ``traceparent``/``tracestate`` (W3C trace context); arrival_time:
    when the HTTP request arrived (unix seconds), the arrival of the engine requests it
    makes, so that TTFT and e2e latency include the server's own parsing and rendering
    (what the client measures)."""

    tenant: str = DEFAULT_TENANT_NAME
    aliases: list[str] = field(default_factory=list)
    response_ids: dict[str, str] = field(default_factory=dict)
    trace_headers: Optional[dict[str, str]] = None
    arrival_time: Optional[float] = None


#: Set by the HTTP layer for the request being served; read when a request is added.
current_request_labels: ContextVar[Optional[RequestLabels]] = ContextVar("llmserve_request_labels", default=None)


@dataclass(eq=False)
class TimelineRecord:
    """One request's timeline. Times are unix seconds (float); token counts are tokens.
    ``events``: dicts ``{"event", "time", ...}`` in time order (see the module doc of
    core/timeline.py for what the engine records). ``id``: the id shown (the response
    id when the HTTP layer gave one, else the engine caller's id)."""

    id: str
    request_id: str
    model: Optional[str]
    tenant: str
    arrival_time: float
    prompt_tokens: int
    params: Any = None
    trace_headers: Optional[dict[str, str]] = None
    aliases: tuple[str, ...] = ()
    events: list[dict] = field(default_factory=list)
    generated_tokens: int = 0
    cached_tokens: int = 0
    num_preemptions: int = 0
    queued_time: Optional[float] = None
    scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    finish_reason: Optional[str] = None
    model_execute_time: float = 0.0  # --collect-detailed-traces: engine execute_model seconds

    @property
    def state(self) -> str:
        """``finished``, ``running`` (scheduled at least once) or ``queued``."""
        if self.finish_time is not None:
            return "finished"
        return "running" if self.scheduled_time is not None else "queued"

    @property
    def tokens_per_second(self) -> Optional[float]:
        """Decode speed: tokens after the first over the time since the first (None
        before two tokens)."""
        if self.generated_tokens < 2 or not self.last_token_time or self.last_token_time <= self.first_token_time:
            return None
        return (self.generated_tokens - 1) / (self.last_token_time - self.first_token_time)

    def summary(self) -> dict:
        """The row of ``GET /v1/requests``."""
        return {"id": self.id, "model": self.model, "tenant": self.tenant, "state": self.state,
                "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "cached_tokens": self.cached_tokens, "arrival_time": self.arrival_time,
                "first_token_time": self.first_token_time, "finish_time": self.finish_time,
                "finish_reason": self.finish_reason, "tokens_per_second": self.tokens_per_second}

    def timeline(self) -> dict:
        """The body of ``GET /v1/requests/{id}/timeline``."""
        return {"id": self.id, "model": self.model, "tenant": self.tenant, "events": list(self.events),
                "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens}


def _child_id(request_id: str, parent_id: str, shown_parent: str) -> str:
    """The id shown for choice i of an n > 1 request: vLLM's name of its sub-request,
    ``"<i>_<id>"`` (parallel_sampling.py), with the id the client knows (``shown_parent``,
    e.g. ``cmpl-...``) as ``<id>``, so that each choice is a row of its own (they all
    showed the parent's id: 128 rows of one id for n=128)."""
    prefix = request_id[:-len(parent_id)] if request_id.endswith(parent_id) else ""
    return f"{prefix}{shown_parent}" if prefix else request_id


class RequestTimelines:
    """Timelines of the live requests and a ring of the last ``max_finished`` finished
    ones, looked up by any of a request's ids, per tenant. Also a stat logger (``record``)
    that keeps the engine's last SchedulerStats and the token totals for the live view.

    on_finish: callables given each finished TimelineRecord (the OpenTelemetry span
    exporter, llmserve/tracing.py). Raises ValueError for ``max_finished`` < 1."""

    def __init__(self, max_finished: int = DEFAULT_MAX_FINISHED, default_model: Optional[str] = None) -> None:
        if max_finished < 1:
            raise ValueError(f"max_finished_request_timelines must be >= 1, got {max_finished}")
        self.max_finished = max_finished
        self.default_model = default_model
        self.live: dict[int, TimelineRecord] = {}
        self.finished: OrderedDict[int, TimelineRecord] = OrderedDict()
        self._index: dict[str, TimelineRecord] = {}
        self.on_finish: list[Callable[[TimelineRecord], None]] = []
        self._mono_to_unix = time.time() - time.monotonic()
        self.scheduler_stats: Any = None
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ---- the OutputProcessor's hooks ------------------------------------------
    def start(self, request_id: str, arrival_time: float, prompt_tokens: int, params: Any = None,
              parent_id: Optional[str] = None, model: Optional[str] = None) -> TimelineRecord:
        """A request was added (``request_id``: the engine caller's id; ``parent_id``:
        the id of its n > 1 parent; ``model``: the name it is served as when not the base
        model's, i.e. its LoRA adapter's name, which is the ``model`` of the response)."""
        labels = current_request_labels.get()
        if labels is None:
            labels = RequestLabels()
        response_id = labels.response_ids.get(parent_id or request_id)
        shared = tuple(a for a in (response_id, *labels.aliases) if a)
        own = _child_id(request_id, parent_id, shared[0]) if parent_id and shared else None
        aliases = (own, *shared) if own else shared
        rec = TimelineRecord(aliases[0] if aliases else request_id, request_id,
                             model or self.default_model,
                             labels.tenant, arrival_time, prompt_tokens, params, labels.trace_headers, aliases)
        rec.events.append({"event": "arrived", "time": arrival_time})
        self.live[id(rec)] = rec
        for key in (request_id, *aliases):
            if own and key in shared:
                self._index.setdefault(key, rec)  # the ids of the whole request find its first choice
            else:
                self._index[key] = rec
        return rec

    def observe(self, rec: TimelineRecord, events: Optional[list], num_new_tokens: int, num_cached_tokens: int,
                timestamp: Optional[float], execute_time: float = 0.0) -> None:
        """One engine output: its events, its new tokens (``timestamp``: the engine step's
        ``time.monotonic()``, or None for the front end's own outputs), and on the last
        one the engine's execute_model seconds (``--collect-detailed-traces``)."""
        if events:
            self._add_events(rec, events)
        rec.cached_tokens = num_cached_tokens
        if execute_time:
            rec.model_execute_time = execute_time
        if num_new_tokens:
            t = timestamp + self._mono_to_unix if timestamp else time.time()
            if rec.first_token_time is None:
                rec.first_token_time = t
                rec.events.append({"event": "first_token", "time": t})
            rec.last_token_time = t
            rec.generated_tokens += num_new_tokens

    def _add_events(self, rec: TimelineRecord, events: list) -> None:
        off = self._mono_to_unix
        for ev in events:
            t = ev.timestamp + off
            if ev.type == EngineCoreEventType.SCHEDULED:
                if rec.scheduled_time is None:
                    rec.scheduled_time = t
                rec.events.append({"event": "scheduled", "time": t, "num_tokens": ev.num_tokens,
                                   "cached_tokens": ev.cached_tokens})
            elif ev.type == EngineCoreEventType.QUEUED:
                rec.queued_time = t
                rec.events.append({"event": "queued", "time": t})
            elif ev.type == EngineCoreEventType.PREEMPTED:
                rec.num_preemptions += 1
                rec.events.append({"event": "preempted", "time": t, "reason": ev.reason})

    def finish(self, rec: TimelineRecord, reason: str, now: Optional[float] = None) -> None:
        """The request ended (``reason``: stop, length, abort...); it joins the ring."""
        if rec.finish_time is not None:
            return
        rec.finish_time = now or time.time()
        rec.finish_reason = reason
        rec.events.append({"event": "finished", "time": rec.finish_time, "reason": reason})
        self.live.pop(id(rec), None)
        self.finished[id(rec)] = rec
        while len(self.finished) > self.max_finished:
            self._drop(self.finished.popitem(last=False)[1])
        for hook in self.on_finish:
            try:
                hook(rec)
            except Exception:  # a trace export must never take the output handler down
                logger.exception("request timeline hook %r failed", hook)

    def _drop(self, rec: TimelineRecord) -> None:
        for key in (rec.request_id, *rec.aliases):
            if self._index.get(key) is rec:
                del self._index[key]

    # ---- queries ----------------------------------------------------------------
    def get(self, request_id: str, tenant: str = DEFAULT_TENANT_NAME) -> Optional[TimelineRecord]:
        """The record known by ``request_id`` (any of its ids) if it belongs to ``tenant``."""
        rec = self._index.get(request_id)
        return rec if rec is not None and rec.tenant == tenant else None

    def list(self, tenant: str = DEFAULT_TENANT_NAME) -> list[TimelineRecord]:
        """The tenant's live requests (oldest first), then its finished ones (newest first)."""
        live = [r for r in self.live.values() if r.tenant == tenant]
        done = [r for r in reversed(self.finished.values()) if r.tenant == tenant]
        return live + done

    def engine_summary(self) -> dict:
        """The ``engine`` object of ``GET /v1/requests`` (from the last SchedulerStats).
        With no request live here the engine is idle, whatever its last step held: the
        counts are 0 then (the last step's batch would stay on the page forever)."""
        s = self.scheduler_stats if self.live else None
        usage = self.scheduler_stats.kv_cache_usage if self.scheduler_stats else 0.0
        return {"num_running": s.num_running_reqs if s else 0, "num_waiting": s.num_waiting_reqs if s else 0,
                "kv_cache_usage": usage,
                "batch_size": getattr(s, "num_scheduled_reqs", s.num_running_reqs) if s else 0,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total, "time": time.time()}

    # ---- stat logger --------------------------------------------------------------
    def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
        """Stat-logger hook (AsyncLLM's ``stat_loggers``): the last SchedulerStats and
        the token totals."""
        if scheduler_stats is not None:
            self.scheduler_stats = scheduler_stats
        if iteration_stats is not None:
            self.prompt_tokens_total += iteration_stats.num_prompt_tokens
            self.generation_tokens_total += iteration_stats.num_generation_tokens

    def log_engine_initialized(self) -> None:
        """Stat-logger hook: nothing to do."""


def make_request_timelines(vllm_config: Any, log_stats: bool) -> Optional[RequestTimelines]:
    """The AsyncLLM's RequestTimelines: kept when stats are on and timelines or traces
    are asked for (``ObservabilityConfig``), with the OTLP span exporter attached when
    ``otlp_traces_endpoint`` is set (raises ValueError when the OpenTelemetry packages
    are missing). None otherwise."""
    obs = vllm_config.observability_config
    if not log_stats or not (obs.request_timelines or obs.otlp_traces_endpoint):
        return None
    mc = vllm_config.model_config
    names = mc.served_model_name
    name = names if isinstance(names, str) else (names[0] if names else mc.model)
    store = RequestTimelines(obs.max_finished_request_timelines, default_model=name)
    if obs.otlp_traces_endpoint:
        from llmserve.tracing import RequestSpanExporter

        store.on_finish.append(RequestSpanExporter.from_config(obs, name))
    return store
