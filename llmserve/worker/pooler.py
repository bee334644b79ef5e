"""The pooler head: turns a step's final hidden states into one vector per pooling
request (vLLM's ``Pooler``: CLS, MEAN or LAST token, then Matryoshka truncation and L2
normalisation), and the runner's pooling step. A classification model's pooler is
``classifier_pooler.ClassifierPooler`` (``make_pooler``).

Every pooling request is scheduled whole (its prompt in one step, no decode), so the rows
of request i in the flat batch are ``[start_i, start_i + len_i)``. With a prefix-cache
hit (causal models only) the first rows are missing; causal models pool the LAST token,
which is always computed.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.core.outputs import ModelRunnerOutput
from llmserve.core.sched_output import SchedulerOutput
from llmserve.pooler_config import PoolerConfig

if TYPE_CHECKING:
    from llmserve.worker.model_runner import ModelRunner


class Pooler:
    """``__call__(hidden [T, H], lens, params, model=None)`` -> one float32 CPU tensor per
    request (``model`` is for the classifier pooler's heads; unused here).

    lens: rows of each request in order; params: each request's PoolingParams
    (``normalize`` None: the config's default; ``dimensions``: keep the first d values
    before normalising, as vLLM)."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def pool(self, hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """[B, H] float32: the pooled rows."""
        ends = np.cumsum(lens)
        kind = self.config.pooling_type
        if kind == "LAST":
            return hidden[torch.from_numpy(ends - 1).to(hidden.device)].float()
        if kind == "CLS":
            return hidden[torch.from_numpy(ends - np.asarray(lens)).to(hidden.device)].float()
        # One mean per prompt: its value depends on that prompt's rows only (batch invariance).
        return torch.stack([h.float().mean(0) for h in hidden[:sum(lens)].split(lens)])

    def __call__(self, hidden: torch.Tensor, lens: list[int], params: list, model: Any = None) -> list[torch.Tensor]:
        pooled = self.pool(hidden, lens)
        out = []
        for i, p in enumerate(params):
            v = pooled[i]
            if p.dimensions is not None:
                v = v[:p.dimensions]
            normalize = self.config.normalize if p.normalize is None else p.normalize
            if normalize:
                v = F.normalize(v, p=2, dim=-1)
            out.append(v.cpu())
        return out


def make_pooler(config: PoolerConfig) -> Any:
    """The runner's pooler: a classification model's ``ClassifierPooler``, else ``Pooler``."""
    if config.task == "classify":
        from llmserve.worker.classifier_pooler import ClassifierPooler
        return ClassifierPooler(config)
    return Pooler(config)


def token_type_ids(reqs: list, lens: list[int]) -> Optional[np.ndarray]:
    """``[T]`` int64 segment of each token (0, or 1 from a text pair's second segment on,
    as ``pooling_params.compressed_token_type_ids`` says), or None when no request is a pair."""
    starts = [getattr(r.pooling_params, "compressed_token_type_ids", None) for r in reqs]
    if all(s is None for s in starts):
        return None
    return np.concatenate([(np.arange(n) >= (n if s is None else s)).astype(np.int64) for s, n in zip(starts, lens)])


def execute_pooling(runner: "ModelRunner", so: SchedulerOutput) -> ModelRunnerOutput:
    """One step of a pooling model: forward every scheduled prompt whole and pool it.
    Causal models run through the runner's paged path (prefix cache and all); encoders
    run the flat prompts with no KV cache."""
    out = ModelRunnerOutput()
    if not so.scheduled:
        return out
    if runner.model_config.is_encoder_only:
        reqs = [s.request for s in so.scheduled]
        lens = [len(r.prompt_token_ids) for r in reqs]
        hidden = _encoder_forward(runner, reqs, lens)
    else:
        inputs = runner._prepare_inputs(so)
        hidden = runner._forward(inputs)
        reqs = [p.req for p in inputs.plan]
        lens = inputs.attn_metadata.query_lens_list
    vectors = runner.pooler(hidden, lens, [r.pooling_params for r in reqs], runner.model)
    for r, v in zip(reqs, vectors):
        out.pooler_output[r.request_id] = v
    return out


def _encoder_forward(runner: "ModelRunner", reqs: list, lens: list[int]) -> torch.Tensor:
    """An encoder's final hidden states ``[T, H]`` of the prompts back to back (no KV
    cache), with each text pair's token types."""
    dev = runner.device
    ids = np.concatenate([np.asarray(r.prompt_token_ids, dtype=np.int64) for r in reqs])
    pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
    types = token_type_ids(reqs, lens)
    types = None if types is None else torch.from_numpy(types).to(dev)
    return runner.model(torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev), None,
                        SimpleNamespace(query_lens_list=lens, token_type_ids=types))
