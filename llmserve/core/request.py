"""The engine-side state of one request (vLLM's ``Request``). Plain Python, no torch."""
from __future__ import annotations

import enum
import time
from collections import deque
from typing import Optional

from llmserve.core.outputs import EngineCoreEvent, EngineCoreEventType, FinishReason
from llmserve.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus", "FinishReason"]


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # A streaming-input request that answered its last chunk: holds its KV blocks, waits
    # for the next chunk (or the end of its input).
    WAITING_FOR_STREAMING_INPUT = 3
    # A structured-output request whose grammar is still compiling (vLLM's
    # WAITING_FOR_FSM): kept out of the waiting queue until it is ready.
    WAITING_FOR_FSM = 7
    # Everything after this is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return RequestStatus.FINISHED_STOPPED <= status <= RequestStatus.FINISHED_ABORTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> Optional["FinishReason"]:
        return _FINISHED_REASON.get(status)


_FINISHED_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """A request inside the EngineCore.

    Token accounting (all in tokens): ``num_tokens`` = prompt + output so far;
    ``num_computed_tokens`` = tokens whose KV is in the cache; the scheduler schedules
    ``num_tokens - num_computed_tokens`` more (a chunk of the prompt, or 1 to decode).
    ``max_tokens`` is the output budget, already resolved against max_model_len by the
    InputProcessor.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: Optional[int],
        arrival_time: Optional[float] = None,
        priority: int = 0,
        resumable: bool = False,
        trace_headers: Optional[dict[str, str]] = None,
        log_stats: bool = False,
        pooling_params=None,
        encoder_inputs=None,
    ) -> None:
        self.request_id = request_id
        # A pooling request (pooling_params set) runs its prompt once and samples nothing;
        # it gets greedy one-token SamplingParams only so that shared code can read them.
        self.pooling_params = pooling_params
        if sampling_params is None:
            sampling_params = SamplingParams(max_tokens=1, temperature=0.0)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.max_tokens: int = sampling_params.max_tokens if sampling_params.max_tokens is not None else 1 << 30
        if pooling_params is not None:
            self.max_tokens = 0
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set on first scheduling (prefix-cache hits)
        self.num_preemptions = 0
        # Prefix-cache hashes of the full blocks of _all_token_ids, computed lazily.
        self.block_hashes: list[int] = []
        self.trace_headers = trace_headers
        # Streaming input: later chunks wait here while the request answers one.
        self.resumable = resumable
        self.streaming_queue: deque = deque()
        self.input_closed = not resumable
        # Events for the front end's timing stats (only when the engine logs stats).
        self.log_stats = log_stats
        self.events: list[EngineCoreEvent] = []
        if log_stats:
            self.record_event(EngineCoreEventType.QUEUED)
        # Grammar state (a StructuredOutputRequest) of a structured-output request, set by
        # the engine's StructuredOutputManager; None for every other request.
        self.structured_output_request = None
        # Encoder-decoder (Whisper): the encoder input (engine.messages.EncoderInputs) and
        # whether the scheduler has spent encoder budget on it (the runner then runs the
        # encoder at this request's first step and keeps its output until it finishes).
        self.encoder_inputs = encoder_inputs
        self.num_encoder_tokens = encoder_inputs.num_encoder_tokens if encoder_inputs is not None else 0
        self.encoder_scheduled = False
        # The caller's tenant and its weight (engine.messages.EngineCoreRequest), for the
        # scheduler's fair share; None: the default tenant.
        self.tenant: Optional[str] = None
        self.tenant_weight = 1.0
        # The adapter it runs with (llmserve.lora.LoRARequest), None: the base model.
        self.lora_request = None
        # Beam search (core/beam_search.py): the request's BeamSearchParams as sent; on
        # each beam (a Request of its own), the BeamGroup it belongs to.
        self.beam_search_params = None
        self.beam_group = None
        # On a beam: the search's temperature; the runner computes the beam's top-K row
        # as log_softmax(logits / temperature) (0 or 1: the raw logprobs).
        self.beam_temperature = 0.0

    def record_event(self, event_type: EngineCoreEventType, timestamp: Optional[float] = None) -> None:
        if self.log_stats:
            self.events.append(EngineCoreEvent.new_event(event_type, timestamp))

    def take_events(self) -> Optional[list[EngineCoreEvent]]:
        """The events since the last call (None when there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def append_prompt_chunk(self, token_ids: list[int], sampling_params: Optional[SamplingParams],
                            block_size: int) -> None:
        """Streaming input: continue with ``token_ids`` after the tokens whose KV is
        computed (the last sampled token has none and is dropped, as in vLLM); the
        output budget restarts for the new chunk."""
        kept = self._all_token_ids[:self.num_computed_tokens]
        self.prompt_token_ids = kept + list(token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)
        self._output_token_ids = []
        # Hashes of full blocks past the computed tokens covered the dropped token.
        del self.block_hashes[self.num_computed_tokens // block_size:]
        if sampling_params is not None:
            self.sampling_params = sampling_params
            if sampling_params.max_tokens is not None:
                self.max_tokens = sampling_params.max_tokens
        self.stop_reason = None

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> Optional[FinishReason]:
        return RequestStatus.get_finished_reason(self.status)

    @property
    def use_prefix_cache(self) -> bool:
        # Prompt logprobs need the logits of every prompt position, and a per-token
        # classification (reward) the hidden state of every prompt token: no cache hits.
        if self.pooling_params is not None and self.pooling_params.task == "token_classify":
            return False
        return self.sampling_params.prompt_logprobs is None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
