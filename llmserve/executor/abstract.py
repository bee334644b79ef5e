"""The executor interface the EngineCore drives (vLLM's ``vllm.v1.executor.abstract.Executor``).

An executor owns the workers (here: one model runner in this process) and forwards the
engine's calls to them: load the model, size and allocate the KV cache, run one step.
The scale-out issue adds multiprocess / Ray executors behind the same interface.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmserve.core.outputs import ModelRunnerOutput
    from llmserve.core.sched_output import SchedulerOutput

# distributed_executor_backend values and the executor that serves each (None: default).
_BACKENDS = {None: "uni", "uni": "uni"}


class Executor:
    """Base class. Subclasses implement ``_init_executor`` and the worker calls."""

    uses_ray: bool = False
    supports_pp: bool = False

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self._init_executor()

    @staticmethod
    def get_class(vllm_config: Any) -> type["Executor"]:
        """The executor class for ``vllm_config.parallel_config.distributed_executor_backend``
        (None or "uni": ``UniProcExecutor``; an Executor subclass is returned as is).
        Raises ValueError for a backend this engine does not have, or for tensor/pipeline
        parallel sizes above 1, which no executor here can run yet."""
        pc = getattr(vllm_config, "parallel_config", None)
        backend = getattr(pc, "distributed_executor_backend", None)
        if isinstance(backend, type):
            if not issubclass(backend, Executor):
                raise ValueError(f"distributed_executor_backend: {backend.__name__} is not an Executor subclass")
            return backend
        if backend not in _BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r} is not supported; "
                             f"choose one of {sorted(k for k in _BACKENDS if k)} (or leave it unset)")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if (getattr(pc, name, 1) or 1) > 1:
                raise ValueError(f"{name}={getattr(pc, name)} needs a multi-process executor, which this "
                                 "engine does not have yet; use 1")
        from llmserve.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor

    def _init_executor(self) -> None:
        raise NotImplementedError

    # ---- worker calls ------------------------------------------------------
    def determine_num_blocks(self) -> int:
        raise NotImplementedError

    def initialize_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def execute_model(self, scheduler_output: "SchedulerOutput") -> "ModelRunnerOutput":
        raise NotImplementedError

    def remove_requests(self, req_ids) -> None:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker is unhealthy (the in-process worker always is healthy)."""

    def shutdown(self) -> None:
        """Release the workers."""
