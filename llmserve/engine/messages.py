"""Messages that cross the process boundary between the front-end and EngineCoreProc.

All are msgspec Structs (encoded by ``engine/serial.py``); nothing else crosses. The
input socket carries two frames: a one-byte request type and the payload, so the engine
can dispatch without decoding. Follows vLLM's v1 ``EngineCoreRequest`` /
``EngineCoreOutputs``.
"""
from __future__ import annotations

import enum
from typing import Any, Optional, Union

import msgspec

from llmserve.metrics.stats import SchedulerStats
from llmserve.sampling_params import SamplingParams


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every message to the engine."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request for the engine: prompt tokens and sampling parameters.

    max_tokens in sampling_params is already resolved (never None); arrival_time is
    time.time() seconds.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    arrival_time: float
    priority: int = 0


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of some positions. token_ids[i]: the actual/sampled token first, then the
    top-k ids; logprobs[i]: natural-log probabilities, same order; ranks[i]: 1-based rank
    of the first token."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """News about one request from one step. finish_reason: FinishReason value or None."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[LogprobsLists] = None
    new_prompt_logprobs: Optional[LogprobsLists] = None
    finish_reason: Optional[int] = None
    stop_reason: Union[int, str, None] = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """Result of a utility call: result (msgpack-able) or failure_message."""

    call_id: int
    result: Any = None
    failure_message: Optional[str] = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step (or event) sends back.

    engine_dead: the engine hit an unrecoverable error (ENGINE_CORE_DEAD); error holds
    its message. ready: start-up handshake (num_blocks in ready_info).
    """

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: Optional[SchedulerStats] = None
    timestamp: float = 0.0
    utility_output: Optional[UtilityOutput] = None
    finished_requests: Optional[list[str]] = None
    engine_dead: bool = False
    error: Optional[str] = None
    ready_info: Optional[dict[str, Any]] = None


class UtilityRequest(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    method: str
    args: list[Any] = []
