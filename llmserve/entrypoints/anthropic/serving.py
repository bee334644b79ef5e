"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API) over
the chat path (``OpenAIServingChat.create_chat_completion(wire=False)``): the request is
mapped to the common chat request (``conversion.py``), the chat path's objects to
Anthropic's message or stream events (``streaming.py``). vLLM's equivalent is
``entrypoints/anthropic/serving_messages.py``.

``max_tokens`` above the room the prompt leaves in the context is clamped to that room
(llama.cpp's rule: Claude Code asks for 32000 tokens whatever the model), not a 400; an
answer cut there stops with ``model_context_window_exceeded`` (Anthropic's reason). The
prompt is counted only when it might not fit (``context_room.py``). Message threads
(``thread``) are kept in ``threads.py``'s store; a ``compaction`` request answers with the
conversation's summary (``compaction.py``).
"""
from __future__ import annotations

import json
import logging
from typing import Any, AsyncGenerator, Callable, Optional, Union

from llmserve.entrypoints.anthropic.accepted_fields import cache_breakpoint_ttls
from llmserve.entrypoints.anthropic.compaction import (STOP_REASON, compaction_block, compaction_events,
                                                       summary_prompt, summary_request)
from llmserve.entrypoints.anthropic.conversion import to_chat_request
from llmserve.entrypoints.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
    CompactionBlock,
    ContentBlock,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from llmserve.entrypoints.anthropic.streaming import (CacheWrites, MessageStreamWriter, message_events,
                                                      stop_reason_of, tool_use_id, usage_of)
from llmserve.entrypoints.anthropic.threads import (MessageThreadStore, keep_thread, release_thread,
                                                    streamed_blocks, with_thread_history)
from llmserve.entrypoints.openai.common.errors import check_finished_normally
from llmserve.entrypoints.openai.chat_completion.context_room import prompt_tokens, room_left
from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
from llmserve.entrypoints.openai.common.protocol import random_uuid
from llmserve.sampling_params import SamplingParamsError

logger = logging.getLogger("llmserve.entrypoints.anthropic")

def _handler(chat: Any, request: ChatCompletionRequest) -> Any:
    """The chat handler that serves ``request`` (one model's, with --extra-model)."""
    pick = getattr(chat, "handler_for", None)
    return pick(request) if callable(pick) else chat


def prompt_too_long(prompt_tokens: int, max_model_len: int) -> SamplingParamsError:
    """The 400 for a prompt that leaves no token of the context for the answer, in
    Anthropic's words (``prompt is too long: N tokens > M maximum``; M: the most a prompt
    may hold here, ``max_model_len - 1``). Claude Code matches that text
    (``/prompt is too long[^0-9]*(\\d+)\\s*tokens?\\s*>\\s*(\\d+)/i`` in 2.1.197) to show
    "Prompt is too long" with the sizes; the engine's OpenAI wording was shown as a bare
    "API Error: 400". No ``param``: Anthropic's message names none."""
    return SamplingParamsError(
        f"prompt is too long: {prompt_tokens} tokens > {max_model_len - 1} maximum (the model's context is "
        f"{max_model_len} tokens, one of them for the answer; system prompt, tools and messages must fit in the "
        "rest: shorten them, or serve the model with a larger --max-model-len).", None)


class AnthropicServingMessages:
    """Handler of the Messages API routes; ``chat``: the server's chat handler
    (``app.state.openai_serving_chat``, a per-model router with --extra-model);
    ``threads``: the kept message threads (``threads.py``; None: a continue finds none)."""

    def __init__(self, chat: Any, threads: Optional[MessageThreadStore] = None) -> None:
        self.chat = chat
        self.threads = threads

    def _auto_tools(self, request: ChatCompletionRequest) -> bool:
        handler = _handler(self.chat, request)
        return bool(handler.enable_auto_tools and handler.tool_parser_cls is not None)

    def _chat_request(self, request: Any, max_tokens: Optional[int] = None) -> ChatCompletionRequest:
        probe = to_chat_request(request, auto_tools=False, max_tokens=max_tokens)  # routing needs only `model`
        if request.tools and request.tool_choice is None and self._auto_tools(probe):
            return to_chat_request(request, auto_tools=True, max_tokens=max_tokens)
        return probe

    async def _clamped(self, request: AnthropicMessagesRequest) -> tuple[ChatCompletionRequest, bool]:
        """The chat request with ``max_tokens`` clamped to the room the prompt leaves,
        and whether it was clamped. Raises SamplingParamsError (a 400) in Anthropic's
        words when the prompt leaves no room at all (:func:`prompt_too_long`)."""
        chat_request = self._chat_request(request)
        handler = _handler(self.chat, chat_request)
        room = await room_left(handler, chat_request, request.max_tokens)
        if room < 1:
            raise prompt_too_long(await prompt_tokens(handler, chat_request), handler.max_model_len)
        if request.max_tokens <= room:
            return chat_request, False
        return self._chat_request(request, max_tokens=room), True

    async def create_message(self, request: AnthropicMessagesRequest, request_id: Optional[str] = None,
                             ) -> Union[AnthropicMessagesResponse, AsyncGenerator[str, None]]:
        """Serve one messages request: the message, or (``stream``) an async generator
        of SSE events. Errors before the stream starts are raised (SamplingParamsError
        naming the field, ModelNotFoundError, EngineDeadError; ThreadNotFoundError for
        an unknown ``thread.previous_message_id``, ThreadAlreadyContinuedError /
        ThreadContinueInFlightError for one already continued or being continued), as the
        chat path raises them. With ``thread``, the conversation is kept under the
        message's id (``threads.py``); a continue holds its id until the reply is kept,
        and gives it back when the request fails or the stream ends without one."""
        seen = with_thread_history(request, self.threads, claim=True)
        try:
            served = await self._serve(request, seen, request_id)
        except BaseException:
            release_thread(self.threads, request)
            raise
        if isinstance(served, AnthropicMessagesResponse):
            return served
        return _released(served, lambda: release_thread(self.threads, request))

    async def _serve(self, request: AnthropicMessagesRequest, seen: AnthropicMessagesRequest,
                     request_id: Optional[str]) -> Union[AnthropicMessagesResponse, AsyncGenerator[str, None]]:
        """:meth:`create_message` once the thread's history is in ``seen``."""
        prompt = summary_prompt(request.compaction)
        if prompt is not None:
            return await self._compact(request, seen, prompt, request_id)
        chat_request, clamped = await self._clamped(seen)
        writes = cache_writes(_handler(self.chat, chat_request), seen)
        result = await self.chat.create_chat_completion(chat_request, request_id, wire=False)
        message_id = f"msg_{random_uuid()}"

        def keep(blocks: list[dict[str, Any]]) -> None:
            keep_thread(self.threads, request, seen, message_id, blocks)

        if chat_request.stream:
            writer = MessageStreamWriter(message_id, request.model, request.stop_sequences, clamped,
                                         on_finish=lambda blocks: keep(streamed_blocks(blocks)), writes=writes)
            return message_events(result, writer)
        message = message_of(result, message_id, seen, clamped, writes)
        keep([block.model_dump() for block in message.content])
        return message

    async def _compact(self, request: AnthropicMessagesRequest, seen: AnthropicMessagesRequest, prompt: str,
                       request_id: Optional[str]) -> Union[AnthropicMessagesResponse, AsyncGenerator[str, None]]:
        """A compaction request (``compaction.py``): the summary of ``seen`` (the
        conversation with its thread's history) as the one ``compaction`` block, streamed
        when asked; with ``thread``, the summary alone is kept as the conversation."""
        chat_request, _ = await self._clamped(summary_request(seen, prompt))
        response = await self.chat.create_chat_completion(chat_request, request_id, wire=False)
        choice = response.choices[0]
        check_finished_normally(choice.finish_reason, response.usage.completion_tokens if response.usage else None)
        block = compaction_block(choice.message.content)
        message = AnthropicMessagesResponse(model=request.model, content=[CompactionBlock(**block)],
                                            stop_reason=STOP_REASON, usage=usage_of(response.usage))
        keep_thread(self.threads, request, seen.model_copy(update={"messages": []}), message.id, [block])
        return compaction_events(message) if request.stream else message

    async def count_tokens(self, request: AnthropicCountTokensRequest) -> AnthropicCountTokensResponse:
        """``input_tokens``: the prompt's tokens as ``/v1/messages`` would render it."""
        chat_request = self._chat_request(request)
        chat_request.check()  # tools and tool_choice, as the messages request checks them
        return AnthropicCountTokensResponse(input_tokens=await prompt_tokens(_handler(self.chat, chat_request), chat_request))


def cache_writes(handler: Any, request: AnthropicMessagesRequest) -> Optional[CacheWrites]:
    """The cache writes ``request`` is told about (``streaming.usage_of``): when it has a
    ``cache_control`` breakpoint and the serving engine's prefix cache is on (its
    ``cache_config``), else None."""
    ttls = cache_breakpoint_ttls(request)
    cache = getattr(getattr(getattr(handler, "engine_client", None), "vllm_config", None), "cache_config", None)
    if not ttls or cache is None or not getattr(cache, "enable_prefix_caching", False):
        return None
    return CacheWrites(block_size=cache.block_size, ttl=ttls[-1])


async def _released(events: AsyncGenerator[str, None], release: Callable[[], None]) -> AsyncGenerator[str, None]:
    """``events``, then ``release()`` however the stream ends (a thread's claim given
    back when no reply was kept: an error event, a client gone)."""
    try:
        async for event in events:
            yield event
    finally:
        release()
        await events.aclose()


def _tool_block(call: Any) -> ContentBlock:
    """A tool call as a tool_use block (arguments that are not a JSON object, e.g. cut
    by max_tokens, stay visible as text)."""
    try:
        args = json.loads(call.function.arguments or "{}")
    except ValueError:
        args = None
    if not isinstance(args, dict):
        return TextBlock(text=call.function.arguments)
    return ToolUseBlock(id=tool_use_id(call.id), name=call.function.name, input=args)


def message_of(response: ChatCompletionResponse, message_id: str, request: AnthropicMessagesRequest,
               clamped: bool = False, writes: Optional[CacheWrites] = None) -> AnthropicMessagesResponse:
    """The Anthropic message of the chat path's response (its first and only choice);
    clamped: ``max_tokens`` was clamped to the context; writes: the request's cache
    writes (``streaming.usage_of``). Raises RequestAbortedError (a 500,
    Anthropic's api_error) when the generation was cut off (finish reason "abort")."""
    choice = response.choices[0]
    check_finished_normally(choice.finish_reason, response.usage.completion_tokens if response.usage else None)
    message = choice.message
    content: list[ContentBlock] = []
    if message.reasoning:
        content.append(ThinkingBlock(thinking=message.reasoning))
    if message.content:
        content.append(TextBlock(text=message.content))
    content += [_tool_block(call) for call in message.tool_calls]
    called = any(isinstance(b, ToolUseBlock) for b in content)
    reason, sequence = stop_reason_of(choice.finish_reason, choice.stop_reason, request.stop_sequences, called,
                                      clamped)
    return AnthropicMessagesResponse(id=message_id, model=request.model, content=content, stop_reason=reason,
                                     stop_sequence=sequence, usage=usage_of(response.usage, writes))
