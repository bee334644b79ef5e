"""Clients of the EngineCore (vLLM's EngineCoreClient family).

* InprocClient: the EngineCore in this process; ``get_output`` runs one step.
* SyncMPClient: EngineCoreProc in a child process, blocking calls (used by LLMEngine).
* AsyncMPClient: same, asyncio calls (used by AsyncLLM).

The multiprocess clients bind two ZMQ ``ipc://`` sockets in a private temp dir, spawn
the engine process, and wait for its READY handshake (or its start-up error). A monitor
thread watches the process sentinel: if the process dies, it pushes an ENGINE_CORE_DEAD
message into the client's own output socket, so every waiter wakes within a second.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Optional

import zmq
import zmq.asyncio

from llmserve.config import EngineConfig
from llmserve.engine.exceptions import EngineDeadError
from llmserve.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
)
from llmserve.engine.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("LLMSERVE_ENGINE_STARTUP_TIMEOUT", "600"))


class EngineCoreClient:
    """Base class; ``make_client`` picks the implementation."""

    @staticmethod
    def make_client(multiprocess_mode: bool, asyncio_mode: bool, config: EngineConfig) -> "EngineCoreClient":
        if asyncio_mode:
            if not multiprocess_mode:
                raise ValueError("asyncio mode needs multiprocess mode")
            return AsyncMPClient(config)
        if multiprocess_mode:
            return SyncMPClient(config)
        return InprocClient(config)

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    """The EngineCore runs in this process; each ``get_output`` is one ``step``."""

    def __init__(self, config: EngineConfig) -> None:
        from llmserve.engine.core import EngineCore

        self.engine_core = EngineCore(config)
        self.num_blocks = self.engine_core.num_blocks

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, list(args))

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_stats(self) -> dict:
        return self.engine_core.get_stats()


class _MPResources:
    """Everything to clean up; used by weakref.finalize so no cycle holds the client."""

    def __init__(self) -> None:
        self.proc: Optional[_Proc] = None
        self.ctx: Optional[zmq.Context] = None
        self.tmpdir: Optional[str] = None
        self.sockets: list = []
        self.input_socket: Optional[zmq.Socket] = None
        self.stop_event = threading.Event()

    def _send_shutdown(self) -> bool:
        """Queue SHUTDOWN on the bound input socket (a plain zmq.Socket, also under the
        async client, whose asyncio socket shadows it), waiting at most 0.2 s for room.
        Returns False when it could not be queued (no engine connected, socket closed).

        It must go through this socket: the engine's PULL connects to it, so a fresh PUSH
        connecting to the same address would reach this PUSH, not the engine, and the
        message would never arrive."""
        sock = self.input_socket
        if sock is None or sock.closed:
            return False
        try:
            if not sock.poll(200, zmq.POLLOUT):
                return False
            sock.send_multipart([EngineCoreRequestType.SHUTDOWN.value, MsgpackEncoder().encode(None)],
                                flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def __call__(self) -> None:
        self.stop_event.set()
        proc = self.proc
        if proc is not None and proc.is_alive():
            # The engine exits by itself on SHUTDOWN (within a step); SIGTERM, then SIGKILL,
            # only if it does not.
            proc.join(timeout=5 if self._send_shutdown() else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
        for s in self.sockets:
            try:
                s.close(linger=0)
            except Exception:
                pass
        if self.ctx is not None:
            try:
                self.ctx.destroy(linger=0)
            except Exception:
                pass
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


def _spawn_engine_process(config: EngineConfig, input_addr: str, output_addr: str) -> subprocess.Popen:
    """Start ``python -m llmserve.engine.core`` and hand it its start-up arguments (the
    EngineConfig and the socket addresses) on stdin. A fresh interpreter, unlike
    multiprocessing's spawn, never re-imports the user's ``__main__`` module."""
    proc = subprocess.Popen([sys.executable, "-m", "llmserve.engine.core"], stdin=subprocess.PIPE,
                            close_fds=True)
    try:
        proc.stdin.write(pickle.dumps((config, input_addr, output_addr, os.getpid())))
        proc.stdin.close()
    except BrokenPipeError:
        pass
    return _Proc(proc)


class _Proc:
    """The bits of a process handle the clients use (is_alive, join, terminate, kill)."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self):
        return self.popen.poll()

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()


def _monitor(proc: "_Proc", output_addr: str, ctx: zmq.Context, stop: threading.Event) -> None:
    """Watch the engine process; on death, send ENGINE_CORE_DEAD to the output socket."""
    while not stop.is_set():
        proc.join(timeout=0.2)
        if not proc.is_alive():
            if stop.is_set():
                return
            try:
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(output_addr)
                sock.send(MsgpackEncoder().encode(EngineCoreOutputs(
                    engine_dead=True, error=f"EngineCore process died (exit code {proc.exitcode})")))
                sock.close()
            except Exception:
                pass
            return


class MPClient(EngineCoreClient):
    """Shared part of the multiprocess clients: spawn, handshake, sockets, cleanup."""

    def __init__(self, config: EngineConfig, asyncio_mode: bool, wait_ready: bool = True) -> None:
        self.config = config
        self.resources = res = _MPResources()
        self._finalizer = weakref.finalize(self, res)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.engine_dead = False
        self.dead_error: Optional[str] = None
        self._call_ids = itertools.count()
        res.tmpdir = tempfile.mkdtemp(prefix="llmserve-")
        input_addr = f"ipc://{res.tmpdir}/input.sock"
        self.output_addr = output_addr = f"ipc://{res.tmpdir}/output.sock"
        # Sync sockets for the handshake (and the sync client); the async client swaps in
        # asyncio sockets on the same context.
        res.ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        sync_ctx = zmq.Context.shadow(res.ctx.underlying) if asyncio_mode else res.ctx
        self._sync_ctx = sync_ctx
        in_sock = sync_ctx.socket(zmq.PUSH)
        in_sock.bind(input_addr)
        out_sock = sync_ctx.socket(zmq.PULL)
        out_sock.bind(output_addr)
        res.sockets += [in_sock, out_sock]
        res.input_socket = in_sock
        res.proc = proc = _spawn_engine_process(config, input_addr, output_addr)
        self._in_sock_sync = in_sock
        self._out_sock_sync = out_sock
        self.ready_info: Optional[dict] = None
        if wait_ready:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        """Wait for the engine's READY handshake. Raises RuntimeError with the engine's own
        start-up error (the process is cleaned up first)."""
        if self.ready_info is not None:
            return
        res = self.resources
        try:
            self.ready_info = self._wait_ready(self._out_sock_sync, res.proc)
        except BaseException:
            self._finalizer()
            raise
        self.num_blocks = self.ready_info["num_blocks"]
        threading.Thread(target=_monitor, args=(res.proc, self.output_addr, self._sync_ctx, res.stop_event),
                         daemon=True, name="EngineCoreMonitor").start()
        self._on_ready()

    def _on_ready(self) -> None:
        pass

    def _wait_ready(self, out_sock, proc) -> dict:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if out_sock.poll(200):
                msg: EngineCoreOutputs = self.decoder.decode(out_sock.recv())
                if msg.engine_dead:
                    proc.join(timeout=10)
                    raise RuntimeError(msg.error or "Engine start-up failed")
                if msg.ready_info is not None:
                    return msg.ready_info
            elif not proc.is_alive():
                raise RuntimeError(f"Engine process exited during start-up (exit code {proc.exitcode}); "
                                   "see the log above for the cause")
        raise RuntimeError(f"Engine did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def _check_dead(self, outs: EngineCoreOutputs) -> None:
        if outs.engine_dead:
            self.engine_dead = True
            self.dead_error = outs.error
            raise EngineDeadError(f"EngineCore died: {outs.error}")

    def _ensure_alive(self) -> None:
        if self.engine_dead:
            raise EngineDeadError(f"EngineCore died: {self.dead_error}")

    @property
    def engine_pid(self) -> Optional[int]:
        return self.resources.proc.pid if self.resources.proc else None

    def shutdown(self) -> None:
        self._finalizer()


def _route_special(client: "MPClient", outs: EngineCoreOutputs) -> bool:
    """Resolve a utility call's future (returns True: not a step output), or, on
    ENGINE_CORE_DEAD, mark the client dead and fail every pending utility call."""
    if outs.utility_output is not None:
        u = outs.utility_output
        fut = client.utility_results.pop(u.call_id, None)
        if fut is not None and not fut.done():
            if u.failure_message:
                fut.set_exception(RuntimeError(u.failure_message))
            else:
                fut.set_result(u.result)
        return True
    if outs.engine_dead:
        client.engine_dead = True
        client.dead_error = outs.error
        for fut in client.utility_results.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(f"EngineCore died: {outs.error}"))
        client.utility_results.clear()
    return False


class SyncMPClient(MPClient):
    """Blocking client. A reader thread puts outputs on a queue and resolves utility
    futures."""

    def __init__(self, config: EngineConfig, wait_ready: bool = True) -> None:
        self.outputs_queue: queue.Queue = queue.Queue()
        self.utility_results: dict[int, Future] = {}
        self._lock = threading.Lock()
        super().__init__(config, asyncio_mode=False, wait_ready=wait_ready)

    def _on_ready(self) -> None:
        threading.Thread(target=self._reader, daemon=True, name="EngineCoreOutputReader").start()

    def _reader(self) -> None:
        sock = self._out_sock_sync
        stop = self.resources.stop_event
        while not stop.is_set():
            try:
                if not sock.poll(100):
                    continue
                outs: EngineCoreOutputs = self.decoder.decode(sock.recv())
            except zmq.ZMQError:
                return
            if _route_special(self, outs):
                continue
            self.outputs_queue.put(outs)
            if outs.engine_dead:
                return

    def get_output(self) -> EngineCoreOutputs:
        self._ensure_alive()
        outs = self.outputs_queue.get()
        self._check_dead(outs)
        return outs

    def _send(self, rtype: EngineCoreRequestType, payload: Any) -> None:
        self._ensure_alive()
        with self._lock:
            self._in_sock_sync.send_multipart([rtype.value, self.encoder.encode(payload)], copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        call_id = next(self._call_ids)
        fut: Future = Future()
        self.utility_results[call_id] = fut
        self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        return fut.result(timeout=timeout)

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def get_stats(self) -> dict:
        return self.call_utility("get_stats")


class AsyncMPClient(MPClient):
    """asyncio client: outputs are awaited with ``get_output_async``; utility calls are
    awaited on futures resolved by whoever reads the output socket."""

    def __init__(self, config: EngineConfig, wait_ready: bool = True) -> None:
        super().__init__(config, asyncio_mode=True, wait_ready=wait_ready)
        self._async_in = None
        self._async_out = None
        self.utility_results: dict[int, asyncio.Future] = {}
        self._outputs_queue: Optional[asyncio.Queue] = None
        self._reader_task: Optional[asyncio.Task] = None

    def _ensure_sockets(self) -> None:
        if self._async_in is None:
            ctx = self.resources.ctx
            # Re-wrap the already-bound sockets as asyncio sockets.
            self._async_in = zmq.asyncio.Socket.from_socket(self._in_sock_sync)
            self._async_out = zmq.asyncio.Socket.from_socket(self._out_sock_sync)

    def _ensure_reader(self) -> None:
        """Start the output reader task in the running loop (lazily)."""
        self._ensure_sockets()
        if self._reader_task is None or self._reader_task.done():
            self._outputs_queue = asyncio.Queue()
            self._reader_task = asyncio.get_running_loop().create_task(
                _async_reader(weakref.ref(self), self._async_out, self.decoder, self._outputs_queue))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_alive()
        self._ensure_reader()
        outs = await self._outputs_queue.get()
        self._check_dead(outs)
        return outs

    async def _send(self, rtype: EngineCoreRequestType, payload: Any) -> None:
        self._ensure_alive()
        self._ensure_reader()
        await self._async_in.send_multipart([rtype.value, self.encoder.encode(payload)], copy=False)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.engine_dead:
            await self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.utility_results[call_id] = fut
        await self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        return await fut

    def shutdown(self) -> None:
        if self._reader_task is not None and not self._reader_task.done():
            try:
                self._reader_task.cancel()
            except RuntimeError:  # its event loop is already closed
                pass
        super().shutdown()


async def _async_reader(client_ref, sock, decoder, out_queue: asyncio.Queue) -> None:
    """Reads the output socket; holds only a weak reference to the client."""
    while True:
        try:
            data = await sock.recv()
        except (zmq.ZMQError, asyncio.CancelledError):
            return
        outs: EngineCoreOutputs = decoder.decode(data)
        client = client_ref()
        if client is None:
            return
        handled = _route_special(client, outs)
        del client
        if handled:
            continue
        out_queue.put_nowait(outs)
        if outs.engine_dead:
            return
