"""Multi-node data parallel with internal load balancing, as vLLM runs it (``vllm serve
--data-parallel-size N --data-parallel-size-local L --data-parallel-address A
--data-parallel-rpc-port P`` on the head, ``--headless --data-parallel-start-rank S`` on the
other nodes; vLLM docs, "Data Parallel Deployment", multi-node).

* The head runs the API server and ranks ``0 .. L-1``; for every remote rank ``r`` its
  ``DPLBAsyncMPClient`` binds rank ``r``'s input / output ZMQ sockets on
  ``tcp://A:P+1+2r`` and ``tcp://A:P+2+2r`` (a fixed layout instead of vLLM's address
  exchange: each side computes it) and listens on ``A:P`` for joining nodes
  (:class:`NodeWatch`).
* A headless node (``entrypoints/headless.py``) starts its ranks' EngineCores connected to those addresses, then
  connects to ``A:P`` and sends an ``EngineHandshake`` (its ranks). That TCP connection is
  the liveness link both ways: the node stops its engines and exits when the head closes
  it (head stopped or killed); the head treats its close as the loss of that node's ranks.
* A lost node's ranks leave the group; the head keeps serving on the others. Requests in
  flight on a lost rank end with an engine error naming the rank (the server answers 500 /
  an error event in the stream: ``EngineCoreRejection.engine_lost``); none are retried. vLLM instead fails
  the whole DP group.

Hybrid load balancing (``--data-parallel-hybrid-lb``, every node runs ``llmserve serve``
with its ``--data-parallel-start-rank`` and ``--data-parallel-size-local``): each node's
API server balances its own ranks only (``DPLBAsyncMPClient.rank_offset``) and a load
balancer in front spreads requests over the nodes; ranks keep their global numbers (KV
events, metrics, ``X-data-parallel-rank``, which must name one of the node's ranks). No
node connects to another: losing one node loses only its requests.

Nothing here runs collectives across ranks: dense models need no DP wave coordination.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
from typing import Any, Callable, Optional

import msgspec

from llmserve.engine.messages import EngineHandshake

logger = logging.getLogger(__name__)


def check_multinode_args(args: Any) -> None:
    """ValueError naming the flag for a data-parallel topology vLLM would refuse (internal
    load balancing): ranks beyond ``--data-parallel-size``, several nodes without
    ``--data-parallel-address`` / ``--data-parallel-rpc-port``, a head not at rank 0."""
    dp, start = args.data_parallel_size, args.data_parallel_start_rank
    local = args.data_parallel_size_local if args.data_parallel_size_local is not None else dp
    headless = getattr(args, "headless", False)
    if start + local > dp:
        raise ValueError(f"--data-parallel-start-rank {start} + --data-parallel-size-local {local} exceeds "
                         f"--data-parallel-size {dp}")
    if getattr(args, "data_parallel_hybrid_lb", False):
        return _check_hybrid_args(args, headless, local)
    if getattr(args, "data_parallel_backend", "mp") == "ray":
        if headless or local < dp:
            raise ValueError("--data-parallel-backend ray places every rank from the API server's node; drop "
                             "--headless and --data-parallel-size-local")
        return
    if local == dp and not headless:
        if start:
            raise ValueError("--data-parallel-start-rank applies to --headless nodes and "
                             "--data-parallel-external-lb (one node runs ranks 0..N-1)")
        return
    what = "--headless" if headless else f"--data-parallel-size-local {local} < --data-parallel-size {dp}"
    if not args.data_parallel_address:
        raise ValueError(f"{what} needs --data-parallel-address (the head node's address)")
    if not args.data_parallel_rpc_port:
        raise ValueError(f"{what} needs --data-parallel-rpc-port (the head's port for joining nodes)")
    top = args.data_parallel_rpc_port + 2 * dp
    if args.data_parallel_rpc_port < 1 or top > 65535:
        raise ValueError(f"--data-parallel-rpc-port {args.data_parallel_rpc_port}: the head uses ports P..P+2N "
                         f"(N = --data-parallel-size {dp}), which must lie in 1..65535")
    if not headless and start:
        raise ValueError("--data-parallel-start-rank must be 0 on the head node (ranks 0..size_local-1); "
                         "other nodes run with --headless")
    if headless and start == 0:
        raise ValueError("--headless needs --data-parallel-start-rank >= 1 (the head runs rank 0)")


def _check_hybrid_args(args: Any, headless: bool, local: int) -> None:
    """``--data-parallel-hybrid-lb``: every node runs its API server over its own ranks, so
    not ``--headless``; vLLM asks for the head's address even there (its coordinator), and
    so do we, to keep one command line valid on both engines."""
    if headless:
        raise ValueError("--data-parallel-hybrid-lb runs an API server on every node; drop --headless")
    if getattr(args, "data_parallel_backend", "mp") != "mp":
        raise ValueError("--data-parallel-hybrid-lb places this node's ranks itself: use --data-parallel-backend mp")
    if local < args.data_parallel_size and not args.data_parallel_address:
        raise ValueError("--data-parallel-hybrid-lb with --data-parallel-size-local below --data-parallel-size "
                         "needs --data-parallel-address (the head node's address)")


def remote_rank_addresses(address: str, rpc_port: int, rank: int) -> dict[str, str]:
    """Rank ``rank``'s (input, output) ZMQ addresses on the head: ``tcp://A:P+1+2r`` and
    ``tcp://A:P+2+2r`` (the head binds them, the rank's engine connects)."""
    host = f"[{address}]" if ":" in address else address
    return {"input_address": f"tcp://{host}:{rpc_port + 1 + 2 * rank}",
            "output_address": f"tcp://{host}:{rpc_port + 2 + 2 * rank}"}


def encode_handshake(hs: EngineHandshake) -> bytes:
    """The handshake frame: a 4-byte big-endian length, then msgpack."""
    body = msgspec.msgpack.encode(hs)
    return struct.pack(">I", len(body)) + body


def recv_handshake(conn: socket.socket, timeout: float = 10.0) -> EngineHandshake:
    """Read one handshake frame from ``conn``. Raises ValueError on a short or malformed one."""
    conn.settimeout(timeout)
    head = _recv_exactly(conn, 4)
    (n,) = struct.unpack(">I", head)
    if n > 1 << 16:
        raise ValueError(f"handshake of {n} bytes is too large")
    try:
        return msgspec.msgpack.decode(_recv_exactly(conn, n), type=EngineHandshake)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed EngineHandshake: {e}") from None


# The head's answer to a handshake: ACCEPT, or REFUSE followed by the reason (UTF-8) and
# the connection's close.
ACCEPT, REFUSE = b"\x01", b"\x00"


def recv_answer(conn: socket.socket, timeout: float = 30.0) -> Optional[str]:
    """The head's answer on ``conn``: None when it accepted the node, else why not (a
    refusal, or the connection closed or silent before any answer)."""
    conn.settimeout(timeout)
    try:
        first = conn.recv(1)
        if first == ACCEPT:
            return None
        if first != REFUSE:
            return "the head closed the connection without answering"
        rest = b""
        while chunk := conn.recv(4096):
            rest += chunk
        return rest.decode("utf-8", "replace") or "refused"
    except (socket.timeout, OSError) as e:
        return f"no answer from the head ({e})"


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ValueError("connection closed during the handshake")
        buf += chunk
    return buf


class NodeWatch:
    """The head's listener on ``address:rpc_port``: accepts ``--headless`` nodes, reads
    their ``EngineHandshake`` and calls ``on_lost(ranks, reason)`` (from its thread) when a
    node's connection closes. ``close()`` closes every connection (the nodes then exit)."""

    def __init__(self, address: str, rpc_port: int, remote_ranks: range,
                 on_lost: Callable[[list[int], str], None]) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((address, rpc_port))
        except (OSError, OverflowError) as e:  # not this host's address, a taken port: the user's flags
            self.sock.close()
            raise ValueError(f"--data-parallel-address {address} --data-parallel-rpc-port {rpc_port}: the head "
                             f"cannot listen there ({e}); give an address of this host and a free port") from None
        self.sock.listen(16)
        self.remote_ranks = remote_ranks
        self.on_lost = on_lost
        self.conns: list[socket.socket] = []
        self.joined: set[int] = set()  # ranks of the nodes connected now
        self.lost: set[int] = set()  # ranks whose node left: they stay out of the group
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="DPNodeWatch").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            hs = recv_handshake(conn)
        except (ValueError, OSError) as e:
            logger.warning("data parallel: bad handshake from %s: %s", peer, e)
            conn.close()
            return
        ranks = [r for r in range(hs.start_rank, hs.start_rank + hs.size_local) if r in self.remote_ranks]
        why = self._refusal(ranks)
        if why is not None:
            logger.error("data parallel: node %s refused: %s", hs.host, why)
            try:
                conn.sendall(REFUSE + why.encode())
            except OSError:
                pass
            conn.close()
            return
        self.joined.update(ranks)
        conn.sendall(ACCEPT)
        logger.info("data parallel: node %s joined with ranks %s", hs.host, ranks)
        self.conns.append(conn)
        conn.settimeout(None)
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        self.joined.difference_update(ranks)
        self.lost.update(ranks)
        if not self._closed:
            self.on_lost(ranks, f"data parallel node {hs.host} (ranks {ranks}) was lost")

    def _refusal(self, ranks: list[int]) -> Optional[str]:
        """Why a node claiming ``ranks`` may not join (None: it may): none of this head's
        remote ranks, ranks another node serves now, or ranks lost earlier (a rank's
        requests and sockets are not brought back: restart the head to regroup)."""
        if not ranks:
            return f"its ranks are not among this head's remote ranks {list(self.remote_ranks)}"
        if self.joined & set(ranks):
            return f"ranks {sorted(self.joined & set(ranks))} are served by another node already"
        if self.lost & set(ranks):
            return (f"ranks {sorted(self.lost & set(ranks))} were lost earlier and stay out of the group; "
                    "restart the head to bring them back")
        return None

    def close(self) -> None:
        self._closed = True
        for s in [self.sock, *self.conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
