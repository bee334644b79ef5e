"""Sleep level 2 in the server: the engine process ends, and a fresh one starts on wake.

Why a process exit: asleep in-process (llmserve/worker/sleep_mode.py) the engine still
holds what its imports built, and without swap none of that can go back to the OS.
Measured on SmolLM2-135M Q4_1 (engine RSS 455 MiB awake, 360 MiB of it anonymous):
asleep in-process it kept 325 MiB (230 MiB anonymous: ``import torch`` alone is 143 MiB
anonymous, its C++ registries and Python modules; the imports made while loading add
~60 MiB of Python objects; the rest is file pages of shared libraries, which the API
server and every other torch process map too, so ``madvise(MADV_PAGEOUT)`` frees none of
them). Ending the process frees all of it; level 2 already drops the model files from
the page cache, so its wake reads them from disk either way and a fresh start adds the
interpreter's start (imports) to the wake. Level 1 stays in-process: its wake must be fast.

``ProcessRest`` does it for an ``AsyncLLM`` whose client owns its engine process (an
``AsyncMPClient``; not data parallel, not an engine started by another process
(``--api-server-count``), not in-process): the client is swapped for ``EngineAtRest``
while the process is gone. ``/health`` (``check_health``), ``/metrics``
(``get_engine_stats``: the sleeping engine's last figures) and ``/is_sleeping`` answer
from the stand-in; ``wake_up`` and the first request after the sleep start the engine
again (one start for any number of callers). A partial wake (``tags``) of an ended
engine starts all of it: a fresh engine loads the weights and the KV cache together.
A start that fails (e.g. the model file was moved away) raises EngineStartError: the
request or ``/wake_up`` gets 503 with Retry-After naming the cause, ``/health`` and
``/ready`` answer 503 until a later start succeeds (the next request or wake tries again).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)


class EngineAtRest:
    """The client while the engine process is gone: not dead (``engine_dead`` False, so
    ``/health`` is 200), no pid, and nothing to send. ``stats``: the figures
    ``get_engine_stats`` answers with (the sleeping engine's, taken before it ended).
    ``ended``: the client of the ended engine (its config and class start the next)."""

    engine_dead = False
    dead_error: Optional[str] = None
    engine_pid: Optional[int] = None
    client_addresses = None

    def __init__(self, ended: Any, stats: dict) -> None:
        self.ended = ended
        self.stats = dict(stats, num_running_reqs=0, num_waiting_reqs=0, num_used_blocks=0,
                          kv_cache_usage=0.0, pid=None)
        self.num_blocks = getattr(ended, "num_blocks", 0)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Nothing runs in an ended engine: nothing to abort."""

    def kill_engine(self) -> None:
        """No process to kill."""

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """The ended engine's sockets were released when it ended."""


def can_end_process(client: Any) -> bool:
    """Whether ``client`` owns an engine process it can end and start again: exactly an
    ``AsyncMPClient`` (a DP client's engines, or an engine started by another process,
    stay in-process at level 2), with its process."""
    from llmserve.engine.core_client import AsyncMPClient

    return (type(client) is AsyncMPClient and not client.client_addresses
            and getattr(client.resources, "proc", None) is not None)


async def _stop_client(client: Any) -> None:
    """Stop ``client``'s engine process and release its sockets, in the order that keeps
    the event loop's registrations right: the reader task ends first; SHUTDOWN goes out
    on the bound input socket and the process is joined (up to 5 s, off the loop); the
    asyncio sockets close on the loop (closing them from another thread left their file
    descriptors registered with the loop, and the next engine's sockets, given the same
    numbers, never saw their messages: a request after the wake hung); then the rest
    (SIGTERM/SIGKILL if the process is still there, the context, the socket directory)."""
    loop = asyncio.get_running_loop()
    res = client.resources
    res.stop_event.set()  # its exit is not a death: the monitor stays quiet
    client._cancel_reader()
    if client._reader_task is not None:
        await asyncio.gather(client._reader_task, return_exceptions=True)
    if res._send_shutdown(0.2) and res.proc is not None:
        await loop.run_in_executor(None, res.proc.join, 5.0)
    for sock in (client._async_in, client._async_out):
        if sock is not None:
            sock.close(linger=0)
    if client._finalizer.alive:
        client._finalizer.detach()
    await loop.run_in_executor(None, res, 5.0)


def _start_error(e: BaseException) -> BaseException:
    """The EngineStartError for the failed start ``e``, its message naming the cause."""
    from llmserve.engine.exceptions import EngineStartError

    cause = str(e) if type(e).__name__ in str(e) else f"{type(e).__name__}: {e}"
    return EngineStartError(f"The engine could not be started again after sleep level 2 ({cause}); "
                            "the next request or /wake_up tries again")


class ProcessRest:
    """Ends and restarts the engine process behind ``holder`` (a CoreHolder; see the
    module docstring). ``stop_output_handler()`` cancels the AsyncLLM's output handler
    (it reads the ended client's socket); ``start_output_handler()`` starts one on the
    new client."""

    def __init__(self, holder: Any, stop_output_handler: Any, start_output_handler: Any) -> None:
        self.holder = holder
        self._stop_handler = stop_output_handler
        self._start_handler = start_output_handler
        self._lock = asyncio.Lock()
        # The last failed start (an EngineStartError) while the engine stays at rest; None
        # once a start succeeds. /health and /ready answer 503 with it meanwhile.
        self.start_error: Optional[BaseException] = None

    @property
    def at_rest(self) -> bool:
        return isinstance(self.holder.client, EngineAtRest)

    async def end(self, stats: dict, busy: Any = lambda: False) -> Optional[float]:
        """End the (already sleeping) engine process; ``stats``: its last ``get_stats``.
        ``busy()``: whether requests are registered with the AsyncLLM; a request that came
        after the in-process sleep has woken the engine, which then keeps running (None
        is returned). Returns the seconds the end took (the process is joined), 0.0 when
        it was ended already."""
        async with self._lock:
            client = self.holder.client
            if isinstance(client, EngineAtRest):
                return 0.0
            if busy():  # checked and swapped in one step of the event loop: no request slips in
                logger.info("Sleep level 2: a request arrived during the sleep; the engine stays up")
                return None
            t0 = time.perf_counter()
            self.holder.client = EngineAtRest(client, stats)
            await self._stop_handler()
            await _stop_client(client)
            dt = time.perf_counter() - t0
            logger.info("Sleeping (level 2): engine process %s ended in %.2f s", client.engine_pid, dt)
            return dt

    async def start(self) -> bool:
        """Start a fresh engine when the last one was ended; True when this call started
        it. The model loads in a worker thread (the event loop stays free); callers that
        arrive meanwhile wait for the same start. Raises EngineStartError (a 503 on the
        server, naming the cause) when the engine fails to start; the server stays at rest
        and ``start_error`` holds it, so the next request tries again."""
        if not self.at_rest:
            return False
        async with self._lock:
            rest = self.holder.client
            if not isinstance(rest, EngineAtRest):
                return False
            ended = rest.ended
            t0 = time.perf_counter()
            try:
                client = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: type(ended)(ended.config, ended._executor_class, ended._log_stats))
            except Exception as e:  # noqa: BLE001 - any start failure is reported the same way
                self.start_error = _start_error(e)
                logger.error("Wake-up (level 2) failed: %s", self.start_error)
                raise self.start_error from e
            self.start_error = None
            self.holder.client = client
            self._start_handler()
            logger.info("Woke up (level 2): engine process %s started in %.2f s", client.engine_pid,
                        time.perf_counter() - t0)
            return True
