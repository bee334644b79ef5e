"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``OpenAIServingTokenization``).

``/tokenize`` goes through the same renderer as ``/v1/chat/completions`` (so it reports
the token ids the chat handler would send) and only counts: it does not enforce
``max_model_len`` (it reports it).
"""
from __future__ import annotations

from typing import Any, Sequence, Union

from llmserve.entrypoints.openai.common.serving import BaseServing
from llmserve.entrypoints.openai.logprobs import TokenFormatter
from llmserve.entrypoints.openai.models.serving import OpenAIServingModels
from llmserve.entrypoints.openai.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenPiece,
)
from llmserve.entrypoints.renderer import AsyncRenderer
from llmserve.sampling_params import SamplingParamsError
from llmserve.tokenizer import check_texts


class OpenAIServingTokenization(BaseServing):
    """Tokenizer routes over the server's AsyncRenderer."""

    def __init__(self, engine_client: Any, models: OpenAIServingModels, renderer: AsyncRenderer, *,
                 log_requests: bool = False):
        super().__init__(engine_client, models, log_requests=log_requests)
        self.renderer = renderer
        self.tokenizer = engine_client.tokenizer
        self.vocab_size: int = self.model_config.vocab_size
        self.token_formatter = TokenFormatter(self.tokenizer)

    async def create_tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt, or of messages rendered through the chat template (as
        /v1/chat/completions would send them). Raises ModelNotFoundError / SamplingParamsError."""
        self._check_model(request)
        request.check()
        check_texts([("prompt", request.prompt), ("content", request.content), ("messages", request.messages),
                     ("tools", request.tools)])
        if request.messages is not None:
            rendered = await self.renderer.render_chat(
                request.messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs, tools=request.tools,
                add_special_tokens=bool(request.add_special_tokens))  # default False for messages
            ids = rendered.token_ids
        elif request.content is not None:  # llama-server's request
            ids = await self.renderer.run_in_pool(self._llama_tokenize, request.content, bool(request.add_special),
                                                  request.parse_special)
        else:
            ids = await self.renderer.encode(request.prompt or "",  # default True for a prompt
                                             add_special_tokens=request.add_special_tokens is not False)
        strs = [self.token_formatter.text(t) for t in ids] if request.return_token_strs else None
        tokens = [TokenPiece(id=t, piece=self._piece(t)) for t in ids] if request.with_pieces else ids
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=tokens, token_strs=strs)

    def _llama_tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special, split_special_tokens=not parse_special))

    def _piece(self, token_id: int) -> Union[str, list[int]]:
        """llama-server's piece: the token's text, or its bytes when they are not UTF-8."""
        raw = bytes(self.token_formatter.raw_bytes(token_id))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Text of token ids, special tokens kept. Raises SamplingParamsError for ids
        outside the vocabulary."""
        self._check_model(request)
        # a long id list is checked and decoded in the renderer's pool, off the event loop
        text = await self.renderer.run_in_pool(self._detokenize, request.tokens)
        return DetokenizeResponse(prompt=text, content=text)

    def _detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(self.check_token_ids(ids, "tokens"), skip_special_tokens=False)

    def check_token_ids(self, ids: Sequence[int], param: str) -> list[int]:
        """Raise SamplingParamsError unless every id is an int in [0, vocab_size)."""
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise SamplingParamsError(  # its position, not the value
                    f"{param}[{i}]: the token id is out of vocabulary (valid ids are 0..{self.vocab_size - 1}).",
                    param)
        return list(ids)
