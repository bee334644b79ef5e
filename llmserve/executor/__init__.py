"""Executors: what runs the model for the EngineCore (vLLM's ``vllm.v1.executor``).
``Executor.get_class(vllm_config)`` picks one: ``UniProcExecutor`` (uni),
``MultiprocExecutor`` (mp) or ``RayDistributedExecutor`` (ray, imported only when used)."""
from llmserve.executor.abstract import Executor
from llmserve.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
