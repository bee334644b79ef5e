"""Protocol of ``POST /v1/completions`` (OpenAI's legacy completions plus vLLM's extras)."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from llmserve.entrypoints.openai.common.limits import MAX_PROMPT_TOKEN_IDS, MAX_PROMPTS_PER_REQUEST
from llmserve.entrypoints.openai.common.protocol import (
    CompletionLogProbs,
    Int64,
    JSONInt,
    OpenAIBaseModel,
    PromptLogprobs,
    SamplingRequest,
    UsageInfo,
    check_max_logprobs,
    random_uuid,
    timing_field,
)
from llmserve.sampling_params import SamplingParams, SamplingParamsError

# OpenAI's legacy default ``max_tokens`` of /v1/completions.
DEFAULT_MAX_TOKENS = 16


TokenIds = Annotated[list[JSONInt], Field(max_length=MAX_PROMPT_TOKEN_IDS)]  # JSONInt: [true] is not token 1
PromptType = Union[TokenIds, Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS_PER_REQUEST)], str,
                   Annotated[list[str], Field(max_length=MAX_PROMPTS_PER_REQUEST)]]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token
    ids or a list of token-id lists. ``max_tokens`` defaults to 16 (OpenAI's legacy default).
    A non-empty ``suffix`` makes each prompt a fill-in-the-middle request: the prompt is
    the text before the cursor, ``suffix`` the text after it, laid out with the model's
    FIM tokens as llama-server's ``/infill`` does (``infill/fim.py``); a model without FIM
    tokens answers a 400 naming ``suffix``. An empty ``suffix`` is a plain completion."""

    prompt: PromptType
    echo: Optional[bool] = False
    logprobs: Optional[Int64] = None
    suffix: Optional[str] = None
    best_of: Optional[Int64] = None
    add_special_tokens: bool = True

    def check(self) -> None:
        """Request-level checks. Raises SamplingParamsError (param set)."""
        self.check_common()
        check_max_logprobs(self.logprobs, "logprobs")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise SamplingParamsError(
                f"best_of ({self.best_of}) must equal n ({self.n or 1}): generating more sequences than are "
                "returned and keeping the best is not supported; leave best_of out or set it to n.", "best_of")

    def check_openai_budget(self) -> None:
        """``max_tokens`` 0 (a prompt-scoring request) only with ``echo``, as OpenAI's legacy
        completions and vLLM take it: without echo the answer would carry nothing (OpenAI:
        400 "You requested a length 0 completion, but you did not set the 'echo'
        parameter"; vLLM: 400 "max_tokens must be at least 1"). Raises SamplingParamsError
        (param ``max_tokens``). ``/v1/completions`` (and its render) only: Ollama's raw
        ``/api/generate`` with ``num_predict`` 0 shares this request type and stays a
        0-token answer, as chat's :meth:`check_openai_budget` leaves Ollama's chat alone."""
        if self.max_tokens == 0 and not self.echo:
            raise SamplingParamsError(
                "max_tokens is 0 without echo: a 0-token completion that does not echo the prompt returns "
                "nothing; set echo to true (with logprobs, to score the prompt) or max_tokens to at least 1.",
                "max_tokens")

    def to_sampling_params(self, max_tokens: Optional[int], defaults: dict[str, Any]) -> SamplingParams:
        """Map the OpenAI fields to SamplingParams. max_tokens: the budget chosen by the
        server (``max_tokens`` or its default). With ``echo`` and ``logprobs`` the prompt's
        logprobs are asked for too (OpenAI's echo semantics). Raises SamplingParamsError."""
        kwargs = self.sampling_kwargs(defaults)
        kwargs["max_tokens"] = max_tokens
        if self.max_tokens is None and max_tokens is not None:  # vLLM: clamped, not a 400
            kwargs["min_tokens"] = min(kwargs["min_tokens"], max_tokens)
        kwargs["logprobs"] = self.logprobs
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        kwargs["prompt_logprobs"] = prompt_logprobs
        return SamplingParams(**kwargs)


class CompletionResponseChoice(OpenAIBaseModel):
    """One choice; vLLM's extras: ``prompt_logprobs`` (with the ``prompt_logprobs``
    field), ``prompt_token_ids`` and ``token_ids`` (with ``return_token_ids``)."""

    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    metrics: Optional[dict[str, Any]] = timing_field()  # vLLM's include_metrics
    timings: Optional[dict[str, Any]] = timing_field()  # llama.cpp's timings_per_token


class CompletionResponseStreamChoice(OpenAIBaseModel):
    """One choice's chunk; with ``return_token_ids`` the choice's first chunk carries
    ``prompt_token_ids`` and every chunk the ``token_ids`` it adds (vLLM)."""

    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None
    metrics: Optional[dict[str, Any]] = timing_field()
    timings: Optional[dict[str, Any]] = timing_field()
