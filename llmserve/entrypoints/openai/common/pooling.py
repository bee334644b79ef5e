"""Shared parts of the pooling endpoints (``/v1/embeddings``, ``/pooling``, ``/score``,
``/rerank``): the request fields they have in common, the base handler that turns
``input`` into prompts and runs one ``AsyncLLM.encode`` per prompt, and the vector
encodings (float list or base64 of little-endian float32, as OpenAI and vLLM)."""
from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Optional, Union

import numpy as np
from pydantic import Field, StrictInt, model_validator

from llmserve.engine.pooling_inputs import resolve_truncation
from llmserve.entrypoints.openai.common.limits import MAX_PROMPT_TOKEN_IDS, MAX_PROMPTS_PER_REQUEST
from llmserve.entrypoints.openai.common.protocol import Int64, JSONInt, OpenAIRequestModel, random_uuid
from llmserve.entrypoints.openai.common.serving import BaseServing, aclose_all, first_items
from llmserve.entrypoints.openai.models.lora import lora_call
from llmserve.entrypoints.openai.deadline import (REQUEST_TIMEOUT_HEADER, RequestDeadlineExceeded, current_deadline,
                                                  with_deadline)
from llmserve.entrypoints.openai.request_timelines.labels import add_response_id
from llmserve.entrypoints.renderer import AsyncRenderer, RenderedPrompt
from llmserve.outputs import PoolingRequestOutput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParamsError
from llmserve.tokenizer import check_texts

# What ``input`` may be (OpenAI's embeddings input).
_TokenIds = Annotated[list[JSONInt], Field(max_length=MAX_PROMPT_TOKEN_IDS)]  # JSONInt: [true] is not token 1
PoolingInput = Union[str, Annotated[list[str], Field(max_length=MAX_PROMPTS_PER_REQUEST)], _TokenIds,
                     Annotated[list[_TokenIds], Field(max_length=MAX_PROMPTS_PER_REQUEST)]]

_API_NAMES = {"embed": "Embeddings API", "encode": "Pooling API", "score": "Score API", "rerank": "Rerank API",
              "classify": "Classification API", "token_classify": "Pooling API's token_classify task"}


def _refusal_hint(task: str, tasks: Any, convert: str = "auto") -> str:
    """What would serve ``task`` (the end of check_task's 400); ``convert``: the model
    config's ``--convert``."""
    if task in ("classify", "token_classify"):
        if "embed" in tasks and convert == "embed":  # perhaps a classifier with its head off
            return ("The server runs with `--convert embed`: start it without that flag to use a "
                    "*ForSequenceClassification model's head.")
        return ("Start the server with a *ForSequenceClassification model (`--runner pooling`; "
                "`--convert classify`).")
    if "classify" in tasks and task in ("score", "rerank"):
        return "Scoring pairs with a classification model needs one label (num_labels=1, a cross-encoder)."
    if "classify" in tasks:
        return ("This is a classification model: use /classify or /pooling with task classify or token_classify "
                "(and /score or /rerank when it has one label), or start it with `--convert embed` for embeddings.")
    return "Start the server with a pooling model (or `--runner pooling`)."


class PoolingFields(OpenAIRequestModel):
    """Fields every pooling request takes (vLLM's names): truncate_prompt_tokens (-1:
    max_model_len; text cut as the tokenizer cuts, token ids keep their last k), normalize (None: the model's default),
    add_special_tokens, priority, user."""

    model: Optional[str] = None
    truncate_prompt_tokens: Optional[StrictInt] = Field(default=None, ge=-1)  # true is not 1
    normalize: Optional[bool] = None
    add_special_tokens: bool = True
    priority: Int64 = 0
    user: Optional[str] = None


class ActivationFields(PoolingFields):
    """``use_activation`` (vLLM's field: false gives the head's raw logits), with the
    names vLLM still accepts for it, ``softmax`` and ``activation`` (deprecated there),
    read as ``use_activation`` when it is not given."""

    use_activation: Optional[bool] = None
    softmax: Optional[bool] = Field(default=None, exclude=True)  # declared: read, not "ignored"
    activation: Optional[bool] = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _deprecated_activation_names(self) -> "ActivationFields":
        if self.use_activation is None:
            old = self.softmax if self.softmax is not None else self.activation
            if old is not None:
                self.use_activation = old
        return self


# Texts of one score / rerank request: the prompt count limit of the other pooling routes
# (a 40,000-document rerank held a small one back 15 s).
PoolingTexts = Annotated[list[str], Field(max_length=MAX_PROMPTS_PER_REQUEST)]


def encode_vector(data: Any, encoding_format: str) -> Union[list[float], str]:
    """A pooled vector (float32 tensor) as a list of floats, or as base64 of its
    little-endian float32 bytes (``encoding_format="base64"``)."""
    arr = np.asarray(data.float().numpy() if hasattr(data, "numpy") else data, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(arr.tobytes()).decode("ascii")
    return arr.tolist()


class PoolingBaseServing(BaseServing):
    """Base of the pooling handlers. renderer: the server's AsyncRenderer (tokenizes
    text inputs and renders ``messages`` in its thread pool)."""

    request_id_prefix = "embd"

    def __init__(self, engine_client: Any, models: Any, renderer: AsyncRenderer, *, log_requests: bool = False):
        super().__init__(engine_client, models, log_requests=log_requests)
        self.renderer = renderer

    def check_task(self, request: Any, task: str) -> str:
        """The served model name; raises ModelNotFoundError (404) or a 400 (param
        ``model``) when this model cannot serve the endpoint (a generating model: start
        it with ``--runner pooling``; classify needs a classification model; score and
        rerank an embedding model or a one-label cross-encoder)."""
        name = self._check_model(request)
        tasks = getattr(self.model_config, "supported_tasks", ("generate",))
        needs = ("score", "embed") if task in ("score", "rerank") else (task,)
        if not any(t in tasks for t in needs):
            raise SamplingParamsError(f"This model does not support the {_API_NAMES[task]}: it is served for "
                                      f"{list(tasks)}. {_refusal_hint(task, tasks, getattr(self.model_config, 'convert', 'auto'))}",
                                      "model")
        return name

    def truncation(self, truncate_prompt_tokens: Optional[int]) -> Optional[int]:
        """The token count text inputs are cut to in the renderer (as the tokenizer's
        truncation=True cuts: first tokens and special tokens kept); see
        ``pooling_inputs.resolve_truncation``."""
        return resolve_truncation(truncate_prompt_tokens, self.max_model_len)

    async def render_input(self, value: Any, add_special_tokens: bool, param: str = "input",
                           truncate_prompt_tokens: Optional[int] = None) -> list[RenderedPrompt]:
        """``input`` (a string, strings, token ids or lists of token ids) as prompts, in
        order; with ``truncate_prompt_tokens`` texts are cut in the renderer, keeping
        their first tokens and their special tokens (BERT's [CLS]), and not length-checked. Raises
        SamplingParamsError naming ``param`` for an empty input."""
        if isinstance(value, str):
            items: list = [value]
        elif isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            items = [value]
        else:
            items = list(value)
        if not items:
            raise SamplingParamsError(f"{param} cannot be empty.", param)
        check_texts([(param, value)])  # a lone surrogate named at its item (input.1), not at `input`
        return await self.renderer.render_prompts(items, add_special_tokens=add_special_tokens,
                                                  check_length=truncate_prompt_tokens is None, param=param,
                                                  truncate=self.truncation(truncate_prompt_tokens))

    def pooling_params(self, request: Any, task: str, dimensions: Optional[int] = None) -> PoolingParams:
        return PoolingParams(normalize=request.normalize, dimensions=dimensions,
                             truncate_prompt_tokens=request.truncate_prompt_tokens, task=task,
                             use_activation=getattr(request, "use_activation", None))

    async def encode_all(self, prompts: list[RenderedPrompt], params: PoolingParams, request_id: str,
                         priority: int = 0, param: str = "input") -> list[PoolingRequestOutput]:
        """Pool every prompt (concurrently in the engine); outputs in order. A prompt the
        engine refuses fails the whole request with a 400 naming ``param`` and leaves
        nothing running."""
        if self.log_requests:
            self._log(request_id, prompts, params)
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        for rid in ids:  # GET /v1/requests shows (and finds) them by the response's id
            add_response_id(rid, request_id)
        gens = [lora_call(self.engine_client.encode, p.to_engine_prompt(), params, rid, priority=priority)
                for rid, p in zip(ids, prompts)]
        deadline = current_deadline()
        if deadline is not None:  # X-Request-Timeout: past it, abort and answer 408
            gens = [with_deadline(g, lambda rid=rid: self.engine_client.abort(rid), deadline)
                    for rid, g in zip(ids, gens)]
        try:
            outs = await first_items(gens)
        except SamplingParamsError as e:
            if e.param in ("prompt", "input"):
                raise SamplingParamsError(str(e), param) from e
            raise
        await aclose_all(gens)
        if deadline is not None and any(o is None or o.outputs.data is None for o in outs):
            raise RequestDeadlineExceeded(f"The request did not finish within its {REQUEST_TIMEOUT_HEADER}.")
        return outs  # type: ignore[return-value]

    def _log(self, request_id: str, prompts: list[RenderedPrompt], params: PoolingParams) -> None:
        import logging

        logging.getLogger("llmserve.entrypoints.openai").info(
            "Received request %s: %d prompts, %d tokens, params=%s", request_id, len(prompts),
            sum(len(p.token_ids) for p in prompts), params)

    def new_request_id(self, prefix: Optional[str] = None) -> str:
        return f"{prefix or self.request_id_prefix}-{random_uuid()}"

    @staticmethod
    def now() -> int:
        return int(time.time())
