"""Messages that cross the process boundary between the front end and EngineCoreProc.

All are msgspec Structs (encoded by ``engine/serial.py``); nothing else crosses. The
input socket carries two frames: a one-byte request type and the payload, so the engine
can dispatch without decoding. Follows vLLM's v1 ``EngineCoreRequest`` /
``EngineCoreOutputs``.

Ground floor: imports only the ground-floor types (``core/outputs.py``), the scheduler
stats and ``SamplingParams``, never the engine, the scheduler or the runner. Control
messages are typed: the start-up handshake (``EngineCoreReady``), a refused request
(``EngineCoreRejection``, raised as ValueError on the client) and a dead engine
(``EngineCoreDead``, raised as EngineDeadError).
"""
from __future__ import annotations

import enum
from typing import Any, Optional

import msgspec

from llmserve.core.outputs import (BeamSequenceOutput, EngineCoreEvent, EngineCoreEventType, EngineCoreOutput,
                                   FinishReason, LogprobsLists)
from llmserve.beam_search import BeamSearchParams
from llmserve.lora.request import LoRARequest
from llmserve.metrics.stats import SchedulerStats
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams


__all__ = ["EngineCoreRequestType", "EncoderInputs", "EngineCoreRequest", "StreamingInputChunk", "EngineCoreReady",
           "EngineCoreRejection", "EngineCoreDead", "UtilityOutput", "EngineCoreOutputs", "UtilityRequest",
           "WIRE_TYPES", "EngineCoreOutput", "EngineCoreEvent", "EngineCoreEventType", "FinishReason",
           "LogprobsLists"]


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every message to the engine."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"
    STREAMING_INPUT = b"\x04"


class EncoderInputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An encoder-decoder request's encoder input (Whisper: log-mel features
    ``[num_mel_bins, frames]``) as raw bytes of a C-contiguous array of ``shape`` and
    numpy ``dtype`` name. ``num_encoder_tokens``: positions the encoder produces (frames
    after its stride), what the scheduler's encoder budget counts."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str
    num_encoder_tokens: int


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request for the engine: prompt tokens and sampling parameters, or for a pooling
    model ``pooling_params`` (then ``sampling_params`` is None).

    max_tokens in sampling_params is already resolved (never None); arrival_time is
    time.time() seconds. resumable: a streaming-input session (``StreamingInputChunk``
    messages extend it; it finishes only after the final chunk). trace_headers: W3C trace
    context (``traceparent``, ``tracestate``) of the caller, kept for tracing.
    reasoning_ended: for a structured-output request under a reasoning parser, whether the
    reasoning already ended (the grammar applies from the first token); None lets the
    engine decide from the prompt (vLLM).
    output_token_ids: tokens this request generated in an engine that died (self-healing
    restart): the engine starts it as if it had been preempted after them, so its output
    budget, penalties, ``min_tokens`` and seeded stream positions continue.
    encoder_inputs: an encoder-decoder model's encoder input (audio features), None for
    every other request.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Optional[SamplingParams]
    eos_token_id: Optional[int]
    arrival_time: float
    priority: int = 0
    resumable: bool = False
    trace_headers: Optional[dict[str, str]] = None
    pooling_params: Optional[PoolingParams] = None
    reasoning_ended: Optional[bool] = None
    output_token_ids: list[int] = []
    encoder_inputs: Optional[EncoderInputs] = None
    data_parallel_rank: Optional[int] = None  # pins the DP engine (DPLBAsyncMPClient)
    client_index: int = 0  # the API server that sent it (--api-server-count): its outputs go there
    tenant: Optional[str] = None  # the caller's tenant name (API key), for the fair share (core/fair_share.py)
    tenant_weight: float = 1.0  # that tenant's weight in the fair share
    beam_search_params: Optional[BeamSearchParams] = None  # beam search in the engine (core/beam_search.py)
    lora_request: Optional[LoRARequest] = None  # the adapter it runs with (llmserve/lora)


class StreamingInputChunk(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A later input chunk of a streaming-input (resumable) request.

    When the request has generated its output for the previous chunk, the engine appends
    ``prompt_token_ids`` to its context (after the tokens whose KV is computed: the last
    sampled token, which has no KV yet, is dropped, as in vLLM) and generates again with
    ``sampling_params`` (or the request's own). Chunks that arrive while it is busy wait
    in order. ``final`` (with no tokens) closes the input: the request finishes once it
    has answered the last chunk.
    """

    request_id: str
    prompt_token_ids: list[int] = []
    sampling_params: Optional[SamplingParams] = None
    final: bool = False


class EngineCoreReady(msgspec.Struct, array_like=True, gc=False):
    """Start-up handshake: the engine is up with ``num_blocks`` KV blocks, in process pid."""

    num_blocks: int
    pid: int


class EngineCoreRejection(msgspec.Struct, array_like=True, gc=False):
    """The engine refused a request (e.g. it could never fit in the KV cache); the client
    raises ValueError(message) to its caller. The engine keeps running. ``engine_lost``:
    not the request's fault, the engine that held it is gone (a lost data-parallel node):
    the caller gets EngineGenerateError (HTTP 500) instead."""

    request_id: str
    message: str
    engine_lost: bool = False


class EngineCoreDead(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine hit an unrecoverable error or its process died (ENGINE_CORE_DEAD);
    during_startup: it never became ready. The client raises EngineDeadError (or, at
    start-up, RuntimeError) with ``message``."""

    message: str
    exit_code: Optional[int] = None
    during_startup: bool = False


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """Result of a utility call: result (msgpack-able) or failure_message."""

    call_id: int
    result: Any = None
    failure_message: Optional[str] = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step (or event) sends back. timestamp: time.monotonic()."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: Optional[SchedulerStats] = None
    timestamp: float = 0.0
    utility_output: Optional[UtilityOutput] = None
    finished_requests: Optional[list[str]] = None
    rejected: Optional[list[EngineCoreRejection]] = None
    dead: Optional[EngineCoreDead] = None
    ready: Optional[EngineCoreReady] = None
    engine_index: int = 0  # the DP rank that sent it (set by the DP client on receipt)

    @property
    def engine_dead(self) -> bool:
        return self.dead is not None


class UtilityRequest(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    method: str
    args: list[Any] = []
    client_index: int = 0  # the API server whose output socket gets the result


#: Every struct that crosses the process boundary (the round-trip test walks this).
WIRE_TYPES = (EngineCoreRequest, EncoderInputs, StreamingInputChunk, EngineCoreOutput, EngineCoreOutputs, EngineCoreReady,
              EngineCoreRejection, EngineCoreDead, UtilityOutput, UtilityRequest, LogprobsLists, EngineCoreEvent,
              BeamSearchParams, BeamSequenceOutput, LoRARequest)


class EngineHandshake(msgspec.Struct, array_like=True, gc=False):
    """A ``--headless`` node joining the head (multi-node data parallel, engine/multinode.py):
    it runs ranks ``start_rank .. start_rank + size_local - 1``, from host ``host``. Sent once,
    msgpack, on the TCP connection to the head's ``--data-parallel-rpc-port``; that
    connection stays open while the node lives (its close is the node's loss)."""

    start_rank: int
    size_local: int
    host: str
