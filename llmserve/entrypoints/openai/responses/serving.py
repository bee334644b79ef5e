"""``POST /v1/responses`` (OpenAI's Responses API), not served yet.

The request is checked as far as this server can: an unknown model is a 404, an input
that does not fit the context is a 400 naming the limit and the token counts (the
engine's InputProcessor decides, as for chat), and anything else is a 400 saying the
API is not supported yet. Never a 5xx: the openai clients retry those.
"""
from __future__ import annotations

from typing import Any

from llmserve.entrypoints.openai.common.serving import GenerateBaseServing
from llmserve.entrypoints.openai.responses.protocol import ResponsesRequest
from llmserve.sampling_params import SamplingParams, SamplingParamsError


class OpenAIServingResponses(GenerateBaseServing):
    """Handler of ``/v1/responses`` (checks only, for now)."""

    request_id_prefix = "resp"

    def messages(self, request: ResponsesRequest) -> list[Any]:
        """The request's ``instructions`` and ``input`` as chat messages."""
        if isinstance(request.input, str):
            messages: list[Any] = [{"role": "user", "content": request.input}]
        else:
            messages = [m for m in request.input if isinstance(m, dict) and "role" in m]
        if request.instructions:
            messages = [{"role": "system", "content": request.instructions}] + messages
        return messages

    async def create_responses(self, request: ResponsesRequest) -> None:
        """Always raises: ModelNotFoundError (404), or SamplingParamsError (400) for an
        input that does not fit, else SamplingParamsError (400) "not supported yet"."""
        self._check_model(request)
        max_out = request.max_output_tokens
        if max_out is not None and max_out < 1:
            raise SamplingParamsError(f"max_output_tokens must be at least 1, got {max_out}.", "max_output_tokens")
        try:
            prompt = await self.renderer.render_chat(self.messages(request))
            check = getattr(self.engine_client, "input_processor", None)
            if check is not None:  # the engine's own checks, without running the request
                check.process_inputs(self.new_request_id(), prompt.to_engine_prompt(),
                                     SamplingParams(max_tokens=max_out))
        except SamplingParamsError as e:
            names = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens"}
            raise SamplingParamsError(str(e), names.get(e.param, e.param)) from e
        raise SamplingParamsError("The Responses API (/v1/responses) is not supported by this server yet; "
                                  "use /v1/chat/completions.", "model")
