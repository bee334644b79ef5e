"""Clients of the EngineCore (vLLM's EngineCoreClient family).

* InprocClient: the EngineCore in this process; ``get_output`` runs one step.
* SyncMPClient: EngineCoreProc in a child process, blocking calls (used by LLMEngine).
* AsyncMPClient: same, asyncio calls (used by AsyncLLM).
* DPAsyncMPClient: the AsyncMPClient of one data-parallel rank (external load balancing);
  ``DPLBAsyncMPClient`` (``dp_client.py``) balances over several ranks' AsyncMPClients.

``EngineCoreClient.make_client`` (LLMEngine) and ``make_async_mp_client`` (AsyncLLM) pick
one. The process plumbing (spawn, sockets, death monitor, cleanup) is in
``core_process.py``; here are only the clients.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Optional

import zmq
import zmq.asyncio

from llmserve.config import EngineConfig
from llmserve.engine import core_process
from llmserve.engine.core_process import MPResources, monitor_engine_process, spawn_engine_process
from llmserve.engine.dp_client import DPLBAsyncMPClient, rank_config
from llmserve.engine.exceptions import EngineDeadError, EngineInitError
from llmserve.engine.messages import (
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    StreamingInputChunk,
    UtilityRequest,
)
from llmserve.engine.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)


class EngineCoreClient:
    """Base class of the clients of an EngineCore (vLLM's ``EngineCoreClient``)."""

    @staticmethod
    def make_client(multiprocess_mode: bool, asyncio_mode: bool, vllm_config: EngineConfig,
                    executor_class: Optional[type] = None, log_stats: bool = False) -> "EngineCoreClient":
        """The client for a mode: ``AsyncMPClient`` (asyncio), ``SyncMPClient``
        (multiprocess) or ``InprocClient`` (the EngineCore in this process). Raises
        ValueError for asyncio without multiprocess."""
        if asyncio_mode:
            if not multiprocess_mode:
                raise ValueError("asyncio_mode needs multiprocess_mode (the async client talks to an "
                                 "engine process)")
            return EngineCoreClient.make_async_mp_client(vllm_config, executor_class, log_stats)
        if multiprocess_mode:
            return SyncMPClient(vllm_config, executor_class, log_stats)
        return InprocClient(vllm_config, executor_class, log_stats)

    @staticmethod
    def make_async_mp_client(vllm_config: EngineConfig, executor_class: Optional[type] = None,
                             log_stats: bool = False, client_addresses: Optional[dict[str, str]] = None,
                             client_count: int = 1, client_index: int = 0) -> "AsyncMPClient":
        """The asyncio client for the topology, chosen once (vLLM's signature):
        ``DPAsyncMPClient`` (``data_parallel_external_lb``: this front end owns rank
        ``data_parallel_rank``), ``DPLBAsyncMPClient`` (``data_parallel_size > 1``) or
        ``AsyncMPClient``. ``client_addresses`` ({"input_address", "output_address"}):
        the engine was started elsewhere (``--api-server-count``, see
        ``entrypoints/openai/multi_api_server.py``) and this is API server
        ``client_index`` of ``client_count``. Raises ValueError for a combination not
        supported. With internal-LB data parallel (``data_parallel_size`` N > 1) each
        address is a list of N, one per rank (the launcher started the N engines)."""
        if not 0 <= client_index < max(client_count, 1):
            raise ValueError(f"client_index={client_index} is out of range [0, {client_count})")
        if (client_count > 1) != bool(client_addresses):
            raise ValueError("client_addresses and client_count > 1 go together (several API servers "
                             "share engines started elsewhere)")
        missing = {"input_address", "output_address"} - set(client_addresses or {"input_address": 1,
                                                                                   "output_address": 1})
        if missing:
            raise ValueError(f"client_addresses lacks {sorted(missing)}")
        pc = getattr(vllm_config, "parallel_config", None)
        internal_lb = pc is not None and pc.data_parallel_size > 1 and not pc.data_parallel_external_lb
        if client_addresses:
            _check_client_addresses(client_addresses, pc.data_parallel_size if internal_lb else None)
        if pc is not None and pc.data_parallel_external_lb:
            return DPAsyncMPClient(vllm_config, executor_class, log_stats, client_addresses, client_index)
        if internal_lb:
            return DPLBAsyncMPClient(vllm_config, executor_class, log_stats, client_index, client_addresses,
                                     rank_client=AsyncMPClient)
        return AsyncMPClient(vllm_config, executor_class, log_stats, client_addresses, client_index)

    def shutdown(self, timeout: Optional[float] = None) -> None:
        pass

    # ---- LoRA utilities (vLLM's EngineCoreClient): LoRAAdapterError / LoRANotFoundError
    # for what the engine refuses, naming the field.
    def _lora_call(self, method: str, *args: Any) -> Any:
        from llmserve.lora.errors import reraise_lora_error

        try:
            return self.call_utility(method, *args)
        except RuntimeError as e:
            reraise_lora_error(e)
            raise

    def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter (``LoRARequest``); False when it was loaded already."""
        return self._lora_call("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter (once its requests finish); False when it is not loaded."""
        return self._lora_call("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        from llmserve.lora.errors import lora_ids

        return lora_ids(self._lora_call("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        """Keep an adapter loaded past the max_cpu_loras LRU."""
        return self._lora_call("pin_lora", lora_id)

    async def _lora_call_async(self, method: str, *args: Any) -> Any:
        from llmserve.lora.errors import reraise_lora_error

        try:
            return await self.call_utility_async(method, *args)
        except RuntimeError as e:
            reraise_lora_error(e)
            raise

    async def add_lora_async(self, lora_request: Any) -> bool:
        return await self._lora_call_async("add_lora", lora_request)

    async def remove_lora_async(self, lora_id: int) -> bool:
        return await self._lora_call_async("remove_lora", lora_id)

    async def list_loras_async(self) -> set[int]:
        from llmserve.lora.errors import lora_ids

        return lora_ids(await self._lora_call_async("list_loras"))

    async def pin_lora_async(self, lora_id: int) -> bool:
        return await self._lora_call_async("pin_lora", lora_id)


def _check_client_addresses(client_addresses: dict, dp_size: Optional[int]) -> None:
    """ValueError unless each address is a string (one engine), or, with internal-LB data
    parallel (``dp_size``), a list of ``dp_size`` strings (one per rank)."""
    for key in ("input_address", "output_address"):
        addr = client_addresses[key]
        if dp_size is None:
            if not isinstance(addr, str):
                raise ValueError(f"client_addresses[{key!r}] must be one address, got {addr!r}")
        elif not (isinstance(addr, (list, tuple)) and len(addr) == dp_size
                  and all(isinstance(a, str) for a in addr)):
            raise ValueError(f"client_addresses[{key!r}] must list one address per data parallel rank "
                             f"({dp_size}), got {addr!r}")


class InprocClient(EngineCoreClient):
    """The EngineCore runs in this process; each ``get_output`` is one ``step``."""

    def __init__(self, vllm_config: EngineConfig, executor_class: Optional[type] = None,
                 log_stats: bool = False) -> None:
        from llmserve.engine.core import EngineCore

        self.engine_core = EngineCore(vllm_config, executor_class, log_stats)
        self.num_blocks = self.engine_core.num_blocks
        # The disk KV tier's warm-up, all of it now: an in-process engine has no idle time
        # between start and the first request (EngineCoreProc does it while idle).
        while self.engine_core.restore_kv_tier():
            pass

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

    def shutdown(self, timeout: Optional[float] = None) -> None:
        self.engine_core.shutdown()


class MPClient(EngineCoreClient):
    """Shared part of the multiprocess clients: spawn, handshake, sockets, cleanup."""

    def __init__(self, config: EngineConfig, asyncio_mode: bool, executor_class: Optional[type] = None,
                 log_stats: bool = False, client_addresses: Optional[dict[str, str]] = None,
                 client_index: int = 0) -> None:
        self.config = config
        # client_addresses: the engine was started elsewhere (several API servers); this
        # client binds those addresses, does not own the process and never stops it.
        self.client_addresses = client_addresses
        self.client_index = client_index
        self._executor_class = executor_class
        self._log_stats = log_stats
        self.resources = res = MPResources()
        self._finalizer = weakref.finalize(self, res)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.engine_dead = False
        self.dead_error: Optional[str] = None
        self._call_ids = itertools.count()
        if client_addresses:
            input_addr = client_addresses["input_address"]
            self.output_addr = output_addr = client_addresses["output_address"]
        else:
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
        res.input_socket = None if client_addresses else in_sock  # SHUTDOWN only from the owner
        if not client_addresses:
            res.proc = spawn_engine_process(config, input_addr, output_addr, executor_class, log_stats)
        self._in_sock_sync = in_sock
        self._out_sock_sync = out_sock
        self.ready: Optional[EngineCoreReady] = None
        self.wait_until_ready()

    def wait_until_ready(self) -> None:
        """Wait for the engine's READY handshake. Raises EngineInitError (a RuntimeError)
        with the engine's own start-up error (the process is cleaned up first)."""
        if self.ready is not None:
            return
        res = self.resources
        try:
            self.ready = self._wait_ready(self._out_sock_sync, res.proc)
        except BaseException:
            self._finalizer()
            raise
        self.num_blocks = self.ready.num_blocks
        if res.proc is not None:  # else the process that started the engine watches it
            threading.Thread(target=monitor_engine_process,
                             args=(res.proc, self.output_addr, self._sync_ctx, res.stop_event),
                             daemon=True, name="EngineCoreMonitor").start()
        self._on_ready()

    def _on_ready(self) -> None:
        pass

    def _wait_ready(self, out_sock, proc) -> EngineCoreReady:
        timeout = core_process.STARTUP_TIMEOUT_S
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if out_sock.poll(200):
                msg: EngineCoreOutputs = self.decoder.decode(out_sock.recv())
                if msg.dead is not None:
                    proc.join(timeout=10)
                    raise EngineInitError(msg.dead.message or "Engine start-up failed")
                if msg.ready is not None:
                    return msg.ready
            elif proc is not None and not proc.is_alive():
                if out_sock.poll(1000):  # its start-up error, sent just before it exited, may still be in flight
                    continue
                raise EngineInitError(f"Engine process exited during start-up (exit code {proc.exitcode}); "
                                   "see the log above for the cause")
        raise EngineInitError(f"Engine did not start within {timeout:.0f} s")

    def _check_dead(self, outs: EngineCoreOutputs) -> None:
        if outs.dead is not None:
            self.engine_dead = True
            self.dead_error = outs.dead.message
            raise EngineDeadError(f"EngineCore died: {outs.dead.message}")

    def _ensure_alive(self) -> None:
        if self.engine_dead:
            raise EngineDeadError(f"EngineCore died: {self.dead_error}")

    @property
    def engine_pid(self) -> Optional[int]:
        if self.resources.proc:
            return self.resources.proc.pid
        return self.ready.pid if self.ready is not None else None

    def kill_engine(self) -> None:
        """SIGKILL the engine process (a stalled one: SIGKILL also ends a stopped process);
        the death monitor then reports it as dead."""
        proc = self.resources.proc
        if proc is not None:
            proc.kill()
        elif self.ready is not None:  # started elsewhere: its starter's monitor reports the death
            import os
            import signal

            try:
                os.kill(self.ready.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine process and release the sockets within ``timeout`` seconds."""
        if self._finalizer.alive:
            self._finalizer.detach()
            self.resources(timeout)


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
    if outs.dead is not None:
        client.engine_dead = True
        client.dead_error = outs.dead.message
        for fut in client.utility_results.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(f"EngineCore died: {outs.dead.message}"))
        client.utility_results.clear()
    return False


class SyncMPClient(MPClient):
    """Blocking client. A reader thread puts outputs on a queue and resolves utility
    futures."""

    def __init__(self, vllm_config: EngineConfig, executor_class: Optional[type] = None,
                 log_stats: bool = False) -> None:
        self.outputs_queue: queue.Queue = queue.Queue()
        self.utility_results: dict[int, Future] = {}
        self._lock = threading.Lock()
        super().__init__(vllm_config, False, executor_class, log_stats)

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
            if outs.dead is not None:
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

    def __init__(self, vllm_config: EngineConfig, executor_class: Optional[type] = None,
                 log_stats: bool = False, client_addresses: Optional[dict[str, str]] = None,
                 client_index: int = 0) -> None:
        super().__init__(vllm_config, True, executor_class, log_stats, client_addresses, client_index)
        self._async_in = None
        self._async_out = None
        self.utility_results: dict[int, asyncio.Future] = {}
        self._outputs_queue: Optional[asyncio.Queue] = None
        self._reader_task: Optional[asyncio.Task] = None

    def _ensure_sockets(self) -> None:
        if self._async_in is None:
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
        try:
            await self._async_in.send_multipart([rtype.value, self.encoder.encode(payload)], copy=False)
        except zmq.ZMQError as e:  # the sockets were closed under a pending send: the engine is gone
            raise EngineDeadError(f"EngineCore is gone ({e})") from None
        except asyncio.CancelledError:
            # ``respawn_async`` closing the socket cancels a send that waited for the dead
            # engine (a PUSH with no peer blocks); only a real cancellation propagates.
            task = asyncio.current_task()
            if self.engine_dead and task is not None and not task.cancelling():
                raise EngineDeadError("EngineCore died while a message was being sent") from None
            raise

    async def respawn_async(self) -> "AsyncMPClient":
        """Stop this client's engine process (dead or stalled: it is killed), release its
        sockets, and return a new client of a fresh engine with the same config (new
        sockets, so nothing queued for the old engine reaches the new one). The model
        loads in a worker thread; the event loop stays free. Raises RuntimeError when the
        new engine fails to start."""
        if self.client_addresses:
            raise EngineDeadError("the engine was started by another process (--api-server-count); "
                                  "this API server cannot restart it")
        self.engine_dead = True  # from now on nothing is sent to (or read from) this engine
        self._cancel_reader()
        res = self.resources
        if self._finalizer.alive:
            self._finalizer.detach()
        res.stop_event.set()
        if res.proc is not None and res.proc.is_alive():
            res.proc.kill()
        # Close the asyncio sockets first: that fails sends still waiting for the dead
        # engine (see ``_send``); closing only the sockets underneath would leave them hanging.
        for sock in (self._async_in, self._async_out):
            if sock is not None:
                sock.close(linger=0)
        loop = asyncio.get_running_loop()
        if res.proc is not None:
            await loop.run_in_executor(None, res.proc.join, 5.0)
        res(0)  # the process is gone: this only closes the sockets and removes their dir
        return await loop.run_in_executor(None, lambda: type(self)(self.config, self._executor_class, self._log_stats))

    def _cancel_reader(self) -> None:
        if self._reader_task is not None and not self._reader_task.done():
            try:
                self._reader_task.cancel()
            except RuntimeError:  # its event loop is already closed
                pass

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        if self.client_index:
            request.client_index = self.client_index
        await self._send(EngineCoreRequestType.ADD, request)

    async def add_streaming_input_async(self, chunk: StreamingInputChunk) -> None:
        """Send a later input chunk (or the end of input) of a streaming-input request."""
        await self._send(EngineCoreRequestType.STREAMING_INPUT, chunk)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.engine_dead:
            await self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.utility_results[call_id] = fut
        await self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args), self.client_index))
        return await fut

    def shutdown(self, timeout: Optional[float] = None) -> None:
        self._cancel_reader()
        super().shutdown(timeout)


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
        if outs.dead is not None:
            return


class DPAsyncMPClient(AsyncMPClient):
    """The client of ONE data-parallel rank, for external load balancing (vLLM's
    ``DPAsyncMPClient`` under ``--data-parallel-external-lb``): each API server owns rank
    ``data_parallel_rank`` of ``data_parallel_size`` and a load balancer in front spreads
    the requests. An ``AsyncMPClient`` whose outputs carry ``engine_index = rank`` (so
    stats and ``/metrics`` are labelled ``engine="<rank>"``); the engine gets
    ``cores / data_parallel_size_local`` threads (the ranks on this host share it).
    ``data_parallel_rank`` on a request must be this rank or None (ValueError)."""

    def __init__(self, vllm_config: Any, executor_class: Optional[type] = None, log_stats: bool = False,
                 client_addresses: Optional[dict[str, str]] = None, client_index: int = 0) -> None:
        pc = vllm_config.parallel_config
        self.data_parallel_rank = pc.data_parallel_rank or 0
        cfg = rank_config(vllm_config, pc.data_parallel_size_local or 1)
        super().__init__(cfg, executor_class, log_stats, client_addresses, client_index)

    async def get_output_async(self) -> EngineCoreOutputs:
        outs = await super().get_output_async()
        outs.engine_index = self.data_parallel_rank
        return outs

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        pinned = request.data_parallel_rank
        if pinned is not None and pinned != self.data_parallel_rank:
            raise ValueError(f"data_parallel_rank={pinned}: this server owns rank {self.data_parallel_rank} "
                             "only (--data-parallel-external-lb)")
        await super().add_request_async(request)
