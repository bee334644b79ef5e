"""``CompileQueue``: the engine's grammar compiles, off the step loop, on a few threads.

Why not a plain ``ThreadPoolExecutor(1)`` (what the manager used before): one slow
grammar (tester log 12: a ``json_schema`` enum of 20,000 strings compiles ~10 s, one of
100,000 strings > 240 s) held the only thread, so every structured request behind it
waited for it (a ``json_object`` request took 8.3 s instead of 0.1 s), and an aborted
request's compile ran on (and its result was cached) after its client had gone.

What this queue does instead:

* Several workers (``workers`` threads, started on demand). A *large* grammar (its spec
  is at least ``large_bytes`` long) may hold at most ``workers - 1`` of them, so a small
  grammar always finds a worker free of large compiles; jobs otherwise start first come,
  first served (a large job at the head is skipped only while the large workers are
  busy, so small jobs cannot starve it).
* One compile per grammar key in flight: a request whose key is already queued or
  compiling waits for that compile.
* Each waiter has its own ``Future``. Cancelling it (an aborted request) detaches it from
  its job; a job left without waiters is dropped before it starts (never compiled), and
  one that was already compiling has its result dropped (not cached, no matcher built).
  xgrammar cannot stop a running compile, so its thread runs to the end.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


class _Job:
    """One grammar key to compile. ``waiters``: the futures still wanting the result, each
    with the function that turns the compiled grammar into its value (a matcher)."""

    __slots__ = ("key", "large", "waiters", "running")

    def __init__(self, key: Any, large: bool) -> None:
        self.key = key
        self.large = large
        self.waiters: dict[Future, Callable[[Any], Any]] = {}
        self.running = False


class CompileQueue:
    """Compiles grammar keys on up to ``workers`` threads.

    Args:
      compile_fn: ``compile_fn(key) -> compiled`` (runs in a worker; may raise: the error
        goes to every waiter's future).
      keep_fn: ``keep_fn(key, compiled)``, called in the worker after a compile that still
        has waiters (the backend's cache); never called for a dropped result.
      workers: threads at most (>= 1).
      large_bytes: a grammar whose ``size`` (its spec's length in characters) is at least
        this is "large": at most ``max(1, workers - 1)`` large compiles run at once.
    Counters (for tests and logs): ``compiled`` (compiles that ran), ``skipped`` (jobs
    dropped before they started), ``dropped`` (results dropped because every waiter left
    while compiling). Thread-safe.
    """

    def __init__(self, compile_fn: Callable[[Any], Any], keep_fn: Callable[[Any, Any], None],
                 workers: int, large_bytes: int) -> None:
        if workers < 1:
            raise ValueError(f"CompileQueue: workers must be >= 1, got {workers}")
        self._compile_fn, self._keep_fn = compile_fn, keep_fn
        self._workers, self._large_bytes = workers, large_bytes
        self._max_large = max(1, workers - 1)
        self._cv = threading.Condition()
        self._pending: deque[_Job] = deque()
        self._jobs: dict[Any, _Job] = {}  # key -> job queued or running
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._running_large = 0
        self._closed = False
        self.compiled = self.skipped = self.dropped = 0

    # ---- submitting and cancelling -------------------------------------------
    def submit(self, key: Any, size: int, finish: Callable[[Any], Any]) -> Future:
        """A future for ``finish(compiled grammar of key)`` (``finish`` runs in the worker).
        ``size``: the spec's length, which decides whether the job is large. Cancelling
        the future withdraws this waiter. Raises RuntimeError after ``shutdown``."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("CompileQueue: shut down")
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(key, size >= self._large_bytes)
                self._pending.append(job)
                self._start_worker_if_needed()
                self._cv.notify()
            job.waiters[fut] = finish
        fut.add_done_callback(lambda f, job=job: self._on_done(job, f))
        return fut

    def _on_done(self, job: _Job, fut: Future) -> None:
        """A waiter's future finished; when it was cancelled, detach it, and drop a job
        that has no waiters left and has not started."""
        if not fut.cancelled():
            return
        with self._cv:
            job.waiters.pop(fut, None)
            if job.waiters or job.running or self._jobs.get(job.key) is not job:
                return
            self._pending.remove(job)
            del self._jobs[job.key]
            self.skipped += 1

    def _start_worker_if_needed(self) -> None:
        if self._idle == 0 and len(self._threads) < self._workers:
            t = threading.Thread(target=self._worker, name=f"llmserve-grammar-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()

    # ---- workers ----------------------------------------------------------------
    def _next_job(self) -> Optional[_Job]:
        """The oldest pending job allowed to start now (a large one only while fewer than
        ``max_large`` large compiles run), marked running; None when none may start."""
        for job in self._pending:
            if not job.large or self._running_large < self._max_large:
                self._pending.remove(job)
                job.running = True
                self._running_large += job.large
                return job
        return None

    def _worker(self) -> None:
        while True:
            with self._cv:
                self._idle += 1
                job = self._next_job()
                while job is None and not self._closed:
                    self._cv.wait()
                    job = self._next_job()
                self._idle -= 1
                if job is None:
                    return
            self._run(job)

    def _run(self, job: _Job) -> None:
        error: Optional[BaseException] = None
        compiled: Any = None
        try:
            compiled = self._compile_fn(job.key)
        except Exception as e:  # noqa: BLE001 - handed to the waiters, never kills the worker
            error = e
        with self._cv:
            self.compiled += 1
            self._running_large -= job.large
            del self._jobs[job.key]
            waiters = [(f, fin) for f, fin in job.waiters.items() if not f.cancelled()]
            job.waiters.clear()
            if not waiters and error is None:
                self.dropped += 1
            self._cv.notify_all()  # a large slot may be free again
        if not waiters:
            return
        if error is None:
            self._keep_fn(job.key, compiled)
        for fut, finish in waiters:
            _resolve(fut, finish, compiled, error)

    def shutdown(self) -> None:
        """Stop the workers after their current compile; pending waiters are cancelled."""
        with self._cv:
            self._closed = True
            pending = [f for job in self._pending for f in job.waiters]
            self._cv.notify_all()
        for fut in pending:
            fut.cancel()


def _resolve(fut: Future, finish: Callable[[Any], Any], compiled: Any, error: Optional[BaseException]) -> None:
    """Set ``fut`` to ``finish(compiled)`` (or the error); a future cancelled meanwhile is
    left alone."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(finish(compiled))
    except InvalidStateError:  # cancelled between the check and now
        pass
    except Exception as e:  # noqa: BLE001 - finish failed: this waiter's error
        try:
            fut.set_exception(e)
        except InvalidStateError:
            pass
