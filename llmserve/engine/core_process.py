"""Process plumbing of the multiprocess engine clients: spawning the EngineCore process,
its ZMQ socket directory, the death monitor and the cleanup (vLLM's ``vllm/v1/engine/utils.py``).

The clients (``core_client.py``) bind two ZMQ ``ipc://`` sockets in a private temp dir,
spawn the engine process with ``spawn_engine_process``, and wait for its READY handshake
(or its start-up error). ``monitor_engine_process`` watches the process: if it dies, it
pushes an ENGINE_CORE_DEAD message (``EngineCoreDead``) into the client's own output
socket, so every waiter wakes within a second. ``MPResources`` is the cleanup, run by
``weakref.finalize`` so no reference cycle holds a client.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import zmq

from llmserve.engine.messages import EngineCoreDead, EngineCoreOutputs, EngineCoreRequestType
from llmserve.engine.serial import MsgpackEncoder
from llmserve import envs, proc_utils

STARTUP_TIMEOUT_S = float(envs.get("LLMSERVE_ENGINE_STARTUP_TIMEOUT", "600"))
# How long shutdown waits for the engine to exit by itself after SHUTDOWN (default).
SHUTDOWN_TIMEOUT_S = 5.0


class MPResources:
    """Everything to clean up; used by weakref.finalize so no cycle holds the client."""

    def __init__(self) -> None:
        self.proc: Optional[EngineProcess] = None
        self.ctx: Optional[zmq.Context] = None
        self.tmpdir: Optional[str] = None
        self.sockets: list = []
        self.input_socket: Optional[zmq.Socket] = None
        self.stop_event = threading.Event()

    def _send_shutdown(self, wait_s: float = 0.2) -> bool:
        """Queue SHUTDOWN on the bound input socket (a plain zmq.Socket, also under the
        async client, whose asyncio socket shadows it), waiting at most ``wait_s`` for room.
        Returns False when it could not be queued (no engine connected, socket closed).

        It must go through this socket: the engine's PULL connects to it, so a fresh PUSH
        connecting to the same address would reach this PUSH, not the engine, and the
        message would never arrive."""
        sock = self.input_socket
        if sock is None or sock.closed:
            return False
        try:
            if not sock.poll(int(wait_s * 1000), zmq.POLLOUT):
                return False
            sock.send_multipart([EngineCoreRequestType.SHUTDOWN.value, MsgpackEncoder().encode(None)],
                                flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def __call__(self, timeout: Optional[float] = None) -> None:
        """Stop the engine process and release the sockets and the socket dir, within
        ``timeout`` seconds (None: up to 5 s for a clean exit after SHUTDOWN, 5 s after
        SIGTERM). SHUTDOWN first; SIGTERM, then SIGKILL, only if the process does not exit
        in its share of the time."""
        self.stop_event.set()
        proc = self.proc
        if proc is not None and proc.is_alive():
            deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)

            def left(default: float) -> float:
                return default if deadline is None else max(0.0, min(default, deadline - time.monotonic()))

            sent = self._send_shutdown(min(0.2, left(0.2)))
            # Keep a little of the budget for SIGTERM and SIGKILL.
            proc.join(timeout=left(SHUTDOWN_TIMEOUT_S) * (1.0 if deadline is None else 0.7) if sent else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=left(SHUTDOWN_TIMEOUT_S) * (1.0 if deadline is None else 0.8))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=max(left(2.0), 0.5))  # SIGKILL cannot be refused: wait for the reap
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


# An engine interpreter started ahead of its config (prestart_engine_process), and its env.
_prestarted: Optional[tuple[subprocess.Popen, dict]] = None


def _start_interpreter(env: dict) -> subprocess.Popen:
    """The engine's interpreter, in a session (process group) of its own: a signal to the
    server's group (``kill -TERM -PGID``, ``timeout``, a supervisor's stop-as-group) reaches
    the server, which drains its requests and then stops the engine, instead of stopping
    the engine under them (seen in a user trial: the DP server's in-flight requests failed
    and it exited 1, "engine died"). The engine still exits when its parent goes
    (``exit_when_parent_dies``) or its stdin closes before the config came."""
    cmd, env = proc_utils.same_code_command("llmserve.engine.core", env)
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, close_fds=True, env=env, start_new_session=True)


def prestart_engine_process() -> None:
    """Start the next engine's interpreter now, before the caller's own imports: it imports
    torch and the model code (and loads the C++ kernels) while the caller imports the
    server and builds the EngineConfig, then waits for that config on stdin. Measured on
    2 cores: ~1 s of the engine's ~1.5 s of imports and kernel loading no longer follows
    the API server's ~3.4 s (imports, config). :func:`spawn_engine_process` uses it when
    its environment is the one the config wants; one left unused is killed at exit (or
    exits by itself when its stdin closes)."""
    global _prestarted
    if _prestarted is None:
        import atexit
        _prestarted = (_start_interpreter(dict(os.environ)), dict(os.environ))
        atexit.register(_discard_prestarted)


def _discard_prestarted() -> None:
    global _prestarted
    if _prestarted is not None:
        proc, _ = _prestarted
        _prestarted = None
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _take_prestarted(env: dict) -> Optional[subprocess.Popen]:
    global _prestarted
    if _prestarted is None:
        return None
    proc, started_env = _prestarted
    if started_env != env or proc.poll() is not None:
        _discard_prestarted()
        return None
    _prestarted = None
    return proc


def spawn_engine_process(config: Any, input_addr: str, output_addr: str, executor_class: Optional[type] = None,
                         log_stats: bool = False) -> "EngineProcess":
    """Start ``python -m llmserve.engine.core`` (or take the one :func:`prestart_engine_process`
    started) and hand it its start-up arguments (the EngineConfig and the socket
    addresses) on stdin. A fresh interpreter, unlike multiprocessing's spawn, never
    re-imports the user's ``__main__`` module."""
    from llmserve.distributed.kv_event_seq import attach_seq_dir

    attach_seq_dir(getattr(config, "kv_events_config", None))  # KV event seq numbers outlive the process
    env = engine_env(config)
    proc = _take_prestarted(env) or _start_interpreter(env)
    try:
        proc.stdin.write(pickle.dumps((config, input_addr, output_addr, os.getpid(), executor_class, log_stats)))
        proc.stdin.close()
    except BrokenPipeError:
        pass
    return EngineProcess(proc)


def engine_env(config: Any, environ: Optional[dict] = None) -> dict:
    """The engine process's environment: ``environ`` (default ``os.environ``) plus
    ``OMP_WAIT_POLICY=PASSIVE`` for a pooling model unless the user set a policy.

    A pooling step is a few large GEMMs between Python-side work; with OpenMP's default
    (spinning) wait policy the idle worker threads burn a core between parallel regions,
    which on a busy 2-core machine halved ``LLM.embed``'s throughput at 32 prompts per
    step (measured: 22 vs 52 CPU ms per sentence, 8-11 s vs 22-24 s wall, 300 sentences).
    Generating models keep the default: their decode steps are many short parallel
    regions, where waking sleeping threads may cost latency (not measured here)."""
    env = dict(os.environ if environ is None else environ)
    model_config = getattr(config, "model_config", None)
    if getattr(model_config, "runner", None) == "pooling" and "OMP_WAIT_POLICY" not in env:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


class EngineProcess:
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


def monitor_engine_process(proc: "EngineProcess", output_addr: str, ctx: zmq.Context, stop: threading.Event) -> None:
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
                sock.send(MsgpackEncoder().encode(EngineCoreOutputs(dead=EngineCoreDead(
                    f"EngineCore process died (exit code {proc.exitcode})", exit_code=proc.exitcode))))
                sock.close()
            except Exception:
                pass
            return
