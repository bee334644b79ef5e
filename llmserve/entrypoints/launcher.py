"""Serving an app with uvicorn until a signal or the engine's death (vLLM's
``entrypoints/launcher.py``: ``serve_http``).

SIGINT/SIGTERM start a graceful shutdown: in-flight requests get
``timeout_graceful_shutdown`` seconds to finish; half a second before that runs out the
engine client's ``abort_all`` ends those still running (finish_reason "abort", streams
with their last chunk and ``[DONE]``). If the EngineCore dies, the server shuts itself
down the same way.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Awaitable, Callable, Optional

logger = logging.getLogger("llmserve.entrypoints.openai.api_server")


def _make_uvicorn_server(config: Any, on_drain_timeout: Optional[Callable[[], Awaitable[Any]]] = None) -> Any:
    """A uvicorn Server that handles SIGINT/SIGTERM as a graceful shutdown and then
    returns (stock uvicorn re-raises the signal after serving, which would kill the
    process before the engine is shut down).

    ``on_drain_timeout``: awaited half a second before the graceful-shutdown period
    (``config.timeout_graceful_shutdown``) runs out, to end the requests still in flight
    cleanly (``AsyncLLM.abort_all``: streams get a last chunk with finish_reason "abort"
    and ``[DONE]``) instead of having uvicorn cancel their tasks mid-response."""
    import contextlib
    import signal
    import threading

    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets=None):  # noqa: ANN001, ANN202
            grace = self.config.timeout_graceful_shutdown
            task = None
            if on_drain_timeout is not None and grace is not None:
                async def _end_in_flight() -> None:
                    await asyncio.sleep(max(grace - 0.5, 0.0))
                    try:
                        await on_drain_timeout()
                    except Exception:
                        logger.exception("aborting in-flight requests at shutdown failed")
                task = asyncio.create_task(_end_in_flight())
            try:
                await super().shutdown(sockets)
            finally:
                if task is not None:
                    task.cancel()

    return _Server(config)


async def _shutdown_when_engine_dies(server: Any, engine: Any) -> None:
    """Wait for the engine to die, then ask uvicorn to shut down (``server.should_exit``).

    By then the requests in flight hold their EngineDeadError and end with a 503 or an
    error chunk within the graceful-shutdown period; until the listening socket closes,
    new requests and /health get 503."""
    err = await engine.wait_for_engine_death()
    if server.should_exit:  # a signal stopped the server first (it may have reached the engine too)
        logger.info("EngineCore stopped while the server was stopping (%s)", str(err).removeprefix("EngineCore died: "))
        return
    server.engine_died = True
    logger.error("EngineCore died (%s); shutting down the API server",
                 str(err).removeprefix("EngineCore died: "))
    server.should_exit = True


def tcp_listening_socket(host: Optional[str], port: int, reuse_port: bool = False) -> "socket.socket":
    """A TCP socket bound to (host, port) and listening (host None: all IPv4 addresses).
    SO_REUSEADDR as uvicorn sets it; ``reuse_port``: SO_REUSEPORT too (several API servers
    on one port, multi_api_server.py). Raises OSError when it cannot be bound."""
    import socket

    host = host if host is not None else "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted connections only when the
    # socket's proto says TCP; with proto 0, Nagle's algorithm held each streamed chunk
    # until the client's delayed ACK (~40 ms; a 16-token stream arrived in one burst)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError:
        sock.close()
        raise
    return sock


def bind_listening_socket(host: Optional[str], port: int) -> "socket.socket":
    """The server's listening socket, bound before the engine starts (vLLM binds first
    too): a taken port or an unusable host fails the start in a second, not after the
    model loaded (seen in a fresh-user trial: ~3 s and a "Serving ... on" line first).
    Clients that connect while the engine loads wait in the backlog, then get answered.
    Never SO_REUSEPORT: a second server on a taken port must fail. Raises ValueError
    naming the address when it cannot be bound."""
    try:
        return tcp_listening_socket(host, port)
    except OSError as e:
        where = host if host is not None else "0.0.0.0"
        raise ValueError(f"cannot listen on {where}:{port} (--host/--port): {e.strerror or e}") from None


def check_uds_path(path: str) -> None:
    """``--uds PATH`` checked before the engine starts: its folder must exist and be
    writable (uvicorn binds the socket only once the model has loaded, and a missing
    folder was a FileNotFoundError traceback then). Raises ValueError naming the flag."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot listen on the Unix socket {path!r} (--uds): folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"cannot listen on the Unix socket {path!r} (--uds): folder {folder!r} is not writable")


async def serve_http(app: Any, engine_client: Any, sockets: Optional[list] = None, **uvicorn_kwargs: Any) -> bool:
    """Serve ``app`` until SIGINT/SIGTERM or the engine's death.

    uvicorn_kwargs: ``uvicorn.Config`` arguments (host, port, log_level,
    timeout_graceful_shutdown, ...). sockets: already-bound listening sockets to accept
    on instead of host/port (shared by several API servers). Returns after the server
    stopped (the caller shuts the engine down): True when the engine's death stopped it,
    False when a signal did (an engine that ends after the signal, e.g. a group's SIGTERM
    under systemd, is part of that stop, not a failure).
    """
    import uvicorn

    server = _make_uvicorn_server(uvicorn.Config(app, **uvicorn_kwargs), on_drain_timeout=engine_client.abort_all)
    admission = getattr(getattr(app, "state", None), "admission", None)
    if admission is not None:  # new requests get 503 and /ready turns false once shutdown begins
        admission.is_draining = lambda: bool(server.should_exit)
    server.engine_died = False
    watchdog = asyncio.create_task(_shutdown_when_engine_dies(server, engine_client))
    try:
        await server.serve(sockets=sockets)
    finally:
        watchdog.cancel()
    return server.engine_died
