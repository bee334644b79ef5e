"""The engine-side state of one request (vLLM's ``Request``). Plain Python, no torch."""
from __future__ import annotations

import enum
import time
from typing import Optional

from llmserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after this is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> Optional["FinishReason"]:
        return _FINISHED_REASON.get(status)


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives the OpenAI value."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


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
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.max_tokens: int = sampling_params.max_tokens if sampling_params.max_tokens is not None else 1 << 30
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set on first scheduling (prefix-cache hits)
        self.num_preemptions = 0
        # Prefix-cache hashes of the full blocks of _all_token_ids, computed lazily.
        self.block_hashes: list[int] = []

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
        # Prompt logprobs need the logits of every prompt position: no cache hits.
        return self.sampling_params.prompt_logprobs is None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
