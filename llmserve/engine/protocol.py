"""The engine-client interface the server sees (vLLM's ``vllm.engine.protocol.EngineClient``).

The HTTP layer talks only to an ``EngineClient``: prompts in, ``RequestOutput``s out.
``AsyncLLM`` implements it; the data-parallel clients of the scale-out issue will too.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, AsyncGenerator, Iterable, Mapping, Optional

from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams


class EngineClient(ABC):
    """Abstract async engine client.

    Attributes every implementation sets: ``vllm_config`` and ``model_config``.
    """

    vllm_config: Any
    model_config: Any

    # ---- state ---------------------------------------------------------------
    @property
    @abstractmethod
    def is_running(self) -> bool:
        """True while the engine can take requests."""

    @property
    @abstractmethod
    def is_stopped(self) -> bool:
        """True once the engine was shut down or died."""

    @property
    @abstractmethod
    def errored(self) -> bool:
        """True once the engine died (every request then fails with ``dead_error``)."""

    @property
    @abstractmethod
    def dead_error(self) -> BaseException:
        """The exception callers get once ``errored`` (an EngineDeadError)."""

    # ---- requests --------------------------------------------------------------
    @abstractmethod
    def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, *,
                 priority: int = 0, trace_headers: Optional[Mapping[str, str]] = None,
                 lora_request: Any = None) -> AsyncGenerator[RequestOutput, None]:
        """Yield the RequestOutputs of one request. ``prompt``: text, token ids, a prompt
        dict, or an async generator of input chunks (streaming input). Implementations
        take exactly vLLM's keyword arguments (``AsyncLLM.generate``), never a catch-all."""

    @abstractmethod
    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown ids are ignored)."""

    # ---- utilities -----------------------------------------------------------
    @abstractmethod
    async def get_tokenizer(self) -> Any:
        """The front end's tokenizer."""

    @abstractmethod
    async def check_health(self) -> None:
        """Raise ``dead_error`` when the engine is not healthy."""

    @abstractmethod
    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False when blocks are in use."""

    @abstractmethod
    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine and everything this client owns within ``timeout`` seconds."""

    async def is_tracing_enabled(self) -> bool:
        """Trace headers are logged with the request; no span exporter is wired yet."""
        return False

    async def do_log_stats(self) -> None:
        """Hook for periodic stat logging (the stat loggers log as outputs arrive)."""

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)
