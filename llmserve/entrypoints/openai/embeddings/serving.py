"""``POST /v1/embeddings`` and ``POST /pooling`` (vLLM's ``OpenAIServingEmbedding`` and
``OpenAIServingPooling``): input -> prompts -> one ``AsyncLLM.encode`` each -> vectors in
input order, as floats or base64, with ``usage.prompt_tokens``. On a classification model
``/pooling`` runs its head (task "classify", or "token_classify" for per-token results).
llama-server's ``POST /embedding`` runs the same path (``create_llama_embedding``)."""
from __future__ import annotations

from typing import Any

import numpy as np

from llmserve.entrypoints.openai.common.pooling import PoolingBaseServing, encode_vector
from llmserve.entrypoints.openai.common.protocol import UsageInfo
from llmserve.entrypoints.openai.embeddings.protocol import (EmbeddingRequest, EmbeddingResponse,
                                                             EmbeddingResponseData, LlamaEmbeddingRequest,
                                                             PoolingRequest, PoolingResponse, PoolingResponseData)
from llmserve.entrypoints.renderer import RenderedPrompt
from llmserve.outputs import PoolingRequestOutput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParamsError
from llmserve.tokenizer import check_texts


class OpenAIServingEmbedding(PoolingBaseServing):
    """Handler of ``/v1/embeddings`` and ``/pooling``. Raises ModelNotFoundError (404),
    SamplingParamsError (400 naming the field: ``model`` for a model that does not pool,
    ``input`` for empty or over-long input, ``dimensions``...)."""

    async def _prompts(self, request: EmbeddingRequest) -> list[RenderedPrompt]:
        if (request.input is None) == (request.messages is None):
            raise SamplingParamsError("Give exactly one of `input` or `messages`.", "input")
        if request.messages is not None:
            check_texts([("messages", request.messages)])  # named at the message, not the rendered prompt
            return [await self.renderer.render_chat(
                request.messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
                check_length=request.truncate_prompt_tokens is None)]
        return await self.render_input(request.input, request.add_special_tokens,
                                       truncate_prompt_tokens=request.truncate_prompt_tokens)

    def _embeds_hidden_states(self) -> bool:
        """True when this model generates and has no pooler of its own (not Whisper): it
        can embed only through :attr:`PoolingParams.hidden_state_embed`."""
        tasks = getattr(self.model_config, "supported_tasks", ())
        return tuple(tasks) == ("generate",)

    async def _run(self, request: EmbeddingRequest, task: str, prefix: str, hidden_state_embed: bool = False,
                   ) -> tuple[str, str, list[PoolingRequestOutput]]:
        hidden = hidden_state_embed and task == "embed" and self._embeds_hidden_states()
        name = self._check_model(request) if hidden else self.check_task(request, task)
        params = self.pooling_params(request, task, request.dimensions)
        params.hidden_state_embed = hidden
        prompts = await self._prompts(request)
        request_id = self.new_request_id(prefix)
        param = "messages" if request.messages is not None else "input"
        return name, request_id, await self.encode_all(prompts, params, request_id, request.priority, param)

    @staticmethod
    def _usage(outs: list[PoolingRequestOutput]) -> UsageInfo:
        n = sum(len(o.prompt_token_ids) for o in outs)
        return UsageInfo(prompt_tokens=n, total_tokens=n)

    async def create_embedding(self, request: EmbeddingRequest, hidden_state_embed: bool = False,
                               ) -> EmbeddingResponse:
        """The embeddings of ``request``. ``hidden_state_embed`` (Ollama's routes, whose
        server embeds with any model): a generating model answers too, with each input's
        last token's final hidden state, L2-normalised (vLLM's ``--convert embed``
        pooling of a causal LM), computed in its own generate steps; otherwise such a
        model is a 400 naming ``model`` (vLLM's rule)."""
        name, rid, outs = await self._run(request, "embed", "embd", hidden_state_embed)
        data = [EmbeddingResponseData(index=i, embedding=encode_vector(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outs)]
        return EmbeddingResponse(id=rid, created=self.now(), model=name, data=data, usage=self._usage(outs))

    def default_pooling_task(self) -> str:
        """``/pooling``'s task when the request names none: "classify" for a
        classification model (vLLM's ``ModelConfig.get_pooling_task`` order), else "encode"."""
        tasks = getattr(self.model_config, "supported_tasks", ())
        return "classify" if "classify" in tasks and "embed" not in tasks else "encode"

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        name, rid, outs = await self._run(request, request.task or self.default_pooling_task(), "pool")
        data = [PoolingResponseData(index=i, data=encode_vector(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outs)]
        return PoolingResponse(id=rid, created=self.now(), model=name, data=data, usage=self._usage(outs))

    async def create_llama_embedding(self, request: LlamaEmbeddingRequest) -> list[dict[str, Any]]:
        """llama-server's ``POST /embedding``: ``[{"index", "embedding": [vector]}]``, one
        item per prompt of ``content`` in its order, each vector the model's pooled one
        normalised by ``embd_normalize``. Raises SamplingParamsError (400): ``model`` on a
        model that does not embed (as ``/v1/embeddings``), ``content`` when it is missing or
        refused (``input`` when that is the one sent: llama-server reads it before
        ``content``), ``normalize`` when given (``embd_normalize`` says it here)."""
        self.check_task(request, "embed")
        name = "input" if request.input is not None else "content"
        value = request.input if request.input is not None else request.content
        if value is None:
            raise SamplingParamsError("content: required (the text, or texts, to embed; or input).", "content")
        if request.normalize is not None:
            raise SamplingParamsError("normalize is not read on /embedding: use embd_normalize "
                                      "(-1 none, 0 max-abs, 1 taxicab, 2 Euclidean, >2 p-norm).", "normalize")
        params = PoolingParams(normalize=False, truncate_prompt_tokens=request.truncate_prompt_tokens, task="embed")
        prompts = await self.render_input(value, request.add_special_tokens, name,
                                          truncate_prompt_tokens=request.truncate_prompt_tokens)
        outs = await self.encode_all(prompts, params, self.new_request_id("embd"), request.priority, name)
        return [{"index": i, "embedding": [_normalized(encode_vector(o.outputs.data, "float"), request.embd_normalize)]}
                for i, o in enumerate(outs)]


def _normalized(vector: list[float], how: int) -> list[float]:
    """``vector`` under llama-server's ``embd_normalize``: -1 (or below) as it is, 0
    scaled so that its largest magnitude is 32760 (the int16 range), 1 over its taxicab
    norm, 2 over its Euclidean norm, p > 2 over its p-norm. A zero vector stays zero."""
    v = np.asarray(vector, dtype=np.float64)
    if how < 0:
        return v.tolist()
    if how == 0:
        top = float(np.abs(v).max()) if v.size else 0.0
        scale = 32760.0 / top if top > 0 else 0.0
    else:
        norm = float(np.sum(np.abs(v) ** how) ** (1.0 / how))
        scale = 1.0 / norm if norm > 0 else 0.0
    return (v * scale).tolist()


__all__ = ["OpenAIServingEmbedding"]
