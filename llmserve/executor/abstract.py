"""The executor interface the EngineCore drives (vLLM's ``vllm.v1.executor.abstract.Executor``).

An executor owns the workers (here: one model runner in this process) and forwards the
engine's calls to them: load the model, size and allocate the KV cache, run one step.
The scale-out issue adds multiprocess / Ray executors behind the same interface.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from llmserve.core.outputs import ModelRunnerOutput
    from llmserve.core.sched_output import SchedulerOutput

# distributed_executor_backend values and the executor that serves each (None: "uni" for
# one worker, "mp" for several, as vLLM on one node).
_BACKENDS = {
    "uni": "llmserve.executor.uniproc_executor.UniProcExecutor",
    "mp": "llmserve.executor.multiproc_executor.MultiprocExecutor",
    "ray": "llmserve.executor.ray_executor.RayDistributedExecutor",
}


def combine_sliding_windows(windows: list[Optional[int]]) -> Optional[int]:
    """The workers' ``kv_cache_sliding_window`` answers as one: None when any worker has a
    full-attention layer (pipeline stages hold different layers), else the largest."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def combine_group_windows(answers: list[list[Optional[int]]]) -> list[Optional[int]]:
    """The workers' ``kv_cache_group_windows`` as one: their common layout when all agree
    (tensor-parallel ranks hold the same layers), else one group by
    ``combine_sliding_windows`` of single-group answers (pipeline stages, which lay out
    one group each)."""
    if answers and all(a == answers[0] for a in answers):
        return list(answers[0])
    if any(len(a) != 1 for a in answers):
        raise ValueError(f"workers laid out different KV cache groups: {answers}")
    return [combine_sliding_windows([a[0] for a in answers])]


class Executor:
    """Base class. Subclasses implement ``_init_executor`` and the worker calls."""

    uses_ray: bool = False
    supports_pp: bool = False

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self._init_executor()

    @staticmethod
    def get_class(vllm_config: Any) -> type["Executor"]:
        """The executor class for ``vllm_config.parallel_config.distributed_executor_backend``:
        "uni" (``UniProcExecutor``, the model in the engine process), "mp"
        (``MultiprocExecutor``, one worker process per tensor-parallel rank), "ray"
        (``RayDistributedExecutor``, workers as Ray actors); None picks "uni" for one worker
        and "mp" for several; an Executor subclass is returned as is. Raises ValueError for
        another backend, or for "uni" with more than one worker."""
        pc = getattr(vllm_config, "parallel_config", None)
        backend = getattr(pc, "distributed_executor_backend", None)
        if isinstance(backend, type):
            if not issubclass(backend, Executor):
                raise ValueError(f"distributed_executor_backend: {backend.__name__} is not an Executor subclass")
            return backend
        world = (getattr(pc, "tensor_parallel_size", 1) or 1) * (getattr(pc, "pipeline_parallel_size", 1) or 1)
        if backend is None:
            backend = "uni" if world == 1 else "mp"
        if backend not in _BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r} is not supported; "
                             f"choose one of {sorted(_BACKENDS)} (or leave it unset)")
        if backend == "uni" and world > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker; tensor_parallel_size="
                             f"{pc.tensor_parallel_size} needs 'mp' or 'ray'")
        import importlib

        module, _, name = _BACKENDS[backend].rpartition(".")
        return getattr(importlib.import_module(module), name)

    def _init_executor(self) -> None:
        raise NotImplementedError

    # ---- worker calls ------------------------------------------------------
    def determine_num_blocks(self) -> int:
        raise NotImplementedError

    def initialize_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def kv_cache_sliding_window(self) -> Optional[int]:
        """The window (tokens) past which no layer reads the KV cache, when every layer is
        windowed (``ModelRunner.kv_cache_sliding_window``); None (the default): the
        scheduler keeps every block until the request ends."""
        return None

    def kv_cache_group_windows(self) -> list[Optional[int]]:
        """The window (None: full attention) of each KV cache group of the model
        (``ModelRunner.kv_cache_group_windows``); the default: one group of
        ``kv_cache_sliding_window``."""
        return [self.kv_cache_sliding_window()]

    def execute_model(self, scheduler_output: "SchedulerOutput") -> "ModelRunnerOutput":
        raise NotImplementedError

    def remove_requests(self, req_ids) -> None:
        raise NotImplementedError

    # ---- LoRA adapters (llmserve/lora): workers in other processes read the files
    # themselves, in add_lora (collective_rpc); the in-process executor reads off the loop.
    def read_lora(self, lora_request: Any) -> Any:
        """The adapter's weights read in this process, or None when the workers read it."""
        return None

    def add_lora(self, lora_request: Any, weights: Any = None) -> bool:
        return all(self.collective_rpc("add_lora", (lora_request,)))

    def remove_lora(self, lora_id: int) -> bool:
        return all(self.collective_rpc("remove_lora", (lora_id,)))

    # ---- sleep mode (llmserve/worker/sleep_mode.py): one in-process worker only so far
    def sleep(self, level: int = 1) -> None:
        raise ValueError("sleep mode (enable_sleep_mode) runs with one worker in the engine process "
                         "(tensor_parallel_size=1, pipeline_parallel_size=1)")

    def wake_up(self, tags: Any = None) -> None:
        self.sleep()

    def is_sleeping(self) -> bool:
        return False

    def check_health(self) -> None:
        """Raise if a worker is unhealthy (the in-process worker always is healthy)."""

    def shutdown(self) -> None:
        """Release the workers."""
