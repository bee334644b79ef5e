"""Data-parallel engine clients (vLLM's ``DPLBAsyncMPClient`` and ``DPAsyncMPClient``,
``vllm/v1/engine/core_client.py``).

``DPAsyncMPClient`` (``--data-parallel-external-lb``) is the client of the one rank this
API server owns; a load balancer in front spreads requests over the servers. It is an
``AsyncMPClient`` subclass, so it lives beside its base in ``core_client.py`` (as in
vLLM); this module imports nothing of ``core_client``.

``DPLBAsyncMPClient`` starts ``data_parallel_size`` EngineCore processes (one
``AsyncMPClient`` each: own sockets, own death monitor) and balances requests over them:

* a new request goes to the rank with the least work: ``4 * waiting + running`` as the
  engine last reported (``SchedulerStats`` on every output) plus the requests this client
  sent it since that report (so a burst does not all land on one rank); ties go to the
  lowest rank. ``EngineCoreRequest.data_parallel_rank`` pins a rank;
* aborts and streaming-input chunks go to the rank that holds the request; utility calls
  go to every rank (``get_stats`` sums the counts and lists each rank's under "engines");
* every ``EngineCoreOutputs`` carries its ``engine_index``;
* one rank dying is the client's death (vLLM: the DP group fails together): every waiter
  gets EngineDeadError, the server reports unhealthy. Engine self-healing is off with DP.
  Multi-node (``--data-parallel-size-local`` < size, engine/multinode.py): a lost
  headless node's ranks leave the group instead; their in-flight requests end with an
  error naming the rank and the others keep serving.

With ``--api-server-count K`` the launcher starts the N engines and each API server's
``DPLBAsyncMPClient`` attaches to them (``client_addresses``: one address pair per rank).

Each rank's engine gets ``cores / data_parallel_size`` torch threads unless
``num_threads`` is set.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any, Callable, Optional

from llmserve.engine.exceptions import EngineDeadError, EngineInitError
from llmserve.engine.messages import EngineCoreOutputs, EngineCoreRequest, StreamingInputChunk
from llmserve.metrics.stats import SchedulerStats

logger = logging.getLogger(__name__)


def rank_config(config: Any, dp_size: int) -> Any:
    """The EngineConfig one DP rank's engine runs: the cores split between the ranks."""
    if config.num_threads or dp_size == 1:
        return config
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return dataclasses.replace(config, num_threads=max(1, cores // dp_size))


def with_data_parallel_rank(config: Any, rank: int) -> Any:
    """The EngineConfig of DP rank ``rank``'s engine (vLLM sets
    ``parallel_config.data_parallel_rank`` per engine): what the engine publishes under
    (its KV events' ``data_parallel_rank`` and ports, distributed/kv_events.py)."""
    pc = config.parallel_config
    if pc.data_parallel_rank == rank:
        return config
    return dataclasses.replace(config, parallel_config=dataclasses.replace(pc, data_parallel_rank=rank))


class DPLBAsyncMPClient:
    """asyncio client of ``data_parallel_size_local`` engine processes with internal load
    balancing; same surface as ``AsyncMPClient``. Raises RuntimeError if a rank fails to
    start (the ranks already started are stopped).

    ``client_addresses`` ({"input_address": [N], "output_address": [N]}, one per rank):
    attached mode, API server ``client_index`` of several (``--api-server-count``): the
    launcher started the N engines, this client binds its own address pair per rank, never
    starts or stops an engine, and balances by the engines' reported counts (which include
    the other API servers' requests) plus what it sent since (no coordinator).

    ``rank_client``: the class of one rank's client, ``AsyncMPClient`` (passed in by
    ``EngineCoreClient.make_async_mp_client``, so this module does not import
    ``core_client``, which picks this class: no import circle)."""

    def __init__(self, vllm_config: Any, executor_class: Optional[type] = None, log_stats: bool = False,
                 client_index: int = 0, client_addresses: Optional[dict[str, list[str]]] = None, *,
                 rank_client: Callable[..., Any]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        pc = vllm_config.parallel_config
        self.config = vllm_config
        # Hybrid LB: this client owns ranks start.. +size_local only (engine/multinode.py);
        # it indexes them 0.. locally and shows them under their global numbers.
        hybrid = pc.data_parallel_hybrid_lb
        self.dp_size = (pc.data_parallel_size_local or pc.data_parallel_size) if hybrid else pc.data_parallel_size
        self.rank_offset = pc.data_parallel_start_rank if hybrid else 0
        self.client_index = client_index
        self.client_addresses = client_addresses
        self.dead_ranks: set[int] = set()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.node_watch = self._watch_nodes(pc)
        self.ray_engines = self._place_on_ray(vllm_config, log_stats)
        cfg = rank_config(vllm_config, self.dp_size if client_addresses else pc.data_parallel_size_local or self.dp_size)
        # The ranks load their models at the same time (or, attached, say READY).
        with ThreadPoolExecutor(self.dp_size) as pool:
            futs = [pool.submit(rank_client, with_data_parallel_rank(cfg, self.rank_offset + r), executor_class,
                                log_stats, self._rank_addresses(r), client_index) for r in range(self.dp_size)]
        self.cores: list = []
        errors = []
        for f in futs:
            try:
                self.cores.append(f.result())
            except BaseException as e:  # noqa: BLE001 - reported below after cleanup
                errors.append(e)
        if errors:
            for c in self.cores:
                c.shutdown(2.0)
            if self.node_watch is not None:
                self.node_watch.close()
            if self.ray_engines is not None:
                self.ray_engines.shutdown()
            raise EngineInitError(f"data parallel: {len(errors)} of {self.dp_size} engines failed to start: {errors[0]}")
        self.num_blocks = min(c.num_blocks for c in self.cores)
        self.ready = self.cores[0].ready
        self.req_rank: dict[str, int] = {}
        self.reported = [0] * self.dp_size  # 4 * waiting + running, last report per rank
        self.sent_since = [0] * self.dp_size  # requests sent to each rank since its last report
        self.in_flight = [0] * self.dp_size  # this client's unfinished requests per rank
        self._queue: Optional[asyncio.Queue] = None
        self._pumps: list[asyncio.Task] = []
        self.engine_dead = False
        self.dead_error: Optional[str] = None
        self._shut_down = False

    def _watch_nodes(self, pc: Any):
        """Multi-node (``data_parallel_size_local`` < size, engine/multinode.py): listen for
        the headless nodes of ranks size_local..size-1; None on one node."""
        local = pc.data_parallel_size_local or self.dp_size
        if self.client_addresses or local >= self.dp_size or pc.data_parallel_hybrid_lb or \
                pc.data_parallel_backend == "ray":
            return None
        from llmserve.engine.multinode import NodeWatch
        self.remote = (pc.data_parallel_address, pc.data_parallel_rpc_port, local)
        watch = NodeWatch(pc.data_parallel_address, pc.data_parallel_rpc_port, range(local, self.dp_size),
                          self._on_node_lost)
        logger.info("data parallel: waiting for ranks %s to join at %s:%d (nodes started with --headless "
                    "--data-parallel-start-rank ...)", list(range(local, self.dp_size)), pc.data_parallel_address,
                    pc.data_parallel_rpc_port)
        return watch

    def _place_on_ray(self, vllm_config: Any, log_stats: bool):
        """``--data-parallel-backend ray`` (engine/ray_dp.py): Ray places every rank's
        engine; None otherwise."""
        if vllm_config.parallel_config.data_parallel_backend != "ray" or self.client_addresses:
            return None
        from llmserve.engine.ray_dp import RayDPEngines
        ranks = [self.rank_offset + r for r in range(self.dp_size)]
        return RayDPEngines([with_data_parallel_rank(vllm_config, r) for r in ranks], ranks, log_stats,
                            self._on_node_lost, vllm_config.parallel_config.data_parallel_address or "")

    def _rank_addresses(self, rank: int) -> Optional[dict[str, str]]:
        """Rank ``rank``'s (input, output) addresses for this API server when the engines
        were started elsewhere (``--api-server-count``, Ray, or a headless node's ranks: the
        fixed TCP layout of engine/multinode.py); None: this client starts them."""
        if self.ray_engines is not None:
            return self.ray_engines.addresses[rank]
        if self.node_watch is not None and rank >= self.remote[2]:
            from llmserve.engine.multinode import remote_rank_addresses
            return remote_rank_addresses(self.remote[0], self.remote[1], rank)
        if not self.client_addresses:
            return None
        return {key: self.client_addresses[key][rank] for key in ("input_address", "output_address")}

    # ---- routing ----------------------------------------------------------------
    def get_core_engine_for_request(self, request: EngineCoreRequest) -> int:
        """The (local) rank for a new request: its ``data_parallel_rank`` if set (a global
        rank; ValueError if it is not one of this client's), else the least loaded one."""
        pinned = getattr(request, "data_parallel_rank", None)
        if pinned is not None:
            first, end = self.rank_offset, self.rank_offset + self.dp_size
            if not first <= pinned < end:
                where = " (the other ranks are served by other nodes' API servers)" if self.rank_offset or \
                    end < self.config.parallel_config.data_parallel_size else ""
                raise ValueError(f"data_parallel_rank={pinned} is out of range [{first}, {end}){where}")
            if pinned - first in self.dead_ranks:
                raise ValueError(f"data_parallel_rank={pinned} was lost (its node left the group)")
            return pinned - first
        live = [r for r in range(self.dp_size) if r not in self.dead_ranks]
        return min(live, key=lambda r: (self.reported[r] + self.sent_since[r], r))

    def engine_index_of(self, request_id: str) -> Optional[int]:
        """The (global) DP rank a request in flight was sent to; None when unknown."""
        rank = self.req_rank.get(request_id)
        return None if rank is None else self.rank_offset + rank

    # ---- node loss (multi-node) ----------------------------------------------------
    def _on_node_lost(self, ranks: list[int], reason: str) -> None:
        """NodeWatch thread: a headless node's connection closed."""
        logger.error("%s; the other ranks keep serving", reason)
        ranks = [r - self.rank_offset for r in ranks]  # global -> this client's index
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._drop_ranks, ranks, reason)
        else:
            self.dead_ranks.update(ranks)

    def _drop_ranks(self, ranks: list[int], reason: str) -> None:
        """Take ``ranks`` out of the group: stop reading them and end their in-flight
        requests with an error (EngineCoreRejection with engine_lost: the caller gets
        EngineGenerateError(reason), HTTP 500: the node failed, not the request)."""
        from llmserve.engine.messages import EngineCoreRejection
        for rank in ranks:
            self.dead_ranks.add(rank)
            if rank < len(self._pumps):
                self._pumps[rank].cancel()
            ids = [rid for rid, r in self.req_rank.items() if r == rank]
            for rid in ids:
                self._finished(rank, rid)
            if self._queue is not None:  # its rejections, and zeros for its gauges (nothing runs there now)
                msg = f"{reason}: the request was in flight on data parallel rank {self.rank_offset + rank}"
                self._queue.put_nowait(EngineCoreOutputs(
                    rejected=[EngineCoreRejection(rid, msg, engine_lost=True) for rid in ids],
                    engine_index=self.rank_offset + rank, scheduler_stats=SchedulerStats()))
        if len(self.dead_ranks) == self.dp_size:
            self.engine_dead = True
            self.dead_error = reason

    def _finished(self, rank: int, request_id: str) -> None:
        if self.req_rank.pop(request_id, None) is not None:
            self.in_flight[rank] -= 1

    # ---- outputs ------------------------------------------------------------------
    def _ensure_pumps(self) -> None:
        if self._queue is None or not self._pumps or self._pumps[0].done() and not self.engine_dead:
            self._queue = asyncio.Queue()
            self._loop = loop = asyncio.get_running_loop()
            self._pumps = [loop.create_task(self._pump(r)) for r in range(self.dp_size)]
            for r in self.dead_ranks:
                self._pumps[r].cancel()

    async def _pump(self, rank: int) -> None:
        core = self.cores[rank]
        queue = self._queue
        while True:
            try:
                outs: EngineCoreOutputs = await core.get_output_async()
            except EngineDeadError as e:
                self.engine_dead = True
                self.dead_error = f"data parallel rank {rank}: {e}"
                queue.put_nowait(e)
                return
            except asyncio.CancelledError:
                return
            outs.engine_index = self.rank_offset + rank
            stats = outs.scheduler_stats
            if stats is not None:
                self.reported[rank] = 4 * stats.num_waiting_reqs + stats.num_running_reqs
                self.sent_since[rank] = 0
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self._finished(rank, o.request_id)
            for rej in outs.rejected or ():
                self._finished(rank, rej.request_id)
            queue.put_nowait(outs)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next output of any rank; raises EngineDeadError once a rank died."""
        self._ensure_alive()
        self._ensure_pumps()
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.engine_dead = True
            self._queue.put_nowait(item)  # every later waiter sees it too
            raise EngineDeadError(f"EngineCore died: {self.dead_error}")
        return item

    def _ensure_alive(self) -> None:
        if self.engine_dead:
            raise EngineDeadError(f"EngineCore died: {self.dead_error}")

    # ---- inputs -------------------------------------------------------------------
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_alive()
        self._ensure_pumps()
        rank = self.get_core_engine_for_request(request)
        self.req_rank[request.request_id] = rank
        self.in_flight[rank] += 1
        self.sent_since[rank] += 1
        await self.cores[rank].add_request_async(request)

    async def add_streaming_input_async(self, chunk: StreamingInputChunk) -> None:
        rank = self.req_rank.get(chunk.request_id, 0)
        await self.cores[rank].add_streaming_input_async(chunk)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if not request_ids or self.engine_dead:
            return
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.req_rank.get(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
                self._finished(rank, rid)
        for rank, ids in by_rank.items():
            if rank not in self.dead_ranks:  # a lost node's socket would hold them forever
                await self.cores[rank].abort_requests_async(ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every rank. get_stats: counts summed, each rank's dict under
        "engines"; bool results: all true; else the list of results in rank order."""
        self._ensure_alive()
        self._ensure_pumps()
        live = [c for r, c in enumerate(self.cores) if r not in self.dead_ranks]
        results = await asyncio.gather(*(c.call_utility_async(method, *args) for c in live))
        if method == "get_stats":
            merged: dict[str, Any] = {k: sum(r[k] for r in results) for k in results[0]
                                      if isinstance(results[0][k], int) and k != "pid"}
            total = merged.get("num_total_blocks") or 0
            merged["kv_cache_usage"] = merged.get("num_used_blocks", 0) / total if total else 0.0
            merged["engines"] = results
            return merged
        if all(isinstance(r, bool) for r in results):
            return all(results)
        return results[0] if len(set(map(repr, results))) == 1 else results

    # ---- processes ----------------------------------------------------------------
    @property
    def engine_pid(self) -> Optional[int]:
        return self.cores[0].engine_pid

    @property
    def engine_pids(self) -> list[Optional[int]]:
        return [c.engine_pid for c in self.cores]

    def kill_engine(self) -> None:
        for c in self.cores:
            c.kill_engine()

    async def respawn_async(self):
        raise EngineDeadError("engine restarts are off with data parallel (a dead rank fails the group, as vLLM)")

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop every rank's engine process (in parallel, within ``timeout`` seconds).
        Idempotent; at interpreter exit (no new threads) the ranks stop one after another."""
        import sys
        import threading

        if self._shut_down:
            return
        self._shut_down = True
        if self.node_watch is not None:
            self.node_watch.close()  # the headless nodes stop their engines
        for t in self._pumps:
            if not t.done():
                try:
                    t.cancel()
                except RuntimeError:
                    pass
        if sys.is_finalizing():
            for c in self.cores:
                c.shutdown(timeout)
            return
        threads = [threading.Thread(target=c.shutdown, args=(timeout,)) for c in self.cores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.ray_engines is not None:  # their clients never own the processes: Ray does
            self.ray_engines.shutdown()
