"""Outputs returned to users (vLLM's ``RequestOutput`` / ``CompletionOutput``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union


@dataclass
class Logprob:
    """The log-probability of one token (natural log, float), its 1-based rank in the
    distribution the sampler drew from, and its decoded text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per position: token id -> Logprob (the sampled/actual token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# Same, with None for the first prompt token (it has no conditional probability).
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    """One completion of a request.

    index: position among the request's n completions. text/token_ids: the generated
    text and tokens (cumulative or delta, by the request's output kind). finish_reason:
    None while running, then "stop", "length" or "abort". stop_reason: the stop string or
    stop token id that ended it (None for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one request (vLLM's ``RequestOutput``).

    prompt_token_ids: the tokens of the prompt; prompt_logprobs: per prompt token (first is
    None) when asked for; outputs: one CompletionOutput per completion; finished: True on
    the last output; metrics: timing (seconds) when collected.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[list[int]]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional["RequestMetrics"] = None
    num_cached_tokens: int = 0

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Merge a later output into this one (used when a consumer falls behind).

        aggregate: True for DELTA outputs (texts and tokens are concatenated), False for
        CUMULATIVE (the later output replaces the earlier one).
        """
        self.finished |= next_output.finished
        self.metrics = next_output.metrics or self.metrics
        if next_output.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        for nxt in next_output.outputs:
            for i, cur in enumerate(self.outputs):
                if cur.index == nxt.index:
                    if aggregate:
                        cur.text += nxt.text
                        cur.token_ids = list(cur.token_ids) + list(nxt.token_ids)
                        if nxt.logprobs is not None:
                            cur.logprobs = (cur.logprobs or []) + nxt.logprobs
                        cur.cumulative_logprob = nxt.cumulative_logprob
                        cur.finish_reason = nxt.finish_reason
                        cur.stop_reason = nxt.stop_reason
                    else:
                        self.outputs[i] = nxt
                    break
            else:
                self.outputs.append(nxt)
        self.outputs.sort(key=lambda o: o.index)


@dataclass
class RequestMetrics:
    """Timestamps (unix seconds, time.time()) of one request, vLLM's ``RequestMetrics``
    names. first_scheduled_time / time_in_queue (seconds from the engine's queueing to
    its first scheduling) are known when the front end keeps timelines (else None)."""

    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_generation_tokens: int = 0
    first_scheduled_time: Optional[float] = None
    time_in_queue: Optional[float] = None


@dataclass
class PoolingOutput:
    """The pooled vector of one prompt (vLLM's ``PoolingOutput``): ``data`` is a float32
    CPU tensor ``[dim]``."""

    data: Any


@dataclass
class PoolingRequestOutput:
    """Output of a pooling request (vLLM's ``PoolingRequestOutput``): ``outputs.data`` is
    the pooled vector; prompt_token_ids the tokens that were pooled (after any
    truncation); finished is always True (one output per request)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    """An embedding as a list of floats (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "EmbeddingOutput":
        data = output.data
        if data.ndim != 1:
            raise ValueError("pooled data should be 1-D for an embedding")
        return EmbeddingOutput(data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class _TypedPoolingRequestOutput:
    """A ``PoolingRequestOutput`` whose ``outputs`` is read as ``OUTPUT`` (an embedding, a
    classification...): vLLM's typed request outputs."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    OUTPUT: ClassVar[Any] = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput):
        return cls(out.request_id, cls.OUTPUT.from_base(out.outputs), out.prompt_token_ids, out.finished)


@dataclass
class EmbeddingRequestOutput(_TypedPoolingRequestOutput):
    """Output of ``LLM.embed`` (vLLM's ``EmbeddingRequestOutput``)."""

    outputs: EmbeddingOutput
    OUTPUT: ClassVar[Any] = EmbeddingOutput


@dataclass
class ClassificationOutput:
    """A classification head's output (vLLM's ``ClassificationOutput``): ``probs`` one
    float per label (softmax over the labels; sigmoid for one label; raw logits when the
    request asked ``use_activation=False``)."""

    probs: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "ClassificationOutput":
        data = output.data
        if data.ndim != 1:
            raise ValueError("pooled data should be 1-D (one value per label) for a classification")
        return ClassificationOutput(data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(_TypedPoolingRequestOutput):
    """Output of ``LLM.classify`` (vLLM's ``ClassificationRequestOutput``)."""

    outputs: ClassificationOutput
    OUTPUT: ClassVar[Any] = ClassificationOutput


@dataclass
class ScoringOutput:
    """A similarity score (vLLM's ``ScoringOutput``): cosine similarity in [-1, 1] for an
    embedding model; a cross-encoder's activated logit (sigmoid: in (0, 1)) for a
    classification model with one label."""

    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> "ScoringOutput":
        """A cross-encoder's one-label output ``[1]`` as its score."""
        data = output.data
        if data.numel() != 1:
            raise ValueError(f"a score needs one value per pair, got {data.numel()} (num_labels must be 1)")
        return ScoringOutput(float(data.reshape(-1)[0]))


@dataclass
class ScoringRequestOutput(_TypedPoolingRequestOutput):
    """Output of ``LLM.score`` (vLLM's ``ScoringRequestOutput``); prompt_token_ids: the
    tokens of both texts, first then second."""

    outputs: ScoringOutput
    OUTPUT: ClassVar[Any] = ScoringOutput
