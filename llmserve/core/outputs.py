"""Ground-floor types shared by the scheduler, the model runner and the front end.

Imports nothing of llmserve (only msgspec and the standard library), so every layer may
import it: ``core`` (scheduler), ``worker`` (model runner), ``engine`` (wire messages,
output processor). vLLM keeps the same types in ``vllm/v1/outputs.py`` (LogprobsLists,
ModelRunnerOutput) and ``vllm/v1/engine/__init__.py`` (FinishReason, EngineCoreEvent,
EngineCoreOutput).

``EngineCoreOutput`` is both what ``Scheduler.update_from_output`` builds and what crosses
the process boundary inside ``EngineCoreOutputs``: one struct, no field-by-field copy.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import msgspec


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives the OpenAI value. Encoded as an int."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of some positions. token_ids[i]: the actual/sampled token first, then the
    top-k ids; logprobs[i]: natural-log probabilities, same order; ranks[i]: 1-based rank
    of the first token."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request inside the engine (vLLM's ``EngineCoreEventType``)."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped request event. timestamp: ``time.monotonic()`` seconds in the engine
    process (CLOCK_MONOTONIC is system-wide on Linux, so the front end on the same host
    can subtract its own monotonic times; only differences between events of one
    request are used). For the request timeline (core/timeline.py): a SCHEDULED event
    carries the prompt tokens of that scheduling (``num_tokens``, one prefill chunk) and
    those found in the prefix cache (``cached_tokens``); a PREEMPTED event its
    ``reason``."""

    type: EngineCoreEventType
    timestamp: float
    num_tokens: int = 0
    cached_tokens: int = 0
    reason: Optional[str] = None

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: Optional[float] = None) -> "EngineCoreEvent":
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class BeamSequenceOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One finished beam of a beam-search request (core/beam_search.py): its generated
    token_ids (EOS included when it ended on one), the raw logprob of each, their sum
    cum_logprob and the length-penalised score it was ranked by."""

    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float
    finish_reason: FinishReason
    stop_reason: Union[int, str, None] = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """News about one request from one step (vLLM's ``EngineCoreOutput``).

    new_token_ids: tokens sampled this step (empty while a prompt is being prefilled);
    finish_reason: set when the request finished; stop_reason: the stop token id that
    ended it (or None); num_cached_tokens: prompt tokens served from the prefix cache;
    events: QUEUED/SCHEDULED/PREEMPTED events since the last output (only when the engine
    logs stats)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[LogprobsLists] = None
    new_prompt_logprobs: Optional[LogprobsLists] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[int, str, None] = None
    num_cached_tokens: int = 0
    events: Optional[list[EngineCoreEvent]] = None
    # The pooled vector (a float32 torch.Tensor, carried by serial.py's tensor ext) of a
    # pooling request; None for generation.
    pooling_output: Any = None
    # --collect-detailed-traces: on the last output, the seconds of execute_model of the
    # steps the request was in (core/timeline.py record_execute_time).
    model_execute_time: float = 0.0
    # A beam-search request's result, best first (sent once, when the search ends).
    beam_sequences: Optional[list[BeamSequenceOutput]] = None
    # A beam-search request's first step (``time.monotonic()`` in the engine; 0.0: none),
    # sent with its result: its first tokens' time on the request timeline.
    beam_first_token_ts: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ModelRunnerOutput:
    """What the model runner returns for one step: per request id, the sampled token
    (absent when the step ended inside a prompt chunk), its logprobs and the prompt
    logprobs of the positions computed this step, or for pooling requests the pooled
    vector (vLLM's ``ModelRunnerOutput``).
    In-process only (it never crosses a process boundary)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    pooler_output: dict[str, Any] = field(default_factory=dict)  # request id -> pooled tensor
    # Requests that verified drafts (speculative decoding): every token emitted this step,
    # accepted drafts then the bonus/correction token (``sampled_token_ids`` holds the
    # first); ``logprobs`` then has one position per emitted token.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Blocks whose KV a connector failed to load this step (vLLM's
    # KVConnectorOutput.invalid_block_ids): their requests are computed again from there.
    invalid_block_ids: set[int] = field(default_factory=set)
