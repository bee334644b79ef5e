"""The pooler of a classification model (``PoolerConfig.task == "classify"``): vLLM's
``ClassifierPooler`` for the ``classify`` and ``score`` tasks and its
``TokenClassifierPoolerHead`` for ``token_classify`` (``LLM.reward``), over the model's
heads (``models/seq_cls.py``: ``classify_logits``, ``token_logits``).

Each request is pooled and run through the head on its own rows only, so its result
does not depend on the other prompts of the step (batch invariance, as the encoder).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmserve.pooler_config import PoolerConfig


def activate(kind: str, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[..., num_labels]`` float32 through one of ``pooler_config.ACTIVATIONS``:
    "classify" is vLLM's PoolerClassify (sigmoid when the last dimension is under 2,
    else softmax over it), "sigmoid", "tanh", "identity"."""
    if kind == "classify":
        return torch.sigmoid(logits) if logits.shape[-1] < 2 else torch.softmax(logits, dim=-1)
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    if kind == "tanh":
        return torch.tanh(logits)
    return logits


class ClassifierPooler:
    """``__call__(hidden [T, H], lens, params, model)`` -> one float32 CPU tensor per
    request: ``[num_labels]`` for classify and score (the head on the [CLS] row of an
    encoder or the last row of a decoder, then the config's classify / score
    activation), ``[n, num_labels]`` for token_classify (the head on every row, then
    vLLM's PoolerClassify). ``use_activation=False`` in a request's params: raw logits."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def __call__(self, hidden: torch.Tensor, lens: list[int], params: list, model: Any = None) -> list[torch.Tensor]:
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
        return [self._one(hidden[s:s + n], p, model).cpu() for s, n, p in zip(starts, lens, params)]

    def _one(self, rows: torch.Tensor, params: Any, model: Any) -> torch.Tensor:
        if params.task == "token_classify":
            logits, kind = model.token_logits(rows), "classify"
        else:
            row = rows[:1] if self.config.pooling_type == "CLS" else rows[-1:]
            logits = model.classify_logits(row)[0]
            kind = self.config.score_activation if params.task == "score" else self.config.classify_activation
        return logits if params.use_activation is False else activate(kind, logits)
