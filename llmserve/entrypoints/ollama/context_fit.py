"""Ollama's answer to a prompt longer than the context: with ``truncate`` (default true on
``/api/chat`` and ``/api/generate``, Ollama's ``routes.go``) the request still runs on a
shortened prompt and answers 200; ``truncate: false`` makes it an error (here the
engine's 400 "prompt too long", as before).

How it is shortened, as Ollama does:
- ``/api/chat`` drops whole messages from the front (``server/prompt.go``): the system
  messages and the current turn (the last user message and the calls and results after
  it) stay, and messages are dropped until the kept ones start with a user turn, so the
  template never sees a tool result without its call or a conversation that opens with
  the assistant (Ollama's issue #18107 was a 500 from dropping the question of a tool
  round trip);
- what still does not fit, and ``/api/generate``'s prompt, keeps only its last half
  context of tokens (Ollama's runner keeps ``num_ctx / 2`` tokens of an over-long input:
  its issue #17427), so the answer has room; here through vLLM's
  ``truncate_prompt_tokens`` (the last k tokens).
The context is the request's: ``options.num_ctx`` when given, as Ollama's runner is sized
by it, but never more than the server's ``--max-model-len`` (options.py ``context_size``),
else the server's. Past it, ``truncate: false`` is a 400 (:func:`over_context`; the
engine's own past the server's context). ``shift`` (Ollama's context shift during
generation) is accepted and has no effect: an answer stops at the context's end with
``done_reason`` "length"."""
from __future__ import annotations

from typing import Any, Optional

from llmserve.entrypoints.openai.chat_completion.context_room import prompt_bytes_bound, prompt_tokens
from llmserve.sampling_params import SamplingParamsError


def truncating(req: Any) -> bool:
    """Whether ``req`` (an Ollama chat or generate request) lets an over-long prompt be cut."""
    return getattr(req, "truncate", None) is not False


def _droppable(messages: list[Any]) -> Optional[int]:
    """Index of the oldest message that may go: not a system message, and before the
    current turn (the last user message and what follows it: a tool call's results need
    the call, and the call the question)."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    current = users[-1] if users else len(messages) - 1
    for i, m in enumerate(messages[:current]):
        if m.role not in ("system", "developer"):
            return i
    return None


def _drop_oldest(messages: list[Any]) -> Optional[list[Any]]:
    """``messages`` without their oldest droppable turn and the tool results after it,
    then without non-user turns at the front of what is left; None when nothing can go."""
    i = _droppable(messages)
    if i is None:
        return None
    out = messages[:i] + messages[i + 1:]
    while True:
        j = _droppable(out)
        if j is None or out[j].role == "user":
            return out
        out = out[:j] + out[j + 1:]


def over_context(prompt_len: int, context: int) -> SamplingParamsError:
    """The 400 of a prompt of ``prompt_len`` tokens that fills an ``options.num_ctx`` of
    ``context`` tokens under ``truncate: false``: the engine's words for the server's
    context (input_processor.py), naming the option."""
    return SamplingParamsError(
        f"This request's context (options.num_ctx) is {context} tokens. However, your request has {prompt_len} "
        f"input tokens, which leaves no room for output. Please reduce the length of the input, raise "
        f"options.num_ctx or leave truncate on.", "options.num_ctx")


def _keep_last_half(common: Any, context: int) -> Any:
    """``common`` cut to the last ``context // 2`` tokens of its prompt (Ollama's runner),
    its budget the rest of the context, or less when it asked for less."""
    keep = max(1, context // 2)
    budget = context - keep if common.max_tokens is None else min(common.max_tokens, context - keep)
    return common.model_copy(update={"truncate_prompt_tokens": keep, "max_tokens": budget})


async def fit_chat(chat: Any, common: Any, context: int) -> Any:
    """``common`` (a ChatCompletionRequest) shortened to fit ``context`` tokens as above:
    the same object when it fits (a cheap byte bound first, then the rendered count)."""
    if prompt_bytes_bound(common) < context or await prompt_tokens(chat, common) < context:
        return common
    messages = list(common.messages)
    while (shorter := _drop_oldest(messages)) is not None:
        messages = shorter
        common = common.model_copy(update={"messages": messages})
        if await prompt_tokens(chat, common) < context:
            return common
    return _keep_last_half(common, context)


def fit_completion(common: Any, prompt_len: int, context: int) -> Any:
    """A raw ``/api/generate`` request (a CompletionRequest) whose prompt of ``prompt_len``
    tokens does not fit ``context`` tokens: its last half context of tokens, and the rest
    of the context as the budget when none was asked or more was."""
    if prompt_len < context:
        return common
    return _keep_last_half(common, context)
