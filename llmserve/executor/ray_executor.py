"""Workers as Ray actors (vLLM's ``RayDistributedExecutor``): ``--distributed-executor-backend ray``.

One placement group of ``world_size`` bundles (``{"CPU": threads}``, or ``{"GPU": 1}`` on
CUDA; strategy PACK, so a one-node cluster keeps them together and a larger one spreads
them only when a node is full); one ``Worker`` actor per bundle; ``torch.distributed``
rendezvous over TCP at the driver's node address. Ray is started here (``ray.init()``) when
this process is not connected to a cluster yet; ``shutdown`` kills the actors and removes
the placement group (and stops Ray if it started it).
"""
from __future__ import annotations

import socket
from typing import Any, Optional

from llmserve.executor.abstract import Executor, combine_group_windows, combine_sliding_windows
from llmserve.executor.multiproc_executor import _NoPrefault
from llmserve.worker.worker import Worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayDistributedExecutor(Executor):
    """``parallel_config.world_size`` Ray actors; rank 0's output is the step's.
    Raises ImportError (install the ``ray`` extra) when Ray is missing."""

    uses_ray = True

    def _init_executor(self) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'llmserve[ray]'") from e
        self._ray = ray
        self._remove_pg = remove_placement_group
        self.model_runner = _NoPrefault()
        self.workers: list = []
        self.pg = None
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        world = self.vllm_config.parallel_config.world_size
        cuda = self.vllm_config.model_config.device == "cuda"
        # One Ray CPU per actor is a scheduling unit; its torch threads are cores / T (Worker).
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        try:
            self.pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
            ray.get(self.pg.ready(), timeout=120)
            actor_cls = ray.remote(Worker)
            init = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
            self.workers = [actor_cls.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=r),
            ).remote(self.vllm_config, r, world, init) for r in range(world)]
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """``Worker.<method>(*args)`` on every actor; results in rank order. A dead actor
        raises (Ray's ActorDiedError / RayActorError), which the engine treats as fatal."""
        return self._ray.get([w.execute_method.remote(method, *args) for w in self.workers])

    def determine_num_blocks(self) -> int:
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
        self._ray.get([w.ping.remote() for w in self.workers], timeout=10)

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group, stop Ray if this executor started it."""
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        for w in getattr(self, "workers", []):
            try:
                ray.kill(w)
            except Exception:
                pass
        self.workers = []
        if getattr(self, "pg", None) is not None:
            try:
                self._remove_pg(self.pg)
            except Exception:
                pass
            self.pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._ray = None

