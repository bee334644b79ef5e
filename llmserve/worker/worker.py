"""One tensor-parallel worker (vLLM's ``Worker``): a ModelRunner holding rank ``rank``'s
share of the model, in whatever process the executor put it (a worker process of
``MultiprocExecutor``, a Ray actor of ``RayDistributedExecutor``).

Every rank runs every step (the forward needs all of them for its all-reduces); only
rank 0's ``ModelRunnerOutput`` goes back to the engine, the others return None.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

logger = logging.getLogger(__name__)


def default_num_threads(config: Any, local_world_size: int) -> int:
    """torch threads per worker: ``config.num_threads`` if set, else this machine's cores
    split between the engine's local workers (at least 1)."""
    if getattr(config, "num_threads", None):
        return int(config.num_threads)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


class Worker:
    """rank / world_size in the engine's TP group; ``dist_init_method``: the
    ``torch.distributed`` rendezvous every rank uses (``file://`` or ``tcp://``)."""

    def __init__(self, config: Any, rank: int, world_size: int, dist_init_method: str) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.dist_init_method = dist_init_method
        self.model_runner = None
        self.tp = None

    def init_device(self) -> None:
        """Set this worker's threads (cores / T) and join the TP process group."""
        import torch

        from llmserve.distributed.parallel_state import init_tp_group

        torch.set_num_threads(default_num_threads(self.config, self.world_size))
        self.tp = init_tp_group(self.rank, self.world_size, self.dist_init_method,
                                self.config.model_config.device)

    def load_model(self) -> None:
        """Load the whole checkpoint, then keep this rank's share (models/tensor_parallel.py)."""
        from llmserve.worker.model_runner import ModelRunner

        self.model_runner = runner = ModelRunner(self.config)
        runner.load_model(pack_weights=self.world_size == 1)
        if self.world_size > 1:
            from llmserve.models.tensor_parallel import shard_llama
            from llmserve.ops.onednn_linear import pack_model

            shard_llama(runner.model, self.tp)
            runner.num_kv_heads = runner.model.tp_num_kv_heads
            pack_model(runner.model)  # the shards, not the whole weights (CPU only)
            runner.init_lora()  # LoRA wrappers around the shards (llmserve/lora/layers.py)
            import gc

            gc.collect()  # the unsharded weights go now, not at the next collection

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def kv_cache_sliding_window(self) -> Optional[int]:
        return self.model_runner.kv_cache_sliding_window()

    def kv_cache_group_windows(self) -> list[Optional[int]]:
        return self.model_runner.kv_cache_group_windows()

    def kv_cache_bytes_per_block(self) -> int:
        return self.model_runner.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: Any) -> Optional[Any]:
        out = self.model_runner.execute_model(scheduler_output)
        return out if self.rank == 0 else None

    def remove_requests(self, req_ids) -> None:
        self.model_runner.remove_requests(req_ids)

    def add_lora(self, lora_request: Any) -> bool:
        return self.model_runner.lora_model_manager().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_runner.lora_model_manager().remove(lora_id)

    def ping(self) -> str:
        return "pong"

    def shutdown(self) -> None:
        from llmserve.distributed.parallel_state import destroy_tp_group

        if self.model_runner is not None:
            self.model_runner.shutdown()
        self.model_runner = None
        destroy_tp_group()

    def execute_method(self, method: str, *args: Any) -> Any:
        """Run one of the methods above by name (the executors' ``collective_rpc``)."""
        return getattr(self, method)(*args)
