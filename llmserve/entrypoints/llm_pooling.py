"""The pooling half of the offline ``LLM`` API (vLLM's ``LLM.encode``/``embed``/``classify``/
``reward``/``score``), kept apart from generation. Mixed into ``LLM``; uses its ``_prompt_list``,
``_add_requests`` and ``_run_engine`` (progress bar, abort on error)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch.nn.functional as F
from tqdm.auto import tqdm

from llmserve.engine.pooling_inputs import resolve_truncation, task_hint
from llmserve.engine.request_kwargs import refuse_unhonoured
from llmserve.entrypoints.renderer import Renderer
from llmserve.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                              ScoringOutput, ScoringRequestOutput)
from llmserve.pooling_params import PoolingParams

PoolingParamsArg = Union[PoolingParams, Sequence[PoolingParams], None]


class PoolingMixin:
    """``encode``, ``embed``, ``classify``, ``reward`` and ``score`` for a model run with
    ``runner="pooling"``.

    Each raises ValueError on a model without the task (a generating model: suggesting
    ``--runner pooling``, as vLLM); bad prompts or params raise ValueError with nothing
    left running."""

    _API_OF_TASK = {"embed": "embed", "classify": "classify", "token_classify": "reward", "score": "score"}

    def _check_pooling(self, task: str, api: Optional[str] = None) -> None:
        tasks = self.llm_engine.get_supported_tasks()
        if task not in tasks:
            hint = ("Scoring pairs with a classification model needs one label (num_labels=1, a cross-encoder)."
                    if api == "score" and "classify" in tasks else task_hint(task))
            raise ValueError(f"LLM.{api or self._API_OF_TASK.get(task, 'encode')}() needs the {task!r} pooling "
                             f"task, and this model supports {list(tasks)}. {hint}")

    def _pooling_params_for(self, params: PoolingParamsArg, n: int, task: str,
                            truncate_prompt_tokens: Optional[int]) -> list[PoolingParams]:
        if params is None:
            params = PoolingParams()
        plist = [params] * n if isinstance(params, PoolingParams) else list(params)
        if len(plist) != n:
            raise ValueError(f"The lengths of prompts and params must be the same: got {len(plist)} "
                             f"pooling_params for {n} prompts; give one or one per prompt.")
        out = []
        for p in plist:
            p = p.clone()
            p.task = p.task or task
            if truncate_prompt_tokens is not None:
                p.truncate_prompt_tokens = truncate_prompt_tokens
            PoolingParams.__post_init__(p)
            out.append(p)
        return out

    def encode(self, prompts, pooling_params: PoolingParamsArg = None, *,
               truncate_prompt_tokens: Optional[int] = None,
               use_tqdm: Union[bool, Callable[..., tqdm]] = True, lora_request=None,
               pooling_task: Optional[str] = None,
               tokenization_kwargs: Optional[dict[str, Any]] = None) -> list[PoolingRequestOutput]:
        """Pool each prompt (string, token ids, prompt dict, or a list of them); outputs
        in input order, ``outputs.data`` a float32 tensor. pooling_params: one for all
        or one per prompt; pooling_task: "encode" (default) or "embed". vLLM's keyword
        arguments; ``tokenization_kwargs`` raises NotImplementedError when given."""
        refuse_unhonoured("LLM.encode", tokenization_kwargs=tokenization_kwargs)
        task = pooling_task or "encode"
        self._check_pooling(task)
        prompts = self._prompt_list(prompts)
        params = self._pooling_params_for(pooling_params, len(prompts), task, truncate_prompt_tokens)
        # Submitted shortest first (as sentence-transformers' encode sorts): each engine step
        # then holds prompts of about one length, so the encoder's attention runs few, full
        # buckets. Results are batch invariant, so the order changes no vector.
        order = sorted(range(len(prompts)), key=lambda i: _prompt_size(prompts[i]))
        loras = [lora_request[i] for i in order] if isinstance(lora_request, (list, tuple)) else lora_request
        ids = self._add_requests([prompts[i] for i in order], [params[i] for i in order], None, lora_request=loras)
        outs = self._run_engine(ids, use_tqdm)
        results: list = [None] * len(prompts)
        for j, i in enumerate(order):
            results[i] = outs[j]
        return results

    def embed(self, prompts, *, truncate_prompt_tokens: Optional[int] = None,
              use_tqdm: Union[bool, Callable[..., tqdm]] = True, pooling_params: PoolingParamsArg = None,
              lora_request=None, tokenization_kwargs: Optional[dict[str, Any]] = None) -> list[EmbeddingRequestOutput]:
        """Embeddings of the prompts, in input order (``outputs.embedding``: list of floats,
        normalised unless ``pooling_params.normalize=False``)."""
        self._check_pooling("embed")
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed",
                           tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts, *, use_tqdm: Union[bool, Callable[..., tqdm]] = True,
                 pooling_params: PoolingParamsArg = None, lora_request=None,
                 tokenization_kwargs: Optional[dict[str, Any]] = None) -> list[ClassificationRequestOutput]:
        """Class probabilities of each prompt, in input order (vLLM's ``LLM.classify``):
        ``outputs.probs`` one float per label (softmax; sigmoid for one label; logits with
        ``pooling_params.use_activation=False``). Needs a classification model."""
        self._check_pooling("classify")
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="classify", tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(self, prompts, *, truncate_prompt_tokens: Optional[int] = None,
               use_tqdm: Union[bool, Callable[..., tqdm]] = True, pooling_params: PoolingParamsArg = None,
               lora_request=None, tokenization_kwargs: Optional[dict[str, Any]] = None) -> list[PoolingRequestOutput]:
        """Per-token rewards (vLLM's ``LLM.reward``, its ``token_classify`` task): for each
        prompt ``outputs.data`` is float32 ``[num_tokens, num_labels]``, the classification
        head on every token's final hidden state, then softmax over the labels (sigmoid for
        one label; raw logits with ``use_activation=False``). For a decoder the last row is
        the last token's (its ``classify`` when the prompt ends in no pad token)."""
        self._check_pooling("token_classify")
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="token_classify",
                           tokenization_kwargs=tokenization_kwargs)

    def score(self, data_1, data_2, /, *, truncate_prompt_tokens: Optional[int] = None,
              use_tqdm: Union[bool, Callable[..., tqdm]] = True, pooling_params: Optional[PoolingParams] = None,
              lora_request=None) -> list[ScoringRequestOutput]:
        """Similarity scores of text pairs (vLLM's ``LLM.score``): one ``data_1`` against
        each of ``data_2`` (1:N), or ``data_1[i]`` with ``data_2[i]`` (N:N). For an
        embedding model the score is the cosine similarity of the two embeddings; for a
        cross-encoder (a classification model with one label) its head on the pair,
        tokenized together, through its score activation (sigmoid by default).
        Raises ValueError for empty inputs or lists of different lengths."""
        cross = "score" in self.llm_engine.get_supported_tasks()
        self._check_pooling("score" if cross else "embed", "score")
        a = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        b = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        if not a or not b:
            raise ValueError("score: data_1 and data_2 must not be empty")
        if len(a) == 1:
            a = a * len(b)
        elif len(a) != len(b):
            raise ValueError(f"score: data_1 has {len(a)} items and data_2 {len(b)}; give one data_1 or as many "
                             "as data_2")
        if cross:
            renderer = Renderer(self.get_tokenizer())
            cut = resolve_truncation(truncate_prompt_tokens, self.llm_engine.model_config.max_model_len)
            pairs = [renderer.render_pair(_text(x), _text(y), check_length=False, truncate=cut).to_engine_prompt()
                     for x, y in zip(a, b)]
            outs = self.encode(pairs, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                               use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="score")
            return [ScoringRequestOutput.from_base(o) for o in outs]
        outs = self.encode(a + b, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed")
        return [score_pair(x, y) for x, y in zip(outs[:len(a)], outs[len(a):])]


def _text(item) -> str:
    """A cross-encoder input's text: a string or a ``{"prompt": ...}`` dict (a pair is
    tokenized from text). Raises ValueError otherwise."""
    text = item.get("prompt") if isinstance(item, dict) else item
    if not isinstance(text, str):
        raise ValueError(f"score: a cross-encoder scores text pairs; got {type(item).__name__} {item!r:.60}")
    return text


def _prompt_size(prompt) -> int:
    """A cheap length proxy for ordering (characters or token ids), before tokenizing."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids") or prompt.get("prompt") or ""
    return len(prompt)


def score_pair(x: PoolingRequestOutput, y: PoolingRequestOutput) -> ScoringRequestOutput:
    """Cosine similarity of two pooled outputs (vLLM's ``_cosine_similarity``)."""
    s = F.cosine_similarity(x.outputs.data.float(), y.outputs.data.float(), dim=0)
    return ScoringRequestOutput(f"{x.request_id}_{y.request_id}", ScoringOutput(float(s.item())),
                                list(x.prompt_token_ids) + list(y.prompt_token_ids))


__all__ = ["PoolingMixin", "score_pair"]
