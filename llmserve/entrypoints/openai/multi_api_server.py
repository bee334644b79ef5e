"""Several API-server processes over the same engine(s): ``llmserve serve --api-server-count K``
(vLLM's ``run_multi_api_server``, ``vllm/entrypoints/cli/serve.py``).

When the front end, not the engine, is the bottleneck (short outputs, many clients: HTTP,
JSON, detokenizing and the event loop of one process), K API servers share the work:

* this process (the launcher) binds the listening sockets and starts the engine(s)
  once: one EngineCore process, this server's rank with ``--data-parallel-external-lb``,
  or the ``--data-parallel-size`` N ranks (internal load balancing, cores / N threads
  each); every engine's input/output sockets are one pair per API server
  (``client_addresses``; with N ranks, each address is a list of N, one per rank, and
  each API server's ``DPLBAsyncMPClient`` attaches to all N and balances by the engines'
  reported counts plus its own sends since, without a coordinator);
* it starts K API-server processes, each handed a listening socket of its own, all K bound
  to the one port with ``SO_REUSEPORT`` (uvicorn ``serve(sockets=[sock])``): the kernel
  hashes each new connection to one of them, so the K processes share new connections
  evenly whatever their event loops do. (One socket shared by K accept loops, as vLLM,
  goes to whichever loop wakes first: in CI one process took all of 40 connections.)
  and its ``client_addresses`` / ``client_count`` / ``client_index``, which go to
  ``AsyncLLM``: the engine routes each request's outputs (and utility results) to the API
  server that sent it (``EngineCoreRequest.client_index``, ``engine/client_router.py``);
* ``/metrics`` is one view: every API server writes its metrics to a shared
  ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, as vLLM) and any of
  them serves the sum (counters, histograms) and the most recent engine gauges;
* each response carries ``X-API-Server-Index`` (which process answered);
* SIGINT/SIGTERM of the launcher: every API server drains and exits (SIGTERM), then the
  engine(s) stop; the socket and metrics dirs are removed. If an engine dies, the launcher
  tells every API server (ENGINE_CORE_DEAD), they exit, and so does it, with code 1. If
  an API server exits, the launcher stops the rest.

``--api-server-count`` is refused with ``--extra-model`` and with
``--restart-engine-on-failure`` (an API server does not own the engine).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Awaitable, Callable, Optional

from llmserve.proc_utils import exit_when_parent_dies

logger = logging.getLogger("llmserve.entrypoints.openai.api_server")

API_SERVER_INDEX_HEADER = "X-API-Server-Index"
# How long the launcher waits for the API servers after SIGTERM, beyond their graceful
# shutdown period (their engine client's own shutdown and interpreter exit).
_CHILD_EXIT_MARGIN_S = 15.0


RunServer = Callable[..., Awaitable[int]]
"""``api_server.run_server``: passed in by the callers (``api_server.main``, ``llmserve
serve``), so this launcher never imports the API server module it launches (no import
circle; the child processes import it in this file's ``__main__`` block)."""


def run_api_servers(args: argparse.Namespace, run_server: RunServer) -> int:
    """Serve with ``args.api_server_count`` API servers (this process alone when 1, with
    ``run_server``). Returns the exit code (0, or 1 when the engine died)."""
    if getattr(args, "api_server_count", 1) > 1:
        return run_multi_api_server(args)
    return asyncio.run(run_server(args))


def check_multi_api_server_args(args: argparse.Namespace, config: Any) -> None:
    """ValueError naming the flag for what several API servers cannot do."""
    count = args.api_server_count
    if count < 1:
        raise ValueError(f"api_server_count must be >= 1, got {count}")
    if getattr(args, "extra_model", None):
        raise ValueError("--api-server-count > 1 with --extra-model is not supported")
    if args.restart_engine_on_failure:
        raise ValueError("--restart-engine-on-failure with --api-server-count > 1 is not supported: "
                         "an API server does not own the engine (the launcher exits when it dies)")
    pc = config.parallel_config
    if count > 1 and pc.data_parallel_backend == "ray":
        raise ValueError("--api-server-count > 1 with --data-parallel-backend ray is not supported")
    if count > 1 and not pc.data_parallel_external_lb and (pc.data_parallel_size_local or 1) < pc.data_parallel_size:
        raise ValueError("--api-server-count > 1 with multi-node data parallel (--data-parallel-size-local < "
                         "--data-parallel-size) is not supported")


def _engine_topology(config: Any) -> tuple[Any, int]:
    """(the EngineConfig each engine runs, how many engines the launcher starts): this
    server's rank (``--data-parallel-external-lb``), ``data_parallel_size`` ranks (internal
    load balancing, the cores split between them, as ``DPLBAsyncMPClient`` does), or one."""
    from llmserve.engine.dp_client import rank_config

    pc = config.parallel_config
    if pc.data_parallel_external_lb:
        return rank_config(config, pc.data_parallel_size_local or 1), 1
    if pc.data_parallel_size > 1:
        return rank_config(config, pc.data_parallel_size), pc.data_parallel_size
    return config, 1


def _bind(host: Optional[str], port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on one (host, port), one per API server, in one
    ``SO_REUSEPORT`` group (``port`` 0: the first picks a free port, the rest join it).
    Raises OSError when the port is taken."""
    from llmserve.entrypoints.launcher import tcp_listening_socket

    socks: list[socket.socket] = []
    for _ in range(count):
        sock = tcp_listening_socket(host, socks[0].getsockname()[1] if socks else port, reuse_port=True)
        sock.set_inheritable(True)
        socks.append(sock)
    return socks


class _Launcher:
    """The engine process(es) and the K API-server processes of one ``run_multi_api_server``."""

    def __init__(self, args: argparse.Namespace) -> None:
        from llmserve.engine.core_process import MPResources, spawn_engine_process
        from llmserve.engine.dp_client import with_data_parallel_rank
        from llmserve.engine_args import AsyncEngineArgs, UsageContext

        args.restart_engine_on_failure = args.restart_engine_on_failure or False
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config(UsageContext.OPENAI_API_SERVER)
        check_multi_api_server_args(args, config)
        self.count = count = args.api_server_count
        self.grace = args.shutdown_timeout or args.timeout_graceful_shutdown
        self.tmpdir = tempfile.mkdtemp(prefix="llmserve-api-")
        self.metrics_dir = os.path.join(self.tmpdir, "prometheus")
        os.mkdir(self.metrics_dir)
        socks = _bind(args.host, args.port, count)
        args.port = socks[0].getsockname()[1]
        self.engine_config, num_engines = _engine_topology(config)
        # One (input, output) address pair per engine and API server: [engine][api server].
        self.inputs = [[f"ipc://{self.tmpdir}/input-{r}-{i}.sock" for i in range(count)] for r in range(num_engines)]
        self.outputs = [[f"ipc://{self.tmpdir}/output-{r}-{i}.sock" for i in range(count)]
                        for r in range(num_engines)]
        self.internal_lb = num_engines > 1
        self.engines = []
        for r in range(num_engines):
            res = MPResources()
            # No executor class: the engine process picks it from the config
            # (Executor.get_class), so the launcher imports no executor or worker code.
            cfg = with_data_parallel_rank(self.engine_config, r) if self.internal_lb else self.engine_config
            res.proc = spawn_engine_process(cfg, self.inputs[r], self.outputs[r], None, not args.disable_log_stats)
            self.engines.append(res)
        self.stop = threading.Event()
        self.engine_died = False
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir)
        # The parsed flags, less what only the CLI needs (its dispatch function).
        child_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
        self.children = []
        for i in range(count):
            proc = subprocess.Popen([sys.executable, "-m", "llmserve.entrypoints.openai.multi_api_server"],
                                    stdin=subprocess.PIPE, pass_fds=(socks[i].fileno(),), env=env,
                                    start_new_session=True)  # a terminal's Ctrl-C reaches the launcher only
            client = {"client_addresses": self._client_addresses(i), "client_count": count, "client_index": i}
            proc.stdin.write(pickle.dumps((child_args, client, socks[i].fileno(), os.getpid())))
            proc.stdin.close()
            self.children.append(proc)
            # Only the child keeps it: a socket left open here after its child died would
            # take its share of new connections and never accept them.
            socks[i].close()
        logger.info("Started %d API servers (pids %s) over engine pids %s on port %d, socket dir %s", count,
                    [p.pid for p in self.children], [e.proc.pid for e in self.engines], args.port, self.tmpdir)

    def _client_addresses(self, index: int) -> dict[str, Any]:
        """API server ``index``'s addresses: one pair, or (internal-LB data parallel) a list
        of one address per engine rank for each of input and output."""
        if self.internal_lb:
            return {"input_address": [addrs[index] for addrs in self.inputs],
                    "output_address": [addrs[index] for addrs in self.outputs]}
        return {"input_address": self.inputs[0][index], "output_address": self.outputs[0][index]}

    def _watch_engines(self) -> None:
        """On any engine's death, send ENGINE_CORE_DEAD to every API server (on that
        engine's output sockets: each API server's client fails as a whole)."""
        import zmq

        from llmserve.engine.messages import EngineCoreDead, EngineCoreOutputs
        from llmserve.engine.serial import MsgpackEncoder

        while not self.stop.is_set():
            dead = [r for r, e in enumerate(self.engines) if not e.proc.is_alive()]
            if not dead:
                self.stop.wait(0.2)
                continue
            if self.stop.is_set():
                return
            rank = dead[0]
            proc = self.engines[rank].proc
            self.engine_died = True
            logger.error("EngineCore %d died (exit code %s); stopping the API servers", rank, proc.exitcode)
            msg = MsgpackEncoder().encode(EngineCoreOutputs(dead=EngineCoreDead(
                f"EngineCore process died (exit code {proc.exitcode})", exit_code=proc.exitcode)))
            ctx = zmq.Context()
            for addr in self.outputs[rank]:
                s = ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 1000)
                s.connect(addr)
                s.send(msg)
                s.close()
            ctx.term()
            return

    def run(self) -> int:
        """Wait for a signal, the engine's death or an API server's exit; stop all."""
        signalled = []

        def _on_signal(signum, frame):  # noqa: ANN001
            signalled.append(signum)
            self.stop.set()

        old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        threading.Thread(target=self._watch_engines, daemon=True, name="EngineWatch").start()
        failed = False
        try:
            while not self.stop.wait(0.2):
                if any(p.poll() is not None for p in self.children):
                    failed = not self.engine_died and any(p.returncode for p in self.children if
                                                          p.returncode is not None)
                    break
        finally:
            self.stop.set()
            try:  # a second signal (a supervisor's, a process group's) must not cut the cleanup short
                self.shutdown()
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
        if self.engine_died or failed:
            return 1
        return 0

    def shutdown(self) -> None:
        """SIGTERM every API server (they drain), wait, then stop the engine; remove the dirs."""
        for p in self.children:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace + _CHILD_EXIT_MARGIN_S
        for p in self.children:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # SIGTERM (no client of ours to send SHUTDOWN), then SIGKILL; the engines in parallel.
        stoppers = [threading.Thread(target=e, args=(None,)) for e in self.engines]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def run_multi_api_server(args: argparse.Namespace) -> int:
    """Start the engine(s) once and ``args.api_server_count`` API servers on one socket;
    return when they stopped (0, or 1 when the engine died or an API server failed).
    Raises ValueError for flags several API servers do not support."""
    return _Launcher(args).run()


class ApiServerIndexMiddleware:
    """Pure ASGI middleware: adds ``X-API-Server-Index: <client_index>`` to each response."""

    def __init__(self, app: Any, index: int) -> None:
        self.app = app
        self.header = (API_SERVER_INDEX_HEADER.lower().encode(), str(index).encode())

    async def __call__(self, scope, receive, send):  # noqa: ANN001
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_index(message):  # noqa: ANN001
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [self.header]
            await send(message)

        return await self.app(scope, receive, send_with_index)


def _api_server_main(run_server: RunServer) -> None:
    """One API server: ``python -m llmserve.entrypoints.openai.multi_api_server``, its
    (args, client config, socket fd, launcher pid) pickled on stdin."""
    args, client, fd, launcher_pid = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.INFO,
                        format=f"%(levelname)s %(asctime)s [api-server {client['client_index']}] %(name)s: %(message)s")
    exit_when_parent_dies(launcher_pid)
    sock = socket.socket(fileno=fd)
    code = asyncio.run(run_server(args, sock=sock, client_config=client))
    sys.exit(code)


if __name__ == "__main__":
    # Run as a script this file is ``__main__``, not the module api_server imports, so
    # importing api_server here makes no circle. An API server runs no model: its
    # transformers runs without torch (issue 31, torch_hiding.py).
    from llmserve.torch_hiding import import_transformers_without_torch

    import_transformers_without_torch()
    from llmserve.entrypoints.openai.api_server import run_server as _run_server

    _api_server_main(_run_server)
