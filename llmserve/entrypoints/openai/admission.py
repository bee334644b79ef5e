"""Admission control, engine progress and readiness for the OpenAI server (beyond vLLM,
whose waiting queue is unbounded: a burst there only makes every request slower).

Each POST to a generation or pooling route (vLLM's load-aware routes,
:data:`~llmserve.entrypoints.openai.server_load.TRACKED_PATHS`) passes
:class:`AdmissionMiddleware` once its whole body has arrived (the outer
:class:`~llmserve.entrypoints.openai.http_edges.BodyLimitMiddleware` receives it within a
deadline first, so a client that never finishes its body holds no waiting slot), before
the body is parsed or its prompt rendered. A request counts as the engine requests
(sequences) it becomes, its fan-out (fan_out.py): a list of prompts, inputs or documents
times ``n`` / ``best_of`` (one for an ordinary request; 1024 prompts with ``n=16`` are
16,384, which counted as one held a concurrent chat 117 s behind them). It is admitted
only when all its sequences fit the limits below; one whose fan-out alone exceeds what
is ever admitted (``max_num_seqs`` + ``--max-waiting-requests``) runs alone: it is
admitted when the engine is idle and refused (429 ``queue_full``) otherwise, so a list of
up to the documented 1024 prompts still works, as in vLLM, and requests arriving while it
runs are refused at once rather than queued behind it. The
:class:`AdmissionController` admits it unless

- ``queue_full`` (429): the requests waiting, with the new request's sequences beyond
  the free batch slots, exceed ``--max-waiting-requests``: admitted sequences beyond the
  batch (``max_num_seqs``), or the engine's own queue when longer (vLLM's
  ``num_requests_waiting``); running requests never count, whatever the last engine
  snapshot (stale while a step runs) says;
- ``queue_delay`` (429): the new request would wait for a batch slot (the admitted
  requests fill ``max_num_seqs``, or the engine has a queue) and its predicted wait (its
  place in the queue over the predicted drain rate) exceeds ``--max-queue-delay``. The
  drain rate of a full batch is ``max_num_seqs`` over the time a request spends in it
  (Little's law; an average of finished requests' inference time). Until a request has
  finished (a cold start) there is no rate and so no prediction: the rule refuses
  nothing then, and ``--max-waiting-requests`` alone bounds the queue (see
  :meth:`AdmissionController.check` for why). Our own count of admitted requests decides
  "full", not the engine's running count, which dips below full between steps whenever
  a request finishes;
- ``kv_cache_full`` (429): admitted requests are not running yet and the KV blocks in use
  plus those they will need (estimated from finished requests) exceed the cache;
- ``draining`` (503): the server is shutting down.
- ``engine_restarting`` (503, ``Retry-After`` ENGINE_RESTART_RETRY_AFTER_S): a self-heal
  restart is under way, so no engine serves; the requests in flight resume on the new one,
  a new request is refused at once rather than held for an engine that may not come back
  (case C71: an error JSON within 2 s while no engine serves).

A request that would be refused is first checked as its route checks it
(admission_precheck.py): a malformed one gets its own 400, not a refusal (validation
comes first, as on OpenAI's, Anthropic's and Ollama's servers). A refusal carries the
OpenAI error body and ``Retry-After``: the seconds the engine needs
to drain the waiting requests at the predicted full-batch rate or the rate requests
finished per busy second over the last ``DRAIN_WINDOW_S`` seconds, whichever is higher
(1 to ``MAX_RETRY_AFTER_S``). ``/metrics`` counts refusals in
``vllm:request_rejected_total{reason=...}``.

The controller also tracks engine progress: it is a stat logger of the AsyncLLM, so every
batch of engine outputs (each carries the scheduler's stats) marks progress. ``/health``
answers 503 once the engine has made no progress for ``--engine-stall-timeout`` seconds
while work is in flight; ``/ready`` answers 503 while the server starts, drains, is over
its admission limit, or the engine is dead or stalled.

``/metrics`` shows the admission queue: ``vllm:admission_receiving_requests`` (bodies
still arriving: not yet counted by admission), ``vllm:admission_waiting_requests``
(admitted, queued behind the batch) and ``vllm:admission_in_flight_requests`` (admitted, response not
ended), both in sequences (a fan-out counts prompts × n).
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from starlette.datastructures import Headers

from llmserve.config import AdmissionConfig
from llmserve.entrypoints.openai.admission_precheck import Prechecks, malformed_response
from llmserve.entrypoints.openai.common.errors import error_response_from_exception, make_error
from llmserve.entrypoints.openai.common.protocol import ErrorResponse
from llmserve.entrypoints.openai.deadline import (REQUEST_TIMEOUT_HEADER, Deadline, parse_request_timeout,
                                                  reset_deadline, set_deadline)
from llmserve.entrypoints.openai.server_load import TRACKED_PATHS
from llmserve.entrypoints.openai.server_utils import json_response
from llmserve.entrypoints.openai.fan_out import ONE, FanOut, fan_out_of
from llmserve.entrypoints.openai.tenants import TENANT_IN_FLIGHT_KEY, TENANT_OUTCOME_KEY, tenant_of
from llmserve.metrics.stats import IterationStats, SchedulerStats

DRAIN_WINDOW_S = 30.0  # finished requests counted for the drain rate
DEFAULT_MAX_QUEUE_DELAY_S = 1.0  # why: see AdmissionConfig.max_queue_delay
MAX_RETRY_AFTER_S = 60  # never ask a client to wait longer
# A self-heal restart loads the model again: seconds, not minutes, for the models served here.
ENGINE_RESTART_RETRY_AFTER_S = 5
# Until requests finish, a waiting request is assumed to need this many KV blocks.
_DEFAULT_BLOCKS_PER_REQUEST = 1.0
_EWMA_WEIGHT = 0.1  # of each finished request in the blocks-per-request estimate
# Drain-rate records per released request: its sequences finished (a fan-out of 16 frees 16
# slots), capped so one release stays cheap (capacity is 3 * max_num_seqs by default).
_MAX_DRAIN_RECORDS = 4096


def admission_config_from_args(args: Any, max_num_seqs: int) -> AdmissionConfig:
    """The serve flags' AdmissionConfig; ``--max-waiting-requests`` unset becomes
    ``2 * max_num_seqs`` (why: see AdmissionConfig)."""
    limit = getattr(args, "max_waiting_requests", None)
    delay = getattr(args, "max_queue_delay", None)
    return AdmissionConfig(max_waiting_requests=2 * max_num_seqs if limit is None else limit,
                           engine_stall_timeout=float(getattr(args, "engine_stall_timeout", 0.0) or 0.0),
                           max_queue_delay=DEFAULT_MAX_QUEUE_DELAY_S if delay is None else float(delay))


@dataclass(frozen=True)
class Rejection:
    """Why a request is refused: ``reason`` (a REJECTION_REASONS label), the HTTP
    ``status`` (429 or 503), ``retry_after`` (whole seconds; None: no ``Retry-After``),
    a message and ``param`` (the body field at fault, when there is one)."""

    reason: str
    status: int
    retry_after: Optional[int]
    message: str
    param: Optional[str] = None


class DrainRate:
    """Requests finished per second of busy time over the last ``window_s`` seconds
    (monotonic clock). Busy: from :meth:`start_work` (work arrives at an idle engine) to
    :meth:`stop_work` (none left); until the first :meth:`start_work`, since creation.
    Idle time is not in the denominator: 30 finished in a busy 10 s and then 20 s of quiet
    were 1 per second over the window, and a burst's 256 waiting requests were told
    ``Retry-After: 60`` by an engine that drained them in about 12 s (fresh-user trial)."""

    def __init__(self, window_s: float = DRAIN_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self.work_started: Optional[float] = self.started  # the open busy period; None while idle
        self.busy_periods: collections.deque[tuple[float, float]] = collections.deque()  # closed ones
        self.finished: collections.deque[float] = collections.deque()

    def start_work(self) -> None:
        """Work began on an idle engine. Until a request finishes, the wait asked of a
        refused client is the time spent since then without one: counted from the server's
        start instead, a burst after a quiet minute was told ``Retry-After: 30`` (the whole
        window) by an engine that had been busy for a second. A period left open (no
        :meth:`stop_work` before) was idle: the caller says the engine was."""
        self.work_started = self.clock()

    def stop_work(self) -> None:
        """No work is left: the busy period ends (idle time does not count in the rate)."""
        if self.work_started is not None:
            self.busy_periods.append((self.work_started, self.clock()))
            self.work_started = None

    def record(self) -> None:
        """One request finished now."""
        now = self.clock()
        self.finished.append(now)
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self.finished and self.finished[0] < now - self.window_s:
            self.finished.popleft()
        while self.busy_periods and self.busy_periods[0][1] < now - self.window_s:
            self.busy_periods.popleft()

    def busy_s(self) -> float:
        """Seconds of the window the engine had work."""
        now = self.clock()
        self._prune(now)
        since = now - self.window_s
        periods = list(self.busy_periods) + ([(self.work_started, now)] if self.work_started is not None else [])
        return sum(max(0.0, end - max(start, since)) for start, end in periods)

    def rate(self) -> float:
        """Requests finished per busy second over the window (at least one second's worth);
        0.0 while none finished in it."""
        now = self.clock()
        self._prune(now)
        if not self.finished:
            return 0.0
        return len(self.finished) / max(self.busy_s(), 1.0)  # a second at least: one step's finishes are no rate

    def retry_after(self, backlog: int, rate: float = 0.0) -> int:
        """Seconds (1..MAX_RETRY_AFTER_S, whole: HTTP's ``Retry-After``) to finish
        ``backlog`` requests at the measured rate, or at ``rate`` (requests/s, e.g. the
        controller's full-batch prediction) when that is higher. With nothing finished in
        the window, the time the current work has run without one (since
        :meth:`start_work`; a stalled engine earns long waits, a cold start or a burst
        after idling short ones)."""
        now = self.clock()
        self._prune(now)
        if not self.finished:
            seconds = min(self.window_s, now - (self.work_started if self.work_started is not None else now))
        else:
            seconds = max(backlog, 1) / max(self.rate(), rate, 1e-6)
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds))))


def _summed(stats: Any) -> SchedulerStats:
    """Several data-parallel ranks' SchedulerStats as one engine's: the counts and KV
    blocks the controller reads, summed."""
    stats = list(stats)
    return SchedulerStats(num_running_reqs=sum(s.num_running_reqs for s in stats),
                          num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
                          num_used_blocks=sum(s.num_used_blocks for s in stats),
                          num_total_blocks=sum(s.num_total_blocks for s in stats),
                          kv_cache_usage=max(s.kv_cache_usage for s in stats))


def ranks_fed(parallel_config: Any) -> int:
    """The data-parallel engines this API server sends requests to: one with external
    load balancing (each API server owns a rank), the node's ranks with hybrid load
    balancing, every rank otherwise (1 without data parallelism)."""
    if parallel_config is None or getattr(parallel_config, "data_parallel_external_lb", False):
        return 1
    size = getattr(parallel_config, "data_parallel_size", 1) or 1
    if getattr(parallel_config, "data_parallel_hybrid_lb", False):
        return getattr(parallel_config, "data_parallel_size_local", None) or size
    return size


class AdmissionController:
    """Admits requests to the server (see the module docstring); also a stat logger of
    the AsyncLLM (``record``), which is how it sees the engine's scheduler stats and
    progress.

    Args:
      config: the limits. block_size: KV block size in tokens. max_num_seqs: the
        engine's running-batch size (a request beyond it waits): with data parallelism,
        the sum over the ranks this server feeds (:func:`ranks_fed`).
      stat_logger: the PrometheusStatLogger counting refusals and deadlines (or None).
      clock: monotonic seconds (tests pass their own).
      uses_kv_cache: False for an encoder-only model (no KV kept: no ``kv_cache_full``).
    ``is_draining``: a callable set by the launcher (True once shutdown began).
    ``is_restarting``: a callable, True while the engine is being restarted (self-heal).
    """

    def __init__(self, config: AdmissionConfig, block_size: int = 16, max_num_seqs: int = 128,
                 stat_logger: Any = None, clock: Callable[[], float] = time.monotonic, uses_kv_cache: bool = True):
        self.config = config
        # An encoder (BERT) keeps no KV: its nominal cache must not refuse requests.
        self.uses_kv_cache = uses_kv_cache
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.stat_logger = stat_logger
        self.clock = clock
        self.drain = DrainRate(clock=clock)
        self.is_draining: Callable[[], bool] = lambda: False
        self.is_restarting: Callable[[], bool] = lambda: False
        self.fair_share = False  # the engine shares itself between tenants (see check)
        # Engine requests (sequences: a call's prompts × n, see fan_out.py) admitted whose
        # response has not ended; an ordinary request is one.
        self.in_flight = 0
        self.tenant_in_flight: dict[str, int] = {}  # the same, per tenant (fair share: see check)
        self.stats = SchedulerStats()  # the latest, from the engine (summed over data-parallel ranks)
        self._rank_stats: dict[int, SchedulerStats] = {}  # the latest of each rank (engine_idx)
        self.blocks_per_request = _DEFAULT_BLOCKS_PER_REQUEST
        self.service_s: Optional[float] = None  # mean seconds a finished request spent in the batch
        self.receiving = 0  # request bodies still arriving (BodyLimitMiddleware): not yet admitted
        self.last_progress = clock()  # last engine output, or when work began after idling

    # ---- stat logger (called by AsyncLLM's output handler after each batch) -----------
    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats],
               *args: Any, engine_idx: int = 0, **kwargs: Any) -> None:
        """Keeps the scheduler stats and updates the KV blocks a finished request held.
        A batch with scheduler stats came from an engine step: that is progress (the
        frontend's own calls, e.g. ``AsyncLLM.abort``, pass None and are not).
        ``engine_idx``: the data-parallel rank that sent them; the controller sees the
        sum over its ranks (one rank's stats replaced the others' before)."""
        if scheduler_stats is not None:
            self.last_progress = self.clock()
            self._rank_stats[engine_idx] = scheduler_stats
            self.stats = scheduler_stats if len(self._rank_stats) == 1 else _summed(self._rank_stats.values())
            self._report()
        if iteration_stats is not None:
            for fin in iteration_stats.finished_requests:
                tokens = fin.num_prompt_tokens + fin.num_generation_tokens
                blocks = max(1, -(-tokens // self.block_size))
                self.blocks_per_request += _EWMA_WEIGHT * (blocks - self.blocks_per_request)
                self._record_service(fin)

    def _record_service(self, fin: Any) -> None:
        """The time ``fin`` spent in the batch (scheduled -> last token) joins the average."""
        seconds = fin.inference_time or max(0.0, fin.e2e_latency - fin.queued_time)
        if seconds <= 0:
            return  # never scheduled (aborted in the queue): says nothing about the batch
        if self.service_s is None:
            self.service_s = seconds
        else:
            self.service_s += _EWMA_WEIGHT * (seconds - self.service_s)

    def log(self) -> None:
        """Stat-logger hook (nothing to log)."""

    def log_engine_initialized(self) -> None:
        """Stat-logger hook (nothing to do)."""

    # ---- admission -----------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Admitted requests queued behind a full batch: those beyond ``max_num_seqs``, or
        the engine's own queue when that is longer (requests with n > 1, a KV cache too
        small for a full batch). Not ``in_flight`` minus the engine's running count: that
        snapshot is as old as the last engine step and drops to 0 between steps or while
        one step takes seconds (a starved CPU), which counted every running request as
        waiting (8 streams on 4 slots were refused as "8 requests are waiting")."""
        return max(0, self.in_flight - self.max_num_seqs, self.stats.num_waiting_reqs)

    @property
    def num_pending(self) -> int:
        """Admitted requests the engine's last stats do not show running (rendering, in
        its queue, or added since that step): all of them will need KV blocks."""
        return max(0, self.in_flight - self.stats.num_running_reqs)

    def _engine_busy(self) -> bool:
        return self.in_flight > 0 or self.stats.num_running_reqs > 0 or self.stats.num_waiting_reqs > 0

    @property
    def capacity(self) -> Optional[int]:
        """The most sequences admitted at once: a full batch plus ``--max-waiting-requests``
        (None: unbounded, a negative limit)."""
        limit = self.config.max_waiting_requests
        return None if limit < 0 else self.max_num_seqs + limit

    def check(self, tenant_in_flight: Optional[int] = None, sequences: int = 1) -> Optional[Rejection]:
        """The rejection a new request would get now, or None (admitted). Changes nothing.
        ``tenant_in_flight``: sequences of the new request's tenant in flight, when the
        engine shares itself fairly between tenants (core/fair_share.py): then only those
        can be ahead of it, not another tenant's queue (a flooder's backlog refuses the
        flooder, not a quiet tenant). ``sequences``: the engine requests the new request
        becomes (its fan-out, fan_out.py): it is admitted only when all of them fit, those
        beyond the free batch slots counting as waiting."""
        waiting = self.num_waiting if tenant_in_flight is None else min(self.num_waiting, tenant_in_flight)
        if self.is_draining():
            return Rejection("draining", 503, self.retry_after(self.in_flight),
                             "The server is shutting down and takes no new requests.")
        if self.is_restarting():
            return Rejection("engine_restarting", 503, ENGINE_RESTART_RETRY_AFTER_S,
                             "The engine is restarting after a failure (self-heal) and serves no request now; "
                             f"retry in {ENGINE_RESTART_RETRY_AFTER_S} s.")
        limit = self.config.max_waiting_requests
        # The new request waits too unless a slot is free and nobody is ahead: our own
        # admitted count fills the batch, or the engine's (another API server's requests).
        # A fan-out's sequences beyond the free slots wait too (one request: 0 or 1).
        full = (waiting > 0 or self.in_flight >= self.max_num_seqs
                or self.stats.num_running_reqs >= self.max_num_seqs)
        free = 0 if full else self.max_num_seqs - max(self.in_flight, self.stats.num_running_reqs)
        would_wait = max(0, sequences - free)
        if limit >= 0 and sequences > self.max_num_seqs + limit and not self._engine_busy():
            # A call larger than all the limits hold runs alone on an idle engine (a 400
            # would refuse lists within the documented 1024 prompts that vLLM serves, e.g.
            # LangChain's 1000-input embedding chunks); while it runs, others get a 429.
            would_wait = 0
        if limit >= 0 and waiting + would_wait > limit:
            asks = "" if sequences == 1 else f" This request is {sequences} sequences (prompts × n)."
            return Rejection("queue_full", 429, self.retry_after(waiting + (would_wait if sequences > 1 else 0)),
                             f"The server is overloaded: the batch is full ({self.max_num_seqs} requests "
                             f"run at once) and {waiting} requests are waiting "
                             f"(--max-waiting-requests {limit}).{asks} Retry later.")
        bound = self.config.max_queue_delay
        delay = self.predicted_delay(tenant_in_flight)
        # No finish rate yet (a cold start; or, with the engine's timing stats off, none
        # finished within DRAIN_WINDOW_S): the delay is unknown (inf) and refuses nothing,
        # so the configured --max-waiting-requests holds from the first request. Treating
        # "unknown" as "too long" refused every request that would wait until one had
        # finished: --max-num-seqs 1 --max-waiting-requests 1 answered a cold burst of 6
        # with 5 x 429, and 2 x 200 once warm (fresh-user trial). No prior service time
        # fits every model and device (milliseconds on a GPU, seconds on a starved CPU),
        # and a wrong guess refuses what the operator's limit admits; the count bound is
        # the operator's own choice and holds either way. Once a request has finished,
        # the measured rate bounds the wait as documented.
        if limit >= 0 and bound > 0 and math.isfinite(delay) and delay > bound:
            # Retry once the excess has drained: the request would then wait about the bound.
            retry = int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(delay - bound))))
            return Rejection("queue_delay", 429, retry, f"The server is overloaded: a new request would wait about "
                                                        f"{delay:.1f} s to start (--max-queue-delay {bound:g}). "
                                                        "Retry later.")
        pending = self.num_pending if tenant_in_flight is None else min(self.num_pending, tenant_in_flight)
        total = self.stats.num_total_blocks
        need = self.stats.num_used_blocks + (pending + sequences) * self.blocks_per_request
        if limit >= 0 and self.uses_kv_cache and pending > 0 and total > 0 and need > total:
            return Rejection("kv_cache_full", 429, self.retry_after(pending),
                             f"The server is overloaded: the KV cache ({total} blocks) cannot hold the "
                             f"{pending} admitted requests that are not running yet. Retry later.")
        return None

    def drain_rate(self) -> float:
        """Requests per second a full batch is predicted to finish: ``max_num_seqs`` over
        the average time in the batch, or the measured finish rate when that is higher
        (stats off: no times); 0.0 until a request has finished (a cold start)."""
        little = self.max_num_seqs / max(self.service_s, 1e-3) if self.service_s is not None else 0.0
        return max(little, self.drain.rate())

    def retry_after(self, backlog: int) -> int:
        """Whole seconds (1..MAX_RETRY_AFTER_S) for ``backlog`` requests to drain at
        :meth:`drain_rate`, the rate the queue-delay check admits by (the measured rate
        alone is a lightly loaded engine's, far below a full batch's)."""
        return self.drain.retry_after(backlog, self.drain_rate())

    def predicted_delay(self, tenant_in_flight: Optional[int] = None) -> float:
        """Seconds a request admitted now would wait for a batch slot (0: one is free).
        The requests ahead of it: admitted ones beyond ``max_num_seqs`` or the engine's
        own queue (requests with n > 1 fill several slots), whichever is more. An encoder
        (pooling: each finishes within the step that runs it) never waits long: 0.
        ``math.inf`` while no finish rate is known (a cold start): unknown, which
        :meth:`check` does not refuse."""
        ahead = max(self.in_flight - self.max_num_seqs, self.stats.num_waiting_reqs)
        if tenant_in_flight is not None:
            ahead = min(ahead, tenant_in_flight)
        if not self.uses_kv_cache or (ahead <= 0 and self.in_flight < self.max_num_seqs):
            return 0.0
        if tenant_in_flight is not None and tenant_in_flight < self._fair_seats(tenant_in_flight):
            return 0.0  # the engine's fair share gives it a flooder's seat at once (core/fair_share.py)
        rate = self.drain_rate()
        return (max(ahead, 0) + 1) / rate if rate > 0 else math.inf  # inf: unknown (no finish rate yet)

    def _fair_seats(self, tenant_in_flight: int) -> int:
        """Batch seats a tenant with ``tenant_in_flight`` sequences in flight is sure of
        under fair share: an equal split of ``max_num_seqs`` between the tenants with
        sequences in flight, itself included (at least one). Below it, the scheduler
        preempts another tenant's newest seat for its request instead of queueing it, so
        it does not wait for a slot: a full batch of a flooder's requests at a cold start
        (no finish rate yet, an infinite predicted wait) refused a quiet tenant's single
        request with 429 queue_delay."""
        tenants = len(self.tenant_in_flight) + (1 if tenant_in_flight == 0 else 0)
        return max(1, self.max_num_seqs // max(1, tenants))

    def body_receiving(self, delta: int) -> None:
        """A request body began (+1) or stopped (-1) arriving (BodyLimitMiddleware)."""
        self.receiving += delta
        self._report()

    def _report(self) -> None:
        if self.stat_logger is not None and hasattr(self.stat_logger, "set_admission_queue"):
            self.stat_logger.set_admission_queue(self.receiving, self.num_waiting, self.in_flight)

    def admit(self, tenant_in_flight: Optional[int] = None, fan: FanOut = ONE,
              tenant: Optional[str] = None, count_refusal: bool = True) -> Optional[Rejection]:
        """Admit a request (None) or return why not; a refusal is counted in /metrics
        (unless ``count_refusal`` is false: the caller then counts it, or not, with
        :meth:`count_refusal`). An admitted request must be ``release()``d (with the same
        ``fan`` and ``tenant``) when its response ends. ``tenant_in_flight``: see
        :meth:`check`. ``fan``: the request's fan-out (fan_out.py): it takes
        ``fan.sequences`` of the limits (one larger than :attr:`capacity` is admitted only
        on an idle engine, see :meth:`check`). ``tenant``: the tenant's name, whose
        sequences in flight are counted."""
        rejection = self.check(tenant_in_flight, fan.sequences)
        if rejection is not None:
            if count_refusal:
                self.count_refusal(rejection)
            return rejection
        if not self._engine_busy():
            self.last_progress = self.clock()  # the stall clock starts with the work
        if self.in_flight <= 0:  # our own count, as release() ends the busy period by it
            self.drain.start_work()
        self.in_flight += fan.sequences
        if tenant is not None:
            self.tenant_in_flight[tenant] = self.tenant_in_flight.get(tenant, 0) + fan.sequences
        self._report()
        return None

    def count_refusal(self, rejection: Rejection) -> None:
        """Count a refusal in ``vllm:request_rejected_total{reason=...}``."""
        if self.stat_logger is not None:
            self.stat_logger.record_rejection(rejection.reason)

    def release(self, fan: FanOut = ONE, tenant: Optional[str] = None) -> None:
        """An admitted request's response ended (any way): its sequences count toward the
        drain rate (finished requests per second, as the engine's batch frees slots)."""
        self.in_flight -= fan.sequences
        if tenant is not None:
            left = self.tenant_in_flight.get(tenant, 0) - fan.sequences
            if left > 0:
                self.tenant_in_flight[tenant] = left
            else:
                self.tenant_in_flight.pop(tenant, None)
        for _ in range(min(fan.sequences, _MAX_DRAIN_RECORDS)):
            self.drain.record()
        if self.in_flight <= 0:
            self.drain.stop_work()  # idle from now: not counted in the drain rate
        self._report()

    def deadline_exceeded(self) -> None:
        """A request was aborted at its deadline (counted in /metrics)."""
        if self.stat_logger is not None:
            self.stat_logger.record_deadline_exceeded()

    # ---- liveness ------------------------------------------------------------------
    def stalled_for(self) -> float:
        """Seconds the engine has gone without progress while busy, when that exceeds
        ``engine_stall_timeout`` (0 otherwise, and always 0 when the timeout is 0)."""
        timeout = self.config.engine_stall_timeout
        if timeout <= 0 or not self._engine_busy():
            return 0.0
        idle = self.clock() - self.last_progress
        return idle if idle > timeout else 0.0


class AdmissionMiddleware:
    """Pure ASGI middleware: admission and the ``X-Request-Timeout`` deadline for POSTs
    to :data:`TRACKED_PATHS`, once the body has arrived (BodyLimitMiddleware, outside
    this one, receives it whole first) and before it is parsed. A refusal answers 429/503 with
    ``Retry-After``; a bad header 400; otherwise the deadline is set for the handler and
    the request is released when its response (streamed or not) ends. The controller is
    ``state.admission`` (set by ``init_app_state``); without one requests pass.

    A request it would refuse is first checked as its route checks it
    (admission_precheck.py, with ``prechecks`` and the app's ``router``): a malformed one
    gets its route's own error (a 400...), not the 429, and is not counted as refused."""

    def __init__(self, app: Any, state: Any, prechecks: Optional[Prechecks] = None, router: Any = None):
        self.app = app
        self.state = state
        self.prechecks = prechecks
        self.router = router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        controller = getattr(self.state, "admission", None)
        if controller is None or scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        root = scope.get("root_path", "") or ""
        path = scope["path"][len(root):] if root and scope["path"].startswith(root) else scope["path"]
        if path not in TRACKED_PATHS:
            return await self.app(scope, receive, send)
        try:
            timeout = parse_request_timeout(Headers(scope=scope).get(REQUEST_TIMEOUT_HEADER))
        except ValueError as e:
            status, body = error_response_from_exception(e)
            return await json_response(body, status)(scope, receive, send)
        # The body arrived whole (BodyLimitMiddleware): its fan-out (prompts × n) is what
        # the request takes of the limits; several models: the serving engine's controller.
        body, receive = await _buffered_body(receive)
        if hasattr(controller, "controller_for"):
            controller = controller.controller_for(path, body)
        fan = fan_out_of(body, path)
        tenant = tenant_of(scope).name
        rejection = controller.admit(_tenant_in_flight(scope, controller, tenant), fan, tenant, count_refusal=False)
        if rejection is not None:
            if self.prechecks is not None:  # validation first: a malformed request gets its own error
                own = await malformed_response(self.prechecks, self.router, self.state, scope, path, body,
                                               Headers(scope=scope).get("content-type"))
                if own is not None:
                    return await own(scope, receive, send)
            controller.count_refusal(rejection)
            _tenant_outcome(scope, rejection.reason)
            response = json_response(make_error(rejection.message, rejection.status, param=rejection.param),
                                     rejection.status)
            if rejection.retry_after is not None:
                response.headers["Retry-After"] = str(rejection.retry_after)
            return await response(scope, receive, send)
        _tenant_outcome(scope, None)
        token = set_deadline(None if timeout is None else
                             Deadline(time.monotonic() + timeout, controller.deadline_exceeded))
        try:
            await self.app(scope, receive, send)
        finally:
            reset_deadline(token)
            controller.release(fan, tenant)


def _tenant_outcome(scope: dict, reason: Optional[str]) -> None:
    """Tell TenantQuotaMiddleware (when it tracks the request) the admission's verdict:
    ``reason`` of the refusal, or None (admitted), for ``vllm:tenant_requests_total``."""
    report = (scope.get("state") or {}).get(TENANT_OUTCOME_KEY)
    if report is not None:
        report(reason)


def _tenant_in_flight(scope: dict, controller: Any, tenant: str) -> Optional[int]:
    """Sequences in flight of the scope's tenant (``tenant``) before this request, when the
    engine shares itself fairly between tenants and TenantQuotaMiddleware tracks tenants,
    else None. Sequences, not calls: a tenant's fan-out of 16,384 is that many ahead of
    its next request (it counted as one)."""
    if (scope.get("state") or {}).get(TENANT_IN_FLIGHT_KEY) is None or not getattr(controller, "fair_share", False):
        return None
    return controller.tenant_in_flight.get(tenant, 0)


async def _buffered_body(receive: Any) -> tuple[bytes, Any]:
    """The request body (already buffered by BodyLimitMiddleware, so this does not wait
    on the client) and a ``receive`` that replays it to the app."""
    messages, more = [], True
    while more:
        message = await receive()
        messages.append(message)
        more = message["type"] == "http.request" and message.get("more_body", False)
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")

    async def replay() -> dict:
        return messages.pop(0) if messages else await receive()
    return body, replay


def _engines(engine_client: Any) -> list[Any]:
    """The engine clients behind the app's (several with ``--extra-model``: EngineGroup)."""
    return list(getattr(engine_client, "engines", None) or [engine_client])


def engine_healing(engine_client: Any) -> bool:
    """Whether a self-heal restart (``--restart-engine-on-failure``) of one of the engines
    is under way: the old process is gone, the new one not yet up (self_heal.EngineHealer)."""
    return any(getattr(getattr(e, "healer", None), "restarting", False) for e in _engines(engine_client))


def engine_restarting_error() -> ErrorResponse:
    """The 503 body of ``/health`` and ``/ready`` while a self-heal restart is under way."""
    return make_error("The engine is restarting after a failure (self-heal): no engine serves now; requests in "
                      "flight resume when it is up.", 503, err_type="EngineRestartingError")


def engine_stalled_error(state: Any) -> Optional[ErrorResponse]:
    """The 503 body ``/health`` answers when the app's engine is stalled (see
    :meth:`AdmissionController.stalled_for`), else None."""
    controller = getattr(state, "admission", None)
    stalled = controller.stalled_for() if controller is not None else 0.0
    if not stalled:
        return None
    return make_error(f"The engine has made no progress for {stalled:.1f} s while requests are in flight "
                      f"(--engine-stall-timeout {controller.config.engine_stall_timeout:g}).", 503,
                      err_type="EngineStalledError")


def readiness_error(state: Any) -> Optional[tuple[ErrorResponse, Optional[int]]]:
    """Why the app is not ready for new requests (the 503 body and a Retry-After), or
    None when it is: starting (no engine or controller yet), engine dead or stopped, its
    start after a level-2 sleep failed (Retry-After: the next request tries again),
    engine stalled, or a new request would be refused (draining, over the limit)."""
    engine = getattr(state, "engine_client", None)
    controller = getattr(state, "admission", None)
    if engine is None or controller is None:
        return make_error("The server is starting.", 503), None
    if engine.errored or not getattr(engine, "is_running", True):
        return make_error("The engine is not running.", 503, err_type="EngineDeadError"), None
    start_error = getattr(engine, "start_error", None)
    if start_error is not None:  # ended by a level-2 sleep and its last start failed
        return (make_error(f"The engine is not running: {start_error}", 503, err_type="EngineStartError"),
                start_error.retry_after)
    stalled = engine_stalled_error(state)
    if stalled is not None:
        return stalled, None
    rejection = controller.check()
    if rejection is not None:
        return make_error(f"Not ready ({rejection.reason}): {rejection.message}", 503), rejection.retry_after
    return None


def make_admission_controller(engine_client: Any, args: Any, stat_logger: Any = None) -> AdmissionController:
    """The server's controller for ``engine_client``'s config and the serve flags,
    registered as one of its stat loggers (so it sees every batch of engine outputs).
    An engine client without a config or stat loggers (a test double) gets the server
    defaults (128 sequences, 16-token blocks) and no engine feed."""
    config = getattr(engine_client, "vllm_config", None)
    # The batch this server fills: every data-parallel rank it feeds runs max_num_seqs
    # (one rank's would count the other ranks' running requests as waiting).
    max_num_seqs = config.scheduler_config.max_num_seqs * ranks_fed(getattr(config, "parallel_config", None)) \
        if config is not None else 128
    block_size = config.cache_config.block_size if config is not None else 16
    encoder = bool(getattr(getattr(config, "model_config", None), "is_encoder_only", False))
    controller = AdmissionController(admission_config_from_args(args, max_num_seqs), block_size=block_size,
                                     max_num_seqs=max_num_seqs, stat_logger=stat_logger, uses_kv_cache=not encoder)
    # the engine's fair share between tenants (core/fair_share.py): see check()
    controller.fair_share = bool(getattr(getattr(config, "scheduler_config", None), "tenant_fair_share", False))
    controller.is_restarting = lambda: engine_healing(engine_client)
    loggers = getattr(engine_client, "stat_loggers", None)
    if loggers is not None:  # one controller per engine client: a rebuilt app state replaces it
        loggers[:] = [sl for sl in loggers if not isinstance(sl, AdmissionController)] + [controller]
    return controller
