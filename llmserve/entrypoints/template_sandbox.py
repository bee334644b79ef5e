"""Request chat templates: refused unless trusted, and then rendered in worker processes
with a time and a memory bound (vLLM's ``--trust-request-chat-template``; the bounds are
beyond vLLM, which renders a trusted request template in the API server itself).

A request's ``chat_template`` (or a ``chat_template`` inside ``chat_template_kwargs``) is
a 400 naming the field unless the server runs with ``--trust-request-chat-template``, as
in vLLM. The server's own ``--chat-template`` and the model's template are the
operator's and keep rendering in the API server's renderer threads.

When trusted, a request template is rendered by one of ``--request-chat-template-workers``
worker processes (``python -m llmserve.entrypoints.template_sandbox``), each holding a copy
of the tokenizer and running transformers' ``apply_chat_template`` (its
``ImmutableSandboxedEnvironment``: no attribute access to Python internals, ``range`` of at
most 100,000), so the prompt is the one the API server would render itself. A worker:

- may allocate ``--request-chat-template-memory`` bytes beyond what it holds when ready
  (``RLIMIT_AS``): a template that needs more (``{% set x = 'a' * 1000000000 %}``) gets a
  MemoryError there, answered 400 (param ``chat_template``);
- is killed (SIGKILL) and replaced when the render passes
  ``--request-chat-template-timeout`` seconds (400, param ``chat_template``) or the
  request's ``X-Request-Timeout`` (408, param ``X-Request-Timeout``; the time spent
  waiting for a free worker counts against it too), or when the client disconnects (the
  handler is cancelled);
- answers in JSON (the API server unpickles nothing a worker writes), with at most the
  prompt character bound of the context (``PromptCharLimit``; 4x that for a request
  that asks for truncation), so a huge rendered prompt never reaches the API server's
  memory (and the API server reads no answer longer than that).

The workers bound resources; they are not a security boundary beyond jinja2's sandbox
(no seccomp, same user). Without the flag nothing of this runs.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY = "512MiB"
DEFAULT_WORKERS = 2
MIN_MEMORY_BYTES = 16 << 20
# A request that asks for truncation may render past the context; its text is still bounded.
TRUNCATING_CHARS_FACTOR = 4
_MiB = 1 << 20


@dataclass(frozen=True)
class RequestTemplateConfig:
    """How request chat templates are handled.

    trust: ``--trust-request-chat-template`` (vLLM's): accept a request's template.
    timeout_s: ``--request-chat-template-timeout``: seconds a render may take (> 0).
    memory_bytes: ``--request-chat-template-memory``: bytes a render may allocate in its
      worker (>= 16 MiB). num_workers: ``--request-chat-template-workers`` (>= 1).
    Raises ValueError naming the field for a bad value.
    """

    trust: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: int = 512 * _MiB
    num_workers: int = DEFAULT_WORKERS

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"request_chat_template_timeout must be a positive number of seconds, "
                             f"got {self.timeout_s!r}")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes < MIN_MEMORY_BYTES:
            raise ValueError(f"request_chat_template_memory must be at least {MIN_MEMORY_BYTES >> 20}MiB, "
                             f"got {self.memory_bytes!r}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"request_chat_template_workers must be an integer >= 1, got {self.num_workers!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RequestTemplateConfig":
        """From the serve flags (their defaults where a namespace lacks them)."""
        from llmserve.engine_args import parse_bytes

        try:
            memory = parse_bytes(getattr(args, "request_chat_template_memory", None) or DEFAULT_MEMORY)
        except ValueError as e:
            raise ValueError(f"request_chat_template_memory: {e}") from None
        timeout = getattr(args, "request_chat_template_timeout", None)
        workers = getattr(args, "request_chat_template_workers", None)
        return cls(trust=bool(getattr(args, "trust_request_chat_template", False)),
                   timeout_s=DEFAULT_TIMEOUT_S if timeout is None else timeout, memory_bytes=memory,
                   num_workers=DEFAULT_WORKERS if workers is None else workers)


def add_request_template_args(group: argparse._ArgumentGroup) -> None:
    """The serve flags of request chat templates."""
    group.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=False,
                       help="Accept a request's chat_template (chat, tokenize, embeddings, responses; also "
                            "chat_template_kwargs.chat_template), as vLLM; without it such a request is a 400 "
                            "naming the field. Request templates render in worker processes with the "
                            "--request-chat-template-* bounds; --chat-template is not affected.")
    group.add_argument("--request-chat-template-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help="Seconds a request's chat_template may take to render in its worker before the "
                            "worker is killed and the request is a 400; a shorter X-Request-Timeout wins "
                            "(then a 408).")
    group.add_argument("--request-chat-template-memory", type=str, default=DEFAULT_MEMORY,
                       help="Memory a request's chat_template may allocate in its worker process (RLIMIT_AS "
                            "beyond the worker's own), e.g. 512MiB; more is a 400.")
    group.add_argument("--request-chat-template-workers", type=int, default=DEFAULT_WORKERS,
                       help="Worker processes that render request chat templates (with "
                            "--trust-request-chat-template; each holds a copy of the tokenizer).")


def check_request_template_args(args: argparse.Namespace) -> None:
    """Raise ValueError (naming the flag) for a bad request-template flag value."""
    RequestTemplateConfig.from_args(args)


# ----------------------------------------------------------------------------- the worker
def _address_space_bytes() -> Optional[int]:
    """This process's virtual memory size (VmSize), or None where /proc has none."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _limit_memory(extra_bytes: int) -> None:
    """RLIMIT_AS = what the worker holds now + ``extra_bytes`` (never above the hard limit)."""
    import resource

    now = _address_space_bytes()
    if now is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = now + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _render_request(tokenizer: Any, prompt_limit: Any, request: dict[str, Any]) -> tuple:
    """One render in the worker: ``("ok", text)``, ``("error", message, param)`` or
    ``("memory", message)``."""
    from llmserve.entrypoints.chat_utils import apply_chat_template
    from llmserve.sampling_params import SamplingParamsError

    check_length = request.pop("check_length")
    try:
        text = apply_chat_template(tokenizer, **request)
        if prompt_limit is not None:
            if check_length:
                prompt_limit.check([text], "messages")
            elif len(text) > TRUNCATING_CHARS_FACTOR * prompt_limit.limit:
                return ("error", f"The request's chat_template rendered {len(text)} characters, more than "
                                 f"{TRUNCATING_CHARS_FACTOR * prompt_limit.limit} (even with truncation).",
                        "chat_template")
        return ("ok", text)
    except MemoryError:
        return ("memory", "")
    except SamplingParamsError as e:
        if isinstance(e.__cause__, MemoryError):
            return ("memory", "")
        return ("error", str(e), e.param)


def _exit_with_parent() -> None:
    """A thread that ends the worker once the API server is gone (a render in progress
    would not notice the closed connection until it finished)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _worker_main(fd: int, memory_bytes: int) -> None:
    """Serve renders on the connection ``fd`` until it closes. The first message is the
    pickled (tokenizer, prompt_limit); the worker answers ``("ready",)`` once its memory
    is limited."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    tokenizer, prompt_limit = pickle.loads(conn.recv_bytes())
    _exit_with_parent()
    _limit_memory(memory_bytes)
    _answer(conn, ("ready",))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the API server closed the connection or exited
            return
        _answer(conn, _render_request(tokenizer, prompt_limit, request))


def _answer(conn: Any, message: tuple) -> None:
    # JSON, not pickle: the API server must not unpickle what a process running a
    # client's template wrote
    conn.send_bytes(json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass"))


class _Worker:
    """One worker process and its connection. ``start``/``call`` block (run them in a
    thread); ``kill`` may be called from any thread and makes a blocked ``call`` return None."""

    def __init__(self, memory_bytes: int, max_answer_bytes: int) -> None:
        from multiprocessing.connection import Connection

        self.max_answer_bytes = max_answer_bytes
        ours, theirs = socket.socketpair()
        # its own session: a Ctrl-C at the terminal is the API server's to handle, not the worker's
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno()), str(memory_bytes)],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.killed = False

    def start(self, payload: bytes) -> bool:
        """Send the tokenizer; True once the worker is ready."""
        return self._exchange(lambda: self.conn.send_bytes(payload)) == ("ready",)

    def call(self, request: dict[str, Any]) -> Optional[tuple]:
        """One render; None if the worker died or was killed meanwhile."""
        return self._exchange(lambda: self.conn.send(request))

    def _exchange(self, send: Any) -> Optional[tuple]:
        try:
            send()
            answer = json.loads(self.conn.recv_bytes(self.max_answer_bytes).decode("utf-8", "surrogatepass"))
            if isinstance(answer, list) and answer and all(isinstance(v, (str, int, type(None))) for v in answer):
                return tuple(answer)
        except (EOFError, OSError, ValueError, RecursionError):  # gone, or an answer past the size cap
            pass
        self.reap()  # no answer, or not one a worker writes
        return None

    def kill(self) -> None:
        self.killed = True
        try:
            self.proc.kill()
        except OSError:
            pass

    def reap(self) -> None:
        """Kill, close the connection and wait for the process (a thread's job: it blocks)."""
        self.kill()
        self.conn.close()
        self.proc.wait()


class TemplateSandbox:
    """A pool of ``config.num_workers`` template workers (see the module docstring).

    tokenizer: the API server's tokenizer (pickled to each worker). prompt_limit: the
    renderer's ``PromptCharLimit`` (None: rendered text is not bounded by length). Workers
    start at once, in background threads; the pool is not tied to one event loop.
    Raises ValueError when the tokenizer cannot be pickled.
    """

    def __init__(self, tokenizer: Any, prompt_limit: Any, config: RequestTemplateConfig) -> None:
        self.config = config
        try:
            self._payload = pickle.dumps((tokenizer, prompt_limit))
        except Exception as e:  # a tokenizer class that pickle cannot copy
            raise ValueError(f"--trust-request-chat-template: this tokenizer cannot be copied to the template "
                             f"workers ({type(e).__name__}: {e})") from e
        self._threads = ThreadPoolExecutor(2 * config.num_workers + 1, thread_name_prefix="llmserve-template")
        self._lock = threading.Lock()
        # the longest rendered text a worker returns, as JSON (6 bytes for an escaped character)
        limit = getattr(prompt_limit, "limit", None)
        self._max_answer_bytes = (6 * TRUNCATING_CHARS_FACTOR * limit if limit else 256 * _MiB) + _MiB
        self._idle: list[_Worker] = []
        self._workers: set[_Worker] = set()  # every live worker, idle or busy
        self._waiters: collections.deque = collections.deque()  # (loop, future) awaiting a worker
        self._closed = False
        _LIVE.add(self)
        for _ in range(config.num_workers):
            self._spawn()

    # -- the pool
    def _spawn(self) -> None:
        """Start a worker in a thread; it joins the pool when ready (retried after a
        failed start, which is logged)."""
        def start() -> None:
            worker, ok = None, False
            try:
                worker = _Worker(self.config.memory_bytes, self._max_answer_bytes)
                with self._lock:
                    if not self._closed:  # else shutdown has run: this worker is not to be
                        self._workers.add(worker)
                ok = not self._closed and worker.start(self._payload)
            except OSError:
                pass
            if ok:
                self._release(worker)
                return
            self._forget(worker)
            if worker is not None:
                worker.reap()
            if self._closed:  # killed by shutdown while starting
                return
            import logging

            logging.getLogger(__name__).error("A request chat template worker failed to start; retrying in 1 s.")
            time.sleep(1.0)
            if not self._closed:
                self._spawn()

        if not self._closed:
            try:
                self._threads.submit(start)
            except RuntimeError:  # shut down meanwhile
                pass

    def _release(self, worker: _Worker) -> None:
        """Hand ``worker`` to the oldest live waiter, else back to the idle list."""
        with self._lock:
            if self._closed:
                worker.kill()
                return
            while self._waiters:
                loop, fut = self._waiters.popleft()
                if not fut.done() and not loop.is_closed():
                    loop.call_soon_threadsafe(self._hand_over, fut, worker)
                    return
            self._idle.append(worker)

    def _hand_over(self, fut: asyncio.Future, worker: _Worker) -> None:
        if fut.done():  # cancelled between the handover and now: give it to the next
            self._release(worker)
        else:
            fut.set_result(worker)

    async def _acquire(self) -> _Worker:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._idle:
                return self._idle.pop()
            fut = loop.create_future()
            self._waiters.append((loop, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed over just as we were cancelled
                self._release(fut.result())
            raise

    def _forget(self, worker: Optional[_Worker]) -> None:
        if worker is not None:
            worker.kill()
            with self._lock:
                self._workers.discard(worker)

    def _discard(self, worker: _Worker) -> None:
        """Kill ``worker`` (its thread reaps it) and start a replacement."""
        self._forget(worker)
        self._spawn()

    # -- a render
    async def render(self, conversation: list[dict[str, Any]], chat_template: str, *,
                     add_generation_prompt: bool, continue_final_message: bool,
                     chat_template_kwargs: Optional[dict[str, Any]], tools: Optional[list[dict[str, Any]]],
                     check_length: bool) -> str:
        """The template text of ``conversation`` (plain dicts) with the request's
        ``chat_template``, rendered by a worker within the time bound (the module docstring).

        Raises SamplingParamsError (400: param ``chat_template`` for the bounds, else the
        template error's), RequestDeadlineExceeded (408) past ``X-Request-Timeout``;
        CancelledError (a disconnect) kills the worker too."""
        from llmserve.entrypoints.openai.deadline import current_deadline

        deadline = current_deadline()
        request = {"conversation": conversation, "chat_template": chat_template, "tools": tools,
                   "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "chat_template_kwargs": chat_template_kwargs, "check_length": check_length}
        worker = await self._acquire_within(deadline)
        if worker is None:
            raise self._timeout_error(deadline)
        render_s = self.config.timeout_s
        by_deadline = deadline is not None and deadline.remaining() < render_s
        result = await self._call_within(worker, request, deadline.remaining() if by_deadline else render_s)
        if result is None:
            raise self._timeout_error(deadline if by_deadline else None)
        return self._unpack(result)

    async def _acquire_within(self, deadline: Any) -> Optional[_Worker]:
        """A free worker; None when the request's deadline passes first. Without a
        deadline the wait has no bound of its own: each busy worker is free (or killed and
        replaced) within the render bound, and admission bounds how many requests wait."""
        timeout = None if deadline is None else max(0.0, deadline.remaining())
        acquiring = asyncio.ensure_future(self._acquire())
        try:
            done, _ = await asyncio.wait({acquiring}, timeout=timeout)
        except BaseException:  # cancelled: the client went away (or the server stops)
            acquiring.cancel()
            raise
        if not done:
            acquiring.cancel()
            return None
        return acquiring.result()

    async def _call_within(self, worker: _Worker, request: dict[str, Any], timeout: float) -> Optional[tuple]:
        """The worker's answer, or None past ``timeout`` seconds (the worker is killed)."""
        call = asyncio.get_running_loop().run_in_executor(self._threads, worker.call, request)
        try:
            done, _ = await asyncio.wait({call}, timeout=max(0.0, timeout))
        except BaseException:  # cancelled: the client went away (or the server stops)
            self._discard(worker)
            raise
        if not done or call.result() is None:
            self._discard(worker)
            return None if not done else ("died", worker.proc.returncode)
        self._release(worker)
        return call.result()

    def _timeout_error(self, deadline: Any) -> Exception:
        from llmserve.entrypoints.openai.deadline import REQUEST_TIMEOUT_HEADER, RequestDeadlineExceeded
        from llmserve.sampling_params import SamplingParamsError

        if deadline is not None:
            if deadline.on_expire is not None:
                deadline.on_expire()
            return RequestDeadlineExceeded(f"The request's chat_template did not finish rendering within its "
                                           f"{REQUEST_TIMEOUT_HEADER}; the render was stopped.")
        return SamplingParamsError(f"The request's chat_template did not finish rendering within "
                                   f"{self.config.timeout_s:g} s (--request-chat-template-timeout); the render "
                                   f"was stopped.", "chat_template")

    def _unpack(self, result: tuple) -> str:
        from llmserve.sampling_params import SamplingParamsError

        kind = result[0]
        if kind == "ok":
            return result[1]
        if kind == "memory":
            raise SamplingParamsError(f"The request's chat_template needed more than "
                                      f"{self.config.memory_bytes / _MiB:g} MiB to render "
                                      f"(--request-chat-template-memory).", "chat_template")
        if kind == "died":
            raise SamplingParamsError(f"The request's chat_template stopped its render worker (exit status "
                                      f"{result[1]}); the worker was replaced.", "chat_template")
        raise SamplingParamsError(result[1], result[2])

    def shutdown(self) -> None:
        """Kill every worker; renders in flight return errors."""
        with self._lock:
            self._closed = True
            workers, self._idle = list(self._workers), []
            self._workers.clear()
        for worker in workers:
            worker.kill()
        for worker in workers:  # reap them (SIGKILL takes effect at once)
            try:
                worker.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        self._threads.shutdown(wait=False, cancel_futures=True)


_LIVE: "weakref.WeakSet[TemplateSandbox]" = weakref.WeakSet()


def _shutdown_all() -> None:
    for sandbox in list(_LIVE):
        sandbox.shutdown()


# At interpreter exit, before the non-daemon threads are joined (concurrent.futures uses the
# same hook): a pool thread blocked on a worker's answer would otherwise hold the exit for as
# long as that worker renders.
if hasattr(threading, "_register_atexit") and __name__ != "__main__":
    threading._register_atexit(_shutdown_all)


if __name__ == "__main__":  # a worker: python -m llmserve.entrypoints.template_sandbox FD MEMORY_BYTES
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_main(int(sys.argv[1]), int(sys.argv[2]))
