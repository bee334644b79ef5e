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
The context is the server's ``--max-model-len`` (``options.num_ctx`` is not a per-request
setting here). ``shift`` (Ollama's context shift during generation) is accepted and has
no effect: an answer stops at the context's end with ``done_reason`` "length"."""
from __future__ import annotations

from typing import Any, Optional

from llmserve.entrypoints.openai.chat_completion.context_room import prompt_bytes_bound, prompt_tokens


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


async def fit_chat(chat: Any, common: Any) -> Any:
    """``common`` (a ChatCompletionRequest) shortened to fit ``chat``'s context as above:
    the same object when it fits (a cheap byte bound first, then the rendered count)."""
    max_len = chat.max_model_len
    if prompt_bytes_bound(common) < max_len or await prompt_tokens(chat, common) < max_len:
        return common
    messages = list(common.messages)
    while (shorter := _drop_oldest(messages)) is not None:
        messages = shorter
        common = common.model_copy(update={"messages": messages})
        if await prompt_tokens(chat, common) < max_len:
            return common
    keep = max(1, max_len // 2)
    budget = max_len - keep if common.max_tokens is None else min(common.max_tokens, max_len - keep)
    return common.model_copy(update={"truncate_prompt_tokens": keep, "max_tokens": budget})


def fit_completion(completion: Any, common: Any, prompt_len: int) -> Any:
    """A raw ``/api/generate`` request (a CompletionRequest) whose prompt of ``prompt_len``
    tokens does not fit: its last half context of tokens, and the rest of the context as
    the budget when none was asked or more was."""
    max_len = completion.max_model_len
    if prompt_len < max_len:
        return common
    keep = max(1, max_len // 2)
    budget = max_len - keep if common.max_tokens is None else min(common.max_tokens, max_len - keep)
    return common.model_copy(update={"truncate_prompt_tokens": keep, "max_tokens": budget})
