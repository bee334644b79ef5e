"""One model runner in the EngineCore's own process (vLLM's ``UniProcExecutor``)."""
from __future__ import annotations

from typing import Any, Optional

from llmserve.executor.abstract import Executor


class UniProcExecutor(Executor):
    """Builds the ModelRunner, loads the model, and forwards every worker call to it.
    ``model_runner`` is the runner itself (the idle prefault and tests reach it)."""

    def _init_executor(self) -> None:
        from llmserve.worker.model_runner import ModelRunner

        self.model_runner = ModelRunner(self.vllm_config)
        self.model_runner.load_model()

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

    def execute_model(self, scheduler_output: Any) -> Any:
        return self.model_runner.execute_model(scheduler_output)

    def remove_requests(self, req_ids) -> None:
        self.model_runner.remove_requests(req_ids)

    def read_lora(self, lora_request: Any) -> Any:
        return self.model_runner.lora_model_manager().read(lora_request)

    def add_lora(self, lora_request: Any, weights: Any = None) -> bool:
        return self.model_runner.lora_model_manager().add(lora_request, weights)

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_runner.lora_model_manager().remove(lora_id)

    def sleep(self, level: int = 1) -> None:
        self.model_runner.sleep(level)

    def wake_up(self, tags: Any = None) -> None:
        self.model_runner.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.model_runner.is_sleeping()

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown()
        self.model_runner = None
