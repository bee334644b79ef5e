"""``python -m llmserve.worker.worker_proc``: a worker process of ``MultiprocExecutor``.

Reads ``(config, rank, world_size, dist_init_method, address, authkey, parent_pid)`` from
stdin (pickled), connects to the executor's ``multiprocessing.connection`` listener, says
its rank, then serves calls: each message is ``(method, args)``; each reply is
``("ok", result)`` or ``("error", traceback)``. ``("shutdown", ())`` ends it. It exits if
the engine process goes away (no orphans).
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import traceback
from multiprocessing.connection import Client
from llmserve.proc_utils import exit_when_parent_dies


def main() -> None:
    from llmserve import envs
    from llmserve.worker.worker import Worker

    config, rank, world_size, dist_init, address, authkey, parent_pid = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=envs.get("LLMSERVE_LOGGING_LEVEL", "INFO"),
                        format=f"%(levelname)s %(asctime)s [worker {rank}] %(message)s")
    exit_when_parent_dies(parent_pid)
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    conn.send(rank)
    worker = Worker(config, rank, world_size, dist_init)
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            break
        if method == "shutdown":
            try:
                worker.shutdown()
            finally:
                conn.send(("ok", None))
            break
        try:
            conn.send(("ok", worker.execute_method(method, *args)))
        except Exception:
            conn.send(("error", traceback.format_exc(limit=5)))
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
