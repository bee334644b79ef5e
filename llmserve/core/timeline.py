"""Engine-side half of the per-request timeline (issue 33): the scheduler's events.

A request records events only when the engine logs stats (``Request.log_stats``); the
front end turns them into the timeline served at ``GET /v1/requests/{id}/timeline``
(engine/request_timeline.py). What is recorded here, with ``time.monotonic()`` stamps:

- SCHEDULED for each scheduling of prompt tokens: the first one (with the prefix-cache
  hits as ``cached_tokens``), each later chunk of a chunked prefill, and the recompute
  after a preemption. Decode steps (one token after the computed ones) record nothing,
  so a decode step costs one comparison per scheduled request.
- PREEMPTED with the reason (the one reason this scheduler preempts for: the KV cache
  has no free block for a running request's next tokens).

Plain Python, no torch (the rule of ``core/``).
"""
from __future__ import annotations

import time
from typing import Iterable, Mapping

from llmserve.core.outputs import EngineCoreEvent, EngineCoreEventType

__all__ = ["PREEMPTED_KV_CACHE_FULL", "PREEMPTED_FAIR_SHARE", "record_scheduled", "record_preempted", "record_execute_time"]

#: The reason of a preemption by recompute: no free KV block for a running request.
PREEMPTED_KV_CACHE_FULL = "kv_cache_full"
# A tenant below its weighted share of the batch's seats took this request's seat
# (core/fair_share.py FairShare.seat_victim).
PREEMPTED_FAIR_SHARE = "fair_share"


def record_scheduled(scheduled: Iterable, admitted: Mapping[str, int]) -> None:
    """Record a SCHEDULED event for each prompt scheduling of this step.

    scheduled: the step's ``ScheduledRequest`` list (request, num_computed_tokens,
    num_scheduled_tokens); admitted: request id -> prefix-cache hit tokens of the
    requests that left the waiting queue this step. A request already running records
    only when it schedules more than the one token after its computed ones (a prefill
    chunk, not a decode)."""
    now = None
    for s in scheduled:
        req = s.request
        if not req.log_stats:
            continue
        hit = admitted.get(req.request_id)
        if hit is None and s.num_computed_tokens + 1 >= req.num_tokens:
            continue  # a decode step
        if now is None:
            now = time.monotonic()
        req.events.append(EngineCoreEvent(EngineCoreEventType.SCHEDULED, now, s.num_scheduled_tokens, hit or 0))


def record_preempted(req, reason: str = PREEMPTED_KV_CACHE_FULL) -> None:
    """Record that ``req`` was preempted (its KV freed, to be recomputed) and why."""
    if req.log_stats:
        req.events.append(EngineCoreEvent(EngineCoreEventType.PREEMPTED, time.monotonic(), reason=reason))


def record_execute_time(scheduled: Iterable, outputs: Iterable, seconds: float) -> None:
    """``--collect-detailed-traces``: add one step's ``execute_model`` wall time
    (``seconds``: input preparation, forward pass and sampling of the whole batch) to
    each request in the step, and put each finishing request's total on its output
    (``EngineCoreOutput.model_execute_time``) for its trace span."""
    reqs = {}
    for s in scheduled:
        req = s.request
        req.model_execute_time = getattr(req, "model_execute_time", 0.0) + seconds
        reqs[req.request_id] = req
    for out in outputs:
        if out.finish_reason is not None and out.request_id in reqs:
            out.model_execute_time = reqs[out.request_id].model_execute_time
