"""``POST /classify`` (vLLM's ``ServingClassification``): input -> prompts -> one
``AsyncLLM.encode`` each with the ``classify`` task -> class probabilities and the
``id2label`` name of the best class, in input order, with ``usage.prompt_tokens``."""
from __future__ import annotations

from typing import Any, Optional

from llmserve.entrypoints.openai.classify.protocol import (ClassificationData, ClassificationRequest,
                                                           ClassificationResponse)
from llmserve.entrypoints.openai.common.pooling import PoolingBaseServing
from llmserve.entrypoints.openai.common.protocol import UsageInfo
from llmserve.entrypoints.renderer import RenderedPrompt
from llmserve.outputs import PoolingRequestOutput
from llmserve.sampling_params import SamplingParamsError
from llmserve.tokenizer import check_texts


def label_of(id2label: Any, index: int) -> Optional[str]:
    """``id2label[index]`` of the model config (int or str keys), or None when absent."""
    if not id2label:
        return None
    return id2label.get(index, id2label.get(str(index)))


class OpenAIServingClassification(PoolingBaseServing):
    """Handler of ``/classify`` and ``/v1/classify``. Raises ModelNotFoundError (404) or
    SamplingParamsError (400 naming the field: ``model`` for a model without a
    classification head, ``input`` for empty or over-long input)."""

    request_id_prefix = "classify"

    def _data(self, index: int, out: PoolingRequestOutput) -> ClassificationData:
        probs = out.outputs.data.float().tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        labels = getattr(self.model_config.hf_config, "id2label", None)
        return ClassificationData(index=index, label=label_of(labels, best), probs=probs, num_classes=len(probs))

    async def _prompts(self, request: ClassificationRequest) -> list[RenderedPrompt]:
        """The request's prompts: each ``input`` item, or its ``messages`` through the chat
        template (one prompt, as vLLM's chat-form classify request). Raises
        SamplingParamsError naming ``input`` when neither or both are given."""
        if (request.input is None) == (request.messages is None):
            raise SamplingParamsError("Give exactly one of `input` or `messages`.", "input")
        if request.messages is None:
            return await self.render_input(request.input, request.add_special_tokens,
                                           truncate_prompt_tokens=request.truncate_prompt_tokens)
        check_texts([("messages", request.messages)])  # named at the message, not the rendered prompt
        return [await self.renderer.render_chat(
            request.messages, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs, check_length=request.truncate_prompt_tokens is None)]

    async def create_classify(self, request: ClassificationRequest) -> ClassificationResponse:
        name = self.check_task(request, "classify")
        prompts = await self._prompts(request)
        rid = self.new_request_id()
        param = "messages" if request.messages is not None else "input"
        outs = await self.encode_all(prompts, self.pooling_params(request, "classify"), rid, request.priority, param)
        n = sum(len(o.prompt_token_ids) for o in outs)
        return ClassificationResponse(id=rid, created=self.now(), model=name,
                                      data=[self._data(i, o) for i, o in enumerate(outs)],
                                      usage=UsageInfo(prompt_tokens=n, total_tokens=n))


__all__ = ["OpenAIServingClassification", "label_of"]
