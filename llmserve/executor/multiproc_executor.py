"""Worker processes driven by the engine process (vLLM's ``MultiprocExecutor``).

The executor starts ``world_size`` worker processes (``python -m
llmserve.worker.worker_proc``, a fresh interpreter, like the engine process), each holding
one tensor-parallel rank (``llmserve.worker.worker.Worker``), and drives them over
``multiprocessing.connection`` (a unix socket in a private temp dir, with an auth key).
``collective_rpc`` sends the same call to every rank and waits for all replies; a worker
that dies or raises turns into a RuntimeError in the engine, which then reports
ENGINE_CORE_DEAD to its clients (nothing waits forever).
"""
from __future__ import annotations

import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Listener
from typing import Any, Optional

from llmserve import proc_utils
from llmserve.executor.abstract import Executor, combine_group_windows, combine_sliding_windows

# Seconds to wait for the workers to connect / for the model load calls.
_CONNECT_TIMEOUT_S = 120.0


class _NoPrefault:
    """Stands in for ``model_runner`` in the engine process: the KV cache lives in the
    workers, which fault its pages in on first use (no idle prefault)."""

    def prefault_kv(self, budget_bytes: int = 0) -> bool:
        return False

    def kv_prefault_done(self) -> bool:
        return True

    def kv_cache_nbytes(self) -> int:
        return 0


class MultiprocExecutor(Executor):
    """``parallel_config.world_size`` local worker processes; rank 0's output is the step's."""

    def _init_executor(self) -> None:
        pc = self.vllm_config.parallel_config
        self.world_size = pc.world_size
        self.model_runner = _NoPrefault()
        self._tmpdir = tempfile.mkdtemp(prefix="llmserve-workers-")
        self.procs: list[subprocess.Popen] = []
        self.conns: list = []
        try:
            self._start_workers()
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        address = os.path.join(self._tmpdir, "workers.sock")
        authkey = secrets.token_bytes(16)
        dist_init = f"file://{os.path.join(self._tmpdir, 'dist_store')}"
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        try:
            for rank in range(self.world_size):
                cmd, env = proc_utils.same_code_command("llmserve.worker.worker_proc")
                p = subprocess.Popen(cmd, stdin=subprocess.PIPE, close_fds=True, env=env)
                p.stdin.write(pickle.dumps((self.vllm_config, rank, self.world_size, dist_init, address,
                                            authkey, os.getpid())))
                p.stdin.close()
                self.procs.append(p)
            conns: dict[int, Any] = {}
            listener._listener._socket.settimeout(_CONNECT_TIMEOUT_S)
            while len(conns) < self.world_size:
                conn = listener.accept()
                conns[conn.recv()] = conn
            self.conns = [conns[r] for r in range(self.world_size)]
        finally:
            listener.close()

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every rank; returns their results in rank order.
        Raises RuntimeError when a worker raised or died."""
        msg = pickle.dumps((method, args))
        for conn in self.conns:
            conn.send_bytes(msg)
        results = []
        for rank, conn in enumerate(self.conns):
            results.append(self._recv(rank, conn, method))
        return results

    def _recv(self, rank: int, conn, method: str) -> Any:
        while not conn.poll(1.0):
            if self.procs[rank].poll() is not None:
                raise RuntimeError(f"worker {rank} died (exit code {self.procs[rank].returncode}) during {method}")
        try:
            status, value = conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"worker {rank} is gone during {method} ({e})") from None
        if status != "ok":
            raise RuntimeError(f"worker {rank} failed in {method}:\n{value}")
        return value

    # ---- worker calls ------------------------------------------------------
    def determine_num_blocks(self) -> int:
        # Ranks may hold different numbers of KV heads (uneven split): the smallest count fits all.
        return min(self.collective_rpc("determine_num_blocks"))

    def kv_cache_sliding_window(self) -> Optional[int]:
        return combine_sliding_windows(self.collective_rpc("kv_cache_sliding_window"))

    def kv_cache_group_windows(self) -> list[Optional[int]]:
        return combine_group_windows(self.collective_rpc("kv_cache_group_windows"))

    def kv_cache_bytes_per_block(self) -> int:
        return max(self.collective_rpc("kv_cache_bytes_per_block"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: Any) -> Any:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def remove_requests(self, req_ids) -> None:
        if req_ids:
            self.collective_rpc("remove_requests", (list(req_ids),))

    def check_health(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                raise RuntimeError(f"worker {rank} died (exit code {p.returncode})")

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask every worker to stop, then terminate / kill the ones still running, and
        remove the socket dir."""
        procs, self.procs = getattr(self, "procs", []), []
        conns, self.conns = getattr(self, "conns", []), []
        for conn in conns:
            try:
                conn.send_bytes(pickle.dumps(("shutdown", ())))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in procs:
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in conns:
            try:
                conn.close()
            except OSError:
                pass
        if getattr(self, "_tmpdir", None):
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
