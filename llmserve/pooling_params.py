"""Parameters of a pooling request (vLLM's ``PoolingParams``).

A pooling request runs the whole prompt once and returns a vector (an embedding) instead
of sampling tokens. ``PoolingParams`` travels in ``EngineCoreRequest.pooling_params`` in
place of ``SamplingParams``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from llmserve.sampling_params import RequestOutputKind, SamplingParamsError

#: The pooling tasks (vLLM's ``PoolingTask``). An embedding model's "score" runs as "embed"
#: + cosine similarity; a classification model's "score" is its head on a text pair.
POOLING_TASKS = ("encode", "embed", "classify", "token_classify", "score")
#: Tasks that run a classification head (a model with ``PoolerConfig.task == "classify"``).
CLASSIFY_TASKS = ("classify", "token_classify", "score")


@dataclass
class PoolingParams:
    """Fields (vLLM's names):
      normalize: L2-normalise the pooled vector (None: the model's default, True for
        embedding models as sentence-transformers' Normalize module / vLLM's embed).
      dimensions: keep the first ``dimensions`` values (Matryoshka); only for models
        whose config allows it, else ``verify`` raises (param ``dimensions``).
      truncate_prompt_tokens: keep only the last k prompt tokens (-1: max_model_len),
        as vLLM; None: no truncation (a prompt over max_model_len is an error).
      task: one of POOLING_TASKS (None: filled in by the caller's API).
      use_activation: apply the classification head's activation (softmax / sigmoid, see
        ``PoolerConfig``) to its logits (None: yes, as vLLM); False returns raw logits.
      output_kind: FINAL_ONLY (a pooling request has one output).
      hidden_state_embed: an "embed" request a generating model may serve (Ollama's
        embeddings from any model): its last prompt token's final hidden state, pooled in
        the generate runner's step beside sampled rows (no second model). False (vLLM's
        rule): only a pooling model embeds.
      compressed_token_type_ids: set by the engine, not by callers: where the second
        segment of a text pair starts (BERT's token_type_ids are 0 before it, 1 from it;
        vLLM keeps the same number in ``extra_kwargs``), None for a single text.
    Raises SamplingParamsError (a ValueError) naming the field.
    """

    normalize: Optional[bool] = None
    dimensions: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None
    task: Optional[str] = None
    use_activation: Optional[bool] = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    compressed_token_type_ids: Optional[int] = None
    hidden_state_embed: bool = False

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise SamplingParamsError(f"dimensions must be a positive integer, got {self.dimensions!r}",
                                      "dimensions")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or (t < 1 and t != -1)):
            raise SamplingParamsError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}",
                                      "truncate_prompt_tokens")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise SamplingParamsError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}", "task")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise SamplingParamsError(f"use_activation must be true, false or null, got {self.use_activation!r}",
                                      "use_activation")

    def clone(self) -> "PoolingParams":
        return replace(self)

    def verify(self, task: str, hidden_size: int, matryoshka_dimensions: Optional[list[int]] = None,
               is_matryoshka: bool = False) -> "PoolingParams":
        """A copy with ``task`` set and ``dimensions`` checked against the model (vLLM's
        ``PoolingParams.verify``): a model that is not Matryoshka refuses ``dimensions``
        other than its own width; a Matryoshka model with a list accepts only those."""
        p = replace(self, task=self.task or task)
        d = p.dimensions
        if d is not None and p.task in CLASSIFY_TASKS:
            raise SamplingParamsError(f"dimensions is only for embeddings, not the {p.task!r} task (dimensions={d}).",
                                      "dimensions")
        if d is not None and d != hidden_size:
            if not is_matryoshka:
                raise SamplingParamsError(
                    f"Model does not support matryoshka representation, changing output dimensions will "
                    f"lead to poor results (dimensions={d}).", "dimensions")
            if matryoshka_dimensions and d not in matryoshka_dimensions:
                raise SamplingParamsError(
                    f"Model only supports {matryoshka_dimensions} matryoshka dimensions, use other output "
                    f"dimensions will lead to poor results.", "dimensions")
            if d > hidden_size:
                raise SamplingParamsError(f"dimensions ({d}) exceeds the model's {hidden_size}", "dimensions")
        return p
