"""The pooling half of the offline ``LLM`` API (vLLM's ``LLM.encode``/``embed``/``score``),
kept apart from generation. Mixed into ``LLM``; uses its ``_prompt_list``,
``_add_requests`` and ``_run_engine`` (progress bar, abort on error)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch.nn.functional as F
from tqdm.auto import tqdm

from llmserve.engine.request_kwargs import refuse_unhonoured
from llmserve.outputs import EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput
from llmserve.pooling_params import PoolingParams

PoolingParamsArg = Union[PoolingParams, Sequence[PoolingParams], None]


class PoolingMixin:
    """``encode``, ``embed`` and ``score`` for a model run with ``runner="pooling"``.

    Each raises ValueError on a generating model, suggesting ``--runner pooling``, as
    vLLM; bad prompts or params raise ValueError with nothing left running."""

    def _check_pooling(self, task: str) -> None:
        tasks = self.llm_engine.get_supported_tasks()
        if task not in tasks:
            raise ValueError(
                f"LLM.{'embed' if task == 'embed' else 'encode'}() is only supported for pooling models, and this "
                f"model supports {list(tasks)}. Try passing `--runner pooling` (or `convert='embed'`) to use "
                f"the model as a pooling model.")

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

    def score(self, data_1, data_2, /, *, truncate_prompt_tokens: Optional[int] = None,
              use_tqdm: Union[bool, Callable[..., tqdm]] = True, pooling_params: Optional[PoolingParams] = None,
              lora_request=None) -> list[ScoringRequestOutput]:
        """Similarity scores of text pairs (vLLM's ``LLM.score``): one ``data_1`` against
        each of ``data_2`` (1:N), or ``data_1[i]`` with ``data_2[i]`` (N:N). For an
        embedding model the score is the cosine similarity of the two embeddings.
        Raises ValueError for empty inputs or lists of different lengths."""
        self._check_pooling("embed")
        a = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        b = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        if not a or not b:
            raise ValueError("score: data_1 and data_2 must not be empty")
        if len(a) == 1:
            a = a * len(b)
        elif len(a) != len(b):
            raise ValueError(f"score: data_1 has {len(a)} items and data_2 {len(b)}; give one data_1 or as many "
                             "as data_2")
        outs = self.encode(a + b, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed")
        return [score_pair(x, y) for x, y in zip(outs[:len(a)], outs[len(a):])]


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
