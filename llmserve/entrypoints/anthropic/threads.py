"""Anthropic's message threads (beta ``message-threads-2026-08-12``): server-held
conversation state, so that a client sends only each turn's new messages.

A ``/v1/messages`` request with ``thread: {"type": "create"}`` asks the server to keep the
conversation (its ``system``, ``tools``, ``messages`` and the reply) under the reply's
``id``; ``thread: {"type": "continue", "previous_message_id": ID}`` puts that stored
conversation before the request's ``messages`` and takes ``system`` and ``tools`` from it
(a continue that sends either is a 400 naming it: Anthropic's create-only fields), and the
new reply is kept under its own ``id`` in turn. The response's shape is unchanged. The
``anthropic`` SDK's ``client.beta.messages.thread()`` and its tool runner
(``client.beta.messages.tool_runner``, threaded by default) send these; without them the
runner's second request held only a ``tool_result`` and was refused.

An unknown ``previous_message_id`` (never kept, evicted, another tenant's, or kept by
another API-server process) is a 404 whose ``error.details.error_code`` is
``thread_not_found``: the SDK then sends the whole history again under a new thread.
Each kept id can be continued once, as Anthropic's threads are (the SDK's
``ThreadAlreadyContinuedError``: "each response can be continued only once"): a second
continue of an id whose continuation finished is a 400 whose ``error.details.error_code``
is ``thread_already_continued``, and one sent while another continue of the same id is
still being answered is a 400 ``thread_continue_in_flight``; on either the SDK sends the
whole history again under a new thread, as on ``thread_not_found``. (Continuing twice
silently branched the thread.) A continue that fails (an error, a stream cut off) gives
its id back: it may be continued again.

The store is bounded (:data:`DEFAULT_MAX_THREADS` entries, the oldest evicted first),
per API-server process, and each entry is seen only by the tenant that stored it, as
the Responses store (``responses/store.py``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from llmserve.entrypoints.anthropic.protocol import AnthropicMessageParam, AnthropicMessagesRequest
from llmserve.entrypoints.openai.common.errors import NotFoundError
from llmserve.entrypoints.tenant_store import TenantBoundedStore, caller_tenant
from llmserve.sampling_params import SamplingParamsError

DEFAULT_MAX_THREADS = 1000
# The request fields a continue takes from its thread (the SDK's CREATE_ONLY_FIELDS)
CREATE_ONLY_FIELDS = ("system", "tools")


class ThreadAlreadyContinuedError(SamplingParamsError):
    """``thread.previous_message_id`` names a reply that a finished request already
    continued: a 400 with ``code`` ``thread_already_continued`` (Anthropic's
    ``error.details.error_code``; the SDK's ThreadAlreadyContinuedError)."""

    code = "thread_already_continued"

    def __init__(self) -> None:
        super().__init__("thread.previous_message_id: this message was already continued, and each message of a "
                         "thread can be continued only once; continue from the thread's most recent message id, or "
                         "send the whole conversation again with thread {\"type\": \"create\"}.",
                         "thread.previous_message_id")


class ThreadContinueInFlightError(SamplingParamsError):
    """``thread.previous_message_id`` names a reply that another request is continuing
    right now: a 400 with ``code`` ``thread_continue_in_flight`` (the SDK's
    ThreadContinueInFlightError)."""

    code = "thread_continue_in_flight"

    def __init__(self) -> None:
        super().__init__("thread.previous_message_id: another request is still continuing this message; wait for "
                         "its reply and continue from that reply's id, or send the whole conversation again with "
                         "thread {\"type\": \"create\"}.", "thread.previous_message_id")


class ThreadNotFoundError(NotFoundError):
    """``thread.previous_message_id`` names no conversation kept for the caller: a 404 with
    ``code`` ``thread_not_found`` (Anthropic's body carries it as ``error.details.error_code``)."""

    code = "thread_not_found"

    def __init__(self) -> None:
        super().__init__("thread.previous_message_id: no thread is kept under this message id (never created with "
                         "thread {\"type\": \"create\"}, evicted, or kept by another server process); send the whole "
                         "conversation again with thread {\"type\": \"create\"}.", "thread.previous_message_id")


@dataclass
class StoredThread:
    """One kept conversation: the ``system`` and ``tools`` it was created with and every
    message up to and including the reply; ``tenant``: who kept it."""

    system: Any
    tools: Any
    messages: list[AnthropicMessageParam]
    tenant: str = "default"
    # None: may be continued; "in_flight": a request is continuing it; "continued": done
    state: Optional[str] = None


class MessageThreadStore(TenantBoundedStore[StoredThread]):
    """Message id -> StoredThread, at most ``max_entries`` (>= 1), the oldest evicted first
    (``tenant_store.TenantBoundedStore``)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_THREADS) -> None:
        super().__init__(max_entries)

    def get(self, message_id: str) -> StoredThread:
        """The caller's conversation kept under ``message_id``, if it may be continued.
        Raises ThreadNotFoundError (404), ThreadAlreadyContinuedError or
        ThreadContinueInFlightError (400)."""
        entry = self._mine(message_id)
        if entry is None:
            raise ThreadNotFoundError()
        if entry.state == "continued":
            raise ThreadAlreadyContinuedError()
        if entry.state == "in_flight":
            raise ThreadContinueInFlightError()
        return entry

    def claim(self, message_id: str) -> StoredThread:
        """:meth:`get`, then mark the entry as being continued (the event loop runs one
        request at a time between awaits, so two continues cannot both claim it)."""
        entry = self.get(message_id)
        entry.state = "in_flight"
        return entry

    def settle(self, message_id: str, continued: bool) -> None:
        """End a claim: the entry is ``continued`` for good, or (a failed continue) may
        be continued again. No-op for an id no longer kept or not claimed."""
        entry = self._mine(message_id)
        if entry is not None and entry.state == "in_flight":
            entry.state = "continued" if continued else None

    def put(self, message_id: str, entry: StoredThread) -> None:
        """Keep ``entry`` under ``message_id`` (a fresh server-made id) for the caller."""
        entry.tenant = caller_tenant()
        self._keep(message_id, entry)


def thread_kind(thread: Any) -> Optional[str]:
    """``"create"``, ``"continue"`` or None (no ``thread``). Raises SamplingParamsError
    naming ``thread``, ``thread.type`` or ``thread.previous_message_id`` for another shape."""
    if thread is None:
        return None
    if not isinstance(thread, dict):
        raise SamplingParamsError('thread: must be {"type": "create"} or {"type": "continue", '
                                  '"previous_message_id": ...}.', "thread")
    kind = thread.get("type")
    if kind not in ("create", "continue"):
        raise SamplingParamsError("thread.type: must be 'create' or 'continue'.", "thread.type")
    if kind == "continue" and not isinstance(thread.get("previous_message_id"), str):
        raise SamplingParamsError("thread.previous_message_id: a thread of type 'continue' needs the string id of "
                                  "the message it continues.", "thread.previous_message_id")
    return kind


def with_thread_history(request: AnthropicMessagesRequest, store: Optional[MessageThreadStore],
                        claim: bool = False) -> AnthropicMessagesRequest:
    """The request as the model sees it: for a ``continue``, a copy with the kept
    conversation before its ``messages`` and the kept ``system`` and ``tools``; else the
    request itself. ``claim``: mark the continued id as being continued (the request that
    serves it; end the claim with :func:`keep_thread` or :func:`release_thread`). Raises
    SamplingParamsError (a continue that sends ``system`` or ``tools``, a malformed
    ``thread``), ThreadNotFoundError (404), ThreadAlreadyContinuedError or
    ThreadContinueInFlightError (400)."""
    if thread_kind(request.thread) != "continue":
        return request
    for name in CREATE_ONLY_FIELDS:
        if getattr(request, name) is not None:
            raise SamplingParamsError(f"{name}: a request that continues a thread takes `{name}` from the thread; "
                                      f"leave it out (or start a new thread with thread {{\"type\": \"create\"}}).",
                                      name)
    store = store or MessageThreadStore()
    previous = request.thread["previous_message_id"]
    kept = store.claim(previous) if claim else store.get(previous)
    return request.model_copy(update={"messages": [*kept.messages, *request.messages], "system": kept.system,
                                      "tools": kept.tools})


def _reply_param(history: list[AnthropicMessageParam], reply: list[dict[str, Any]]) -> list[AnthropicMessageParam]:
    """``history`` with the reply's blocks as the assistant's turn: appended to a final
    assistant message (a prefill the reply continued), else a new message. An empty
    reply adds nothing (an empty assistant turn would be refused on the next turn)."""
    if not reply:
        return list(history)
    last = history[-1] if history else None
    if last is not None and last.role == "assistant":
        before = [{"type": "text", "text": last.content}] if isinstance(last.content, str) else list(last.content)
        if before and before[-1].get("type") == "text" and reply[0].get("type") == "text":
            joined = {"type": "text", "text": before[-1].get("text", "") + reply[0]["text"]}
            return [*history[:-1], AnthropicMessageParam(role="assistant", content=[*before[:-1], joined, *reply[1:]])]
        return [*history[:-1], AnthropicMessageParam(role="assistant", content=[*before, *reply])]
    return [*history, AnthropicMessageParam(role="assistant", content=list(reply))]


def keep_thread(store: Optional[MessageThreadStore], sent: AnthropicMessagesRequest,
                seen: AnthropicMessagesRequest, message_id: str, reply: list[dict[str, Any]]) -> None:
    """Keep the conversation under ``message_id`` when ``sent`` (the client's request)
    has a ``thread``; ``seen``: the request with its thread history
    (:func:`with_thread_history`); ``reply``: the answer's content blocks as JSON."""
    if store is None or thread_kind(sent.thread) is None:
        return
    store.put(message_id, StoredThread(system=seen.system, tools=seen.tools,
                                       messages=_reply_param(list(seen.messages), reply)))
    if thread_kind(sent.thread) == "continue":
        store.settle(sent.thread["previous_message_id"], continued=True)


def release_thread(store: Optional[MessageThreadStore], sent: AnthropicMessagesRequest) -> None:
    """Give back the id a continue claimed when its request ended without a kept reply
    (an error, a cut stream): it may be continued again. No-op once :func:`keep_thread`
    kept the reply, and for a request without a continue."""
    if store is not None and thread_kind(sent.thread) == "continue":
        store.settle(sent.thread["previous_message_id"], continued=False)


def streamed_blocks(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a stream sent (``tool_use`` blocks with their ``input`` still
    the JSON text of their deltas, under ``partial_json``) as the message's blocks; a
    tool input that is not a JSON object stays as text, as the non-streamed message shows it."""
    out = []
    for block in blocks:
        if block.get("type") != "tool_use":
            out.append(block)
            continue
        text = block.get("partial_json", "")
        try:
            args = json.loads(text or "{}")
        except ValueError:
            args = None
        if isinstance(args, dict):
            out.append({"type": "tool_use", "id": block["id"], "name": block["name"], "input": args})
        elif text:
            out.append({"type": "text", "text": text})
    return out
