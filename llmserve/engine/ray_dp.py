"""Data-parallel ranks placed by Ray (vLLM's ``--data-parallel-backend ray``).

The API server's ``DPLBAsyncMPClient`` binds each rank's input / output ZMQ sockets over
TCP on its own node's address, as for a ``--headless`` node's ranks (engine/multinode.py);
here Ray places the engines instead of a command run on each node:

* one placement group of ``data_parallel_size`` bundles, ``{"CPU": world_size}`` each,
  strategy SPREAD (ranks go to different nodes while there are free ones, as vLLM spreads
  its DP ranks), on the cluster that ``ray.init()`` finds (``RAY_ADDRESS``, or a local one);
* one :class:`EngineCoreActor` per bundle, which starts that rank's EngineCore process on
  its node (the same ``python -m llmserve.engine.core`` an ``mp`` rank runs, connected to
  the server's sockets) and waits on it; the engine exits if its actor dies
  (``exit_when_parent_dies``);
* a thread per rank waits on the actor's ``wait()``: when it returns (the engine exited) or
  fails (the actor or its node died) the rank is lost, as a lost node's are: its requests
  end with an engine error naming the rank and the other ranks keep serving.

The engines' torch threads: ``num_threads`` when set, else the CPUs of the rank's Ray node
shared by the ranks placed there.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

# Engine actors are named "llmserve-dp-<API server pid>-rank-<r>" in this namespace, so
# `ray list actors` (and ray.get_actor) finds a rank's engine.
RAY_NAMESPACE = "llmserve"


class EngineCoreActor:
    """A Ray actor (threaded: ``wait`` and ``stop`` run side by side) that runs one rank's
    EngineCore process on its node."""

    def __init__(self) -> None:
        self.proc = None

    def start(self, config: Any, input_addr: str, output_addr: str, log_stats: bool) -> dict:
        """Start the engine process; returns ``{"pid", "node_id", "node_ip"}``."""
        import ray

        from llmserve.engine.core_process import spawn_engine_process

        self.proc = spawn_engine_process(config, input_addr, output_addr, None, log_stats)
        ctx = ray.get_runtime_context()
        return {"pid": self.proc.pid, "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address()}

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        import ray
        return ray.get_runtime_context().get_node_id()

    def wait(self) -> int:
        """Block until the engine process exits; its exit code."""
        return self.proc.popen.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class RayDPEngines:
    """The Ray-placed engines of ranks ``ranks`` (their EngineConfigs: ``configs``, one per
    rank, in order). ``addresses[i]``: rank i's {"input_address", "output_address"} for
    its client to bind. ``on_lost(ranks, reason)`` is called from a watch thread when a
    rank's actor or engine ends before :meth:`shutdown`. Raises ImportError without Ray,
    ValueError when ``RAY_ADDRESS`` names no cluster or the placement group is not ready
    within ``timeout`` seconds (the cluster lacks the CPUs): the server prints one line."""

    def __init__(self, configs: list, ranks: list[int], log_stats: bool,
                 on_lost: Callable[[list[int], str], None], address: str = "", timeout: float = 120.0) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError as e:
            raise ImportError("--data-parallel-backend ray needs Ray: pip install 'llmserve[ray]'") from e
        self._ray, self.ranks, self.on_lost = ray, ranks, on_lost
        self.actors: list = []
        self.pg = None
        self._closed = False
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            try:
                ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
            except ConnectionError as e:  # a RAY_ADDRESS with no cluster behind it: the user's setting
                raise ValueError(f"--data-parallel-backend ray: {e} (RAY_ADDRESS="
                                 f"{os.environ.get('RAY_ADDRESS', '')!r}; `ray status` shows the cluster)") from None
        host = address or ray.util.get_node_ip_address()
        self.addresses = [{"input_address": _tcp(host, _free_port(host)),
                           "output_address": _tcp(host, _free_port(host))} for _ in ranks]
        cpus = configs[0].parallel_config.world_size
        have = ray.cluster_resources().get("CPU", 0)
        if have < cpus * len(ranks):  # say so now, not after the placement timeout
            self.shutdown()
            raise ValueError(f"--data-parallel-backend ray: {len(ranks)} ranks need {cpus * len(ranks)} CPUs of the "
                             f"Ray cluster, which has {have:g} (`ray status`)")
        try:
            self.pg = placement_group([{"CPU": cpus} for _ in ranks], strategy="SPREAD")
            ray.get(self.pg.ready(), timeout=timeout)
            self.placed = self._start(configs, log_stats, cpus)
        except BaseException as e:
            self.shutdown()
            if isinstance(e, ray.exceptions.GetTimeoutError):  # the cluster cannot hold the ranks
                raise ValueError(f"--data-parallel-backend ray: {len(ranks)} bundles of {cpus} CPU(s) were not "
                                   f"placed within {timeout:.0f} s (ray status shows the cluster's CPUs)") from None
            raise

    def _start(self, configs: list, log_stats: bool, cpus: int) -> list[dict]:
        import dataclasses

        from ray.util import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        node_cpus = {n["NodeID"]: int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n["Alive"]}
        per_node = {node: list(nodes.values()).count(node) for node in set(nodes.values())}
        actor_cls = ray.remote(max_concurrency=2)(EngineCoreActor)
        placed = []
        for i, (cfg, rank) in enumerate(zip(configs, self.ranks)):
            node = nodes[i]
            if not cfg.num_threads:  # this node's CPUs shared by the ranks placed on it
                cfg = dataclasses.replace(cfg, num_threads=max(1, node_cpus.get(node, 1) // per_node[node]))
            actor = actor_cls.options(name=f"llmserve-dp-{os.getpid()}-rank-{rank}", namespace=RAY_NAMESPACE,
                                      num_cpus=cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=i)).remote()
            self.actors.append(actor)
            placed.append(ray.get(actor.start.remote(cfg, self.addresses[i]["input_address"],
                                                     self.addresses[i]["output_address"], log_stats), timeout=120))
            logger.info("data parallel over Ray: rank %d on node %s (%s), engine pid %d, %d threads",
                        rank, placed[-1]["node_id"][:12], placed[-1]["node_ip"], placed[-1]["pid"], cfg.num_threads)
        for i, rank in enumerate(self.ranks):
            threading.Thread(target=self._watch, args=(i, rank), daemon=True, name=f"RayDPWatch-{rank}").start()
        return placed

    def _watch(self, i: int, rank: int) -> None:
        try:
            code = self._ray.get(self.actors[i].wait.remote())
            reason = f"data parallel rank {rank}'s engine exited (code {code})"
        except Exception as e:  # noqa: BLE001 - the actor or its node died: Ray's errors vary
            reason = f"data parallel rank {rank}'s Ray actor was lost ({type(e).__name__})"
        if not self._closed:
            self.on_lost([rank], reason)

    def shutdown(self) -> None:
        """Stop the engines and actors, remove the placement group, and stop Ray if this
        object started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        stops = []
        for actor in self.actors:
            try:
                stops.append(actor.stop.remote())
            except Exception:  # noqa: BLE001 - already dead
                pass
        try:
            ray.wait(stops, num_returns=len(stops), timeout=15)
        except Exception:  # noqa: BLE001
            pass
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
