"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``OpenAIServingTokenization``),
plus the input checks of the endpoints that are not served yet (``/v1/responses``,
``/v1/embeddings``), so those answer with the right 404/400 instead of a bare error.

``/tokenize`` only counts: it does not enforce ``max_model_len`` (it reports it).
"""
from __future__ import annotations

from typing import Any, Optional

from llmserve.entrypoints.openai.chat_utils import render_chat_prompt
from llmserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from llmserve.entrypoints.openai.serving_engine import OpenAIServing
from llmserve.entrypoints.openai.serving_models import OpenAIServingModels
from llmserve.sampling_params import SamplingParamsError
from llmserve.tokenizer import resolve_chat_template


class OpenAIServingTokenization(OpenAIServing):
    """Tokenizer routes. chat_template: the server's ``--chat-template`` (None: the model's)."""

    def __init__(self, engine_client: Any, models: OpenAIServingModels, *,
                 chat_template: Optional[str] = None, log_requests: bool = False):
        super().__init__(engine_client, models, log_requests=log_requests)
        self.chat_template = resolve_chat_template(chat_template)

    def render_messages(self, messages: Any, *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template: Optional[str] = None,
                        chat_template_kwargs: Optional[dict[str, Any]] = None) -> str:
        template = resolve_chat_template(chat_template) if chat_template else self.chat_template
        return render_chat_prompt(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, chat_template=template,
                                  chat_template_kwargs=chat_template_kwargs)

    async def create_tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt, or of messages rendered through the chat template (as
        /v1/chat/completions would send them). Raises ModelNotFoundError / SamplingParamsError."""
        self.models.resolve(request.model)
        request.check()
        if request.messages is not None:
            text = self.render_messages(
                request.messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs)
            add_special = bool(request.add_special_tokens)  # default False for messages
            param = "messages"
        else:
            text = request.prompt or ""
            add_special = request.add_special_tokens is not False  # default True for a prompt
            param = "prompt"
        ids = self.tokenize(text, add_special, param)
        strs = [self.token_formatter.text(t) for t in ids] if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Text of token ids, special tokens kept. Raises SamplingParamsError for ids
        outside the vocabulary."""
        self.models.resolve(request.model)
        ids = self.check_token_ids(request.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(ids, skip_special_tokens=False))

    # ---- endpoints not served yet ----------------------------------------------------
    async def check_responses(self, request: ResponsesRequest) -> None:
        """``/v1/responses``: 404 for an unknown model, 400 naming the context limit for
        an input that does not fit, else 501 (not implemented yet)."""
        self.models.resolve(request.model)
        if isinstance(request.input, str):
            messages: list[Any] = [{"role": "user", "content": request.input}]
        else:
            messages = [m for m in request.input if isinstance(m, dict) and "role" in m]
        if request.instructions:
            messages = [{"role": "system", "content": request.instructions}] + messages
        ids = self.tokenize(self.render_messages(messages), False, "input")
        max_out = request.max_output_tokens
        if max_out is not None and max_out < 1:
            raise SamplingParamsError(f"max_output_tokens must be at least 1, got {max_out}.", "max_output_tokens")
        self.resolve_max_tokens(len(ids), max_out, None, "input", "max_output_tokens")
        raise NotImplementedError("The Responses API (/v1/responses) is not supported by this server yet; "
                                  "use /v1/chat/completions.")

    async def check_embeddings(self, request: EmbeddingRequest) -> None:
        """``/v1/embeddings`` on a generative model: 404 for an unknown model, else 400."""
        self.models.resolve(request.model)
        raise SamplingParamsError(
            "This model does not support the Embeddings API: it is served for text generation "
            "(start the server with an embedding model).", "model")
