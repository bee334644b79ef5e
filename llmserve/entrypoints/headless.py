"""``llmserve serve --headless`` (vLLM's flag): a node of a multi-node data-parallel group
that runs only engines. It starts its ranks' EngineCores connected to the head's sockets
(``engine/multinode.py``: the address layout and the handshake), joins the head over TCP,
and waits: it exits when the head goes away or one of its engines dies. Kept here, not in
``engine/``, because it builds the engine config from the CLI arguments."""
from __future__ import annotations

import logging
import socket
import time
from typing import Any, Optional

from llmserve.engine.messages import EngineHandshake
from llmserve.engine.multinode import encode_handshake, recv_answer, remote_rank_addresses

logger = logging.getLogger(__name__)


def run_headless(args: Any) -> int:
    """``llmserve serve --headless``: start this node's ranks connected to the head, join
    it, and wait. Returns the exit code: 0 when the head went away (its engines are
    stopped first), 1 when an engine died or the head could not be reached.

    Raises:
        ValueError: ``--api-server-count`` above 1 (vLLM's refusal: a headless node serves
            no HTTP, and the flag was silently dropped), or a topology the config refuses."""
    if (getattr(args, "api_server_count", 1) or 1) > 1:
        raise ValueError("api_server_count can't be set in headless mode: a --headless node runs engines only "
                         "(the head's API servers reach them); drop --api-server-count")
    from llmserve.engine.core_process import spawn_engine_process
    from llmserve.engine.dp_client import rank_config, with_data_parallel_rank
    from llmserve.engine_args import AsyncEngineArgs, UsageContext

    config = AsyncEngineArgs.from_cli_args(args).create_engine_config(UsageContext.OPENAI_API_SERVER)
    pc = config.parallel_config
    if pc.data_parallel_external_lb:
        raise ValueError("--headless runs internal load balancing ranks; drop --data-parallel-external-lb "
                         "and --data-parallel-rank (with external load balancing each rank is a whole server)")
    cfg = rank_config(config, pc.data_parallel_size_local)
    ranks = range(pc.data_parallel_start_rank, pc.data_parallel_start_rank + pc.data_parallel_size_local)
    procs = []
    for r in ranks:
        a = remote_rank_addresses(pc.data_parallel_address, pc.data_parallel_rpc_port, r)
        procs.append(spawn_engine_process(with_data_parallel_rank(cfg, r), a["input_address"], a["output_address"],
                                          None, not args.disable_log_stats))
    logger.info("headless: ranks %s started (pids %s)", list(ranks), [p.pid for p in procs])
    try:
        conn = _connect_head(pc.data_parallel_address, pc.data_parallel_rpc_port, procs, args.host)
        if conn is None:
            return 1
        conn.sendall(encode_handshake(EngineHandshake(ranks.start, len(ranks), args.host or socket.gethostname())))
        refused = recv_answer(conn)
        if refused is not None:
            logger.error("headless: the head at %s:%d did not take ranks %s: %s", pc.data_parallel_address,
                         pc.data_parallel_rpc_port, list(ranks), refused)
            return 1
        logger.info("headless: joined the head at %s:%d", pc.data_parallel_address, pc.data_parallel_rpc_port)
        return _wait(conn, procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(10)


def _connect_head(address: str, port: int, procs: list, host: Optional[str],
                  timeout: float = 600.0) -> Optional[socket.socket]:
    """The liveness link to the head, from this node's ``--host`` when given."""
    deadline = time.monotonic() + timeout
    next_note = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if time.monotonic() >= next_note:  # say what it waits for, not nothing
            logger.info("headless: waiting for the head at %s:%d", address, port)
            next_note += 30.0
        if any(not p.is_alive() for p in procs):
            logger.error("headless: an engine exited before joining the head")
            return None
        try:
            return socket.create_connection((address, port), timeout=2.0,
                                            source_address=(host, 0) if host else None)
        except OSError:
            time.sleep(0.5)
    logger.error("headless: the head at %s:%d did not answer within %.0f s", address, port, timeout)
    return None


def _wait(conn: socket.socket, procs: list) -> int:
    conn.settimeout(0.5)
    while True:
        try:
            if not conn.recv(64):
                logger.info("headless: the head went away; stopping")
                return 0
        except socket.timeout:
            pass
        except OSError:
            return 0
        if any(not p.is_alive() for p in procs):
            logger.error("headless: an engine died; leaving the group")
            return 1
