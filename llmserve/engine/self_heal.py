"""A self-healing engine (beyond vLLM; issue 17 point 5, ``--restart-engine-on-failure``).

When the EngineCore process dies (a crash, SIGKILL) or stalls (no output for
``RestartConfig.stall_timeout`` seconds while requests are in flight, e.g. SIGSTOP: it is
then killed), ``EngineHealer.heal`` starts a fresh engine process with the same config
and resubmits every request in flight, so the API server never exits for it.

A request resumes from the tokens its client already has: the new engine request carries
the original prompt and, in ``EngineCoreRequest.output_token_ids``, the tokens generated so
far, and the engine starts it as if it had been preempted after them. Its output budget,
penalties, ``min_tokens`` and seeded stream (``SeededStream``: a function of (seed, output
position)) therefore continue where they stopped; the OutputProcessor keeps the client-side
state (detokenizer, stop strings, logprobs, sent counts) under the same caller id, with a
fresh engine id (an incarnation), so no token is duplicated or lost. With temperature 0 or
a seed, the resumed text is identical to an undisturbed run.

Requests that cannot resume get an ``EngineRestartedError`` (a 503 on the server):
streaming-input sessions, requests whose prompt logprobs had only partly arrived, and
structured-output requests that had already produced tokens (their grammar state died
with the engine). Pooling requests produce nothing until they finish, so they are simply
resubmitted.

Restarts back off: the first is immediate, the k-th within ``RestartConfig.window`` waits
``backoff * 2**(k-2)`` seconds (at most ``max_backoff``); past ``max_restarts`` within the
window the engine is given up as dead (the server then exits non-zero, as without the flag).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Optional

import msgspec

from llmserve.config import RestartConfig
from llmserve.core.outputs import FinishReason
from llmserve.engine.exceptions import EngineRestartedError
from llmserve.engine.messages import EngineCoreOutput, EngineCoreRequest
from llmserve.engine.output_processor import OutputProcessor, RequestState

logger = logging.getLogger(__name__)


class RestartPolicy:
    """Counts restarts in a sliding window and says how long to wait before the next one.

    ``next_delay(now)`` (``now``: time.monotonic() seconds) records a restart attempt and
    returns its delay in seconds, or None when ``max_restarts`` attempts were already made
    within the last ``window`` seconds (give up)."""

    def __init__(self, config: RestartConfig) -> None:
        self.config = config
        self.attempts: deque[float] = deque()

    def next_delay(self, now: float) -> Optional[float]:
        cfg = self.config
        while self.attempts and now - self.attempts[0] > cfg.window:
            self.attempts.popleft()
        if len(self.attempts) >= cfg.max_restarts:
            return None
        self.attempts.append(now)
        k = len(self.attempts)
        return 0.0 if k == 1 else min(cfg.backoff * 2 ** (k - 2), cfg.max_backoff)


def resume_request(st: RequestState, engine_id: str) -> EngineCoreRequest:
    """The engine request that continues the live request ``st`` under ``engine_id``:
    the original prompt and parameters, with the tokens generated so far as
    ``output_token_ids``. Raises EngineRestartedError when it cannot resume."""
    orig = st.engine_request
    if orig is None:
        raise EngineRestartedError("the engine restarted and this request cannot resume (it was "
                                   "not added through a resumable path); retry it")
    if orig.resumable:
        raise EngineRestartedError("the engine restarted and a streaming-input session cannot resume; "
                                   "start it again")
    if orig.pooling_params is not None or st.detokenizer is None:
        return msgspec.structs.replace(orig, request_id=engine_id)
    out_ids = list(st.detokenizer.token_ids)
    sp = orig.sampling_params
    if sp.prompt_logprobs is not None and st.prompt_logprobs is not None and len(st.prompt_logprobs) > 1:
        if len(st.prompt_logprobs) < len(st.prompt_token_ids):
            raise EngineRestartedError("the engine restarted while this request's prompt logprobs were "
                                       "being computed; retry it")
        # Every prompt logprob has arrived: the new engine need not compute them again
        # (and must not, or they would be sent twice).
        sp = _without_prompt_logprobs(sp)
    if out_ids and getattr(sp, "structured_outputs", None) is not None:
        raise EngineRestartedError("the engine restarted and a structured-output request cannot resume "
                                   "mid-output; retry it")
    return msgspec.structs.replace(orig, request_id=engine_id, sampling_params=sp, output_token_ids=out_ids)


def _without_prompt_logprobs(sp: Any) -> Any:
    import copy

    sp = copy.copy(sp)
    sp.prompt_logprobs = None
    return sp


class CoreHolder:
    """The current engine client, swapped by a restart; the output handler and AsyncLLM
    both read ``client`` through this (no reference to the AsyncLLM)."""

    def __init__(self, client: Any) -> None:
        self.client = client


class EngineHealer:
    """Restarts the engine behind ``holder`` and resumes ``output_processor``'s requests.

    Args: holder (CoreHolder of an AsyncMPClient); output_processor; config
    (RestartConfig); max_model_len (tokens; a request already at it finishes with
    "length" instead of resuming); stat_loggers (each may have ``record_engine_restart()``).

    ``restarting`` is True from the failure until the new engine is up; requests added
    meanwhile are only registered and go to the new engine with the resumed ones.
    ``last_output`` (time.monotonic()) is stamped by the output handler on each engine
    output; ``watch_stalls`` kills an engine that produced none for ``stall_timeout``
    seconds while requests were in flight (the death then goes through ``heal``).
    """

    def __init__(self, holder: CoreHolder, output_processor: OutputProcessor, config: RestartConfig,
                 max_model_len: int, stat_loggers: list) -> None:
        self.holder = holder
        self.output_processor = output_processor
        self.config = config
        self.max_model_len = max_model_len
        self.stat_loggers = stat_loggers
        self.policy = RestartPolicy(config)
        self.restarting = False
        self.num_restarts = 0
        self.recovery_times: list[float] = []  # seconds from failure to resubmission, per restart
        self.last_output = time.monotonic()
        self.stalls_detected = 0

    # ---- restart ---------------------------------------------------------------
    async def heal(self, error: BaseException) -> bool:
        """Replace the dead engine and resubmit the requests in flight. Returns False when
        the restart budget is spent (the caller then treats the engine as dead)."""
        t0 = time.monotonic()
        self.restarting = True
        try:
            while True:
                delay = self.policy.next_delay(time.monotonic())
                if delay is None:
                    logger.error("Engine failed %d times within %.0f s: giving up (%s)", self.config.max_restarts,
                                 self.config.window, error)
                    return False
                logger.warning("EngineCore failed (%s); restarting it%s with %d request(s) in flight", error,
                               f" in {delay:.1f} s" if delay else "", len(self.output_processor.states))
                if delay:
                    await asyncio.sleep(delay)
                try:
                    self.holder.client = await self.holder.client.respawn_async()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the new engine did not start: counts as a failure
                    logger.error("EngineCore restart failed: %s", e)
                    error = e
            reqs = self._resume_all()
        finally:
            self.restarting = False
        self.last_output = time.monotonic()
        for req in reqs:
            await self.holder.client.add_request_async(req)
        self.num_restarts += 1
        self.recovery_times.append(time.monotonic() - t0)
        for sl in self.stat_loggers:
            record = getattr(sl, "record_engine_restart", None)
            if record is not None:
                record()
        logger.warning("EngineCore restarted in %.2f s (restart %d); %d request(s) resumed",
                       time.monotonic() - t0, self.num_restarts, len(reqs))
        return True

    def _resume_all(self) -> list[EngineCoreRequest]:
        """The engine requests that continue every live request (each under a fresh engine
        id); requests that cannot resume get their error, those already at their length
        limit finish with "length". No await inside: requests added concurrently either
        are among these or are sent by their own ``add_request``."""
        op = self.output_processor
        reqs, capped = [], []
        for st in list(op.states.values()):
            n_out = len(st.detokenizer.token_ids) if st.detokenizer is not None else 0
            if n_out and (n_out >= st.params.max_tokens or len(st.prompt_token_ids) + n_out >= self.max_model_len):
                capped.append(st.request_id)
                continue
            try:
                reqs.append(resume_request(st, op.reincarnate(st)))
            except EngineRestartedError as e:
                op.fail_request(st, e)
        if capped:
            op.process_outputs([EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=FinishReason.LENGTH)
                                for rid in capped])
        return reqs

    # ---- stall detection ---------------------------------------------------------
    async def watch_stalls(self) -> None:
        """Kill the engine process when it has made no progress for ``stall_timeout``
        seconds while requests are in flight (a SIGSTOP, a deadlock); its death is then
        healed like a crash. Progress is an engine output, or the engine process using
        CPU time: a slow step (a long prefill, an overloaded host) is not a stall, a
        stopped or blocked process is. Runs until cancelled."""
        timeout = self.config.stall_timeout
        tick = min(1.0, timeout / 4)
        cpu = _EngineCpu()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            client = self.holder.client
            busy = cpu.advanced(client.engine_pid)
            # No engine process (a level-2 sleep ended it; a wake is starting the next, ~2 s
            # quiet, 70 s seen on a loaded host): nothing can stall, as while restarting.
            starting = client.engine_pid is None
            if busy or starting or self.restarting or not self.output_processor.states:
                self.last_output = now  # working, idle, starting or restarting: no stall builds up
                continue
            if now - self.last_output > timeout:
                logger.error("EngineCore made no progress for %.1f s with %d request(s) in flight: "
                             "killing it (pid %s) to restart it", now - self.last_output,
                             len(self.output_processor.states), client.engine_pid)
                self.stalls_detected += 1
                self.last_output = now
                client.kill_engine()


class _EngineCpu:
    """Whether the engine process used CPU time since the last look (more than
    ``MIN_CPU_S``: its idle threads use far less; a stopped process none)."""

    MIN_CPU_S = 0.02

    def __init__(self) -> None:
        self.pid: Optional[int] = None
        self.proc: Any = None
        self.last = 0.0

    def advanced(self, pid: Optional[int]) -> bool:
        """True when process ``pid`` used CPU since the last look, or is a new process (a
        start or restart is progress: the stall clock begins again with it)."""
        import psutil

        if pid is None:  # no engine process (psutil would measure this process instead)
            self.pid = None
            return False
        try:
            if pid != self.pid:
                self.pid, self.proc = pid, psutil.Process(pid)
                self.last = sum(self.proc.cpu_times()[:2])
                return True
            if self.proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                return False
            used = sum(self.proc.cpu_times()[:2])
        except (psutil.Error, ValueError, TypeError):
            return False
        advanced, self.last = used - self.last > self.MIN_CPU_S, used
        return advanced


__all__ = ["CoreHolder", "EngineHealer", "RestartPolicy", "resume_request"]
