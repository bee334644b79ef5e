"""The bounded in-process store of ``/v1/responses`` (vLLM's ``response_store`` /
``msg_store``, with a bound).

Each stored response keeps its response object, the chat messages of its whole
conversation (earlier turns, its input, its output: what ``previous_response_id``
prepends) and, for ``background: true``, the task that runs it (``cancel`` aborts it).
At most ``max_entries`` responses are kept (``--responses-store-max-entries``); adding
one more evicts the oldest first. Everything runs on the server's event loop, so no lock.

Ids are made here (:meth:`ResponsesStore.new_response_id`), never from anything a client
sends: a client's ``X-Request-Id`` is echoed and logged, but two requests with the same
header get two distinct responses, and nobody can guess (and so read, continue or
overwrite) another client's stored response.

Tenants (issue 34): each entry belongs to the tenant that stored it (the current tenant
of engine/tenant_context.py, set per HTTP request by the API-key middleware and inherited
by the background task of a ``background: true`` response); every lookup (``get``,
``pop``, ``in``) sees only the calling tenant's entries, so another tenant's id answers
404 exactly as an unknown one. Without API keys everything is the default tenant's.
"""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional

from llmserve.entrypoints.openai.common.errors import NotFoundError
from llmserve.entrypoints.openai.responses.protocol import ResponsesResponse
from llmserve.entrypoints.tenant_store import TenantBoundedStore, caller_tenant


class ResponseNotFoundError(NotFoundError):
    """An unknown (never stored, deleted, evicted or ``store: false``) response id: a 404
    with OpenAI's body naming ``param``."""

    def __init__(self, response_id: str, param: str = "response_id") -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param)


@dataclass
class StoredResponse:
    """One stored response; ``messages``: its conversation as chat messages (set when it
    finishes); ``task``: the background task that runs it (None otherwise);
    ``input_items``: its request's input as listed by ``GET .../input_items``;
    ``events``: the SSE events of a response created with ``stream: true`` (an
    ``EventLog``, replayed by ``GET /v1/responses/{id}?stream=true``; None otherwise)."""

    response: ResponsesResponse
    messages: list[dict[str, Any]] = field(default_factory=list)
    task: Optional[asyncio.Task] = None
    input_items: list[dict[str, Any]] = field(default_factory=list)
    events: Any = None
    tenant: Optional[str] = None  # who stored it (set by ResponsesStore.put)


class ResponsesStore(TenantBoundedStore[StoredResponse]):
    """Response id -> StoredResponse, oldest evicted first past ``max_entries`` (>= 1;
    ``tenant_store.TenantBoundedStore``)."""

    def __init__(self, max_entries: int = 1000) -> None:  # DEFAULT_STORE_MAX_ENTRIES
        super().__init__(max_entries, "responses_store_max_entries")

    def __contains__(self, response_id: object) -> bool:
        return isinstance(response_id, str) and self._mine(response_id) is not None

    def new_response_id(self) -> str:
        """A fresh id, ``resp_`` and 48 hex digits (192 random bits from ``secrets``, as
        long as OpenAI's own ids; vLLM: ``resp_<uuid4>``), not in the store."""
        while True:
            response_id = f"resp_{secrets.token_hex(24)}"
            if response_id not in self._entries:
                return response_id

    def put(self, entry: StoredResponse) -> None:
        """Store (or replace) ``entry`` under its response id, evicting the oldest
        entries beyond the bound (an evicted background task keeps running unstored).
        The entry belongs to the calling tenant; another tenant's entry is never replaced."""
        entry.tenant = entry.tenant or caller_tenant()
        old = self._entries.get(entry.response.id)
        if old is not None and old.tenant != entry.tenant:
            raise ResponseNotFoundError(entry.response.id)
        self._keep(entry.response.id, entry)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The entry; raises ResponseNotFoundError (404, naming ``param``)."""
        entry = self._mine(response_id)
        if entry is None:
            raise ResponseNotFoundError(response_id, param)
        return entry

    def find_item(self, item_id: str) -> Optional[dict[str, Any]]:
        """The caller's stored item with id ``item_id`` as an input item (JSON), newest
        response first: an output item (message, function_call, reasoning) or an input
        item as ``GET .../input_items`` lists it; None when none has it."""
        caller = caller_tenant()
        for entry in reversed(self._entries.values()):
            if entry.tenant != caller:
                continue
            for item in entry.response.output:
                if getattr(item, "id", None) == item_id:
                    return item.model_dump(exclude_none=True)
            for item in entry.input_items:
                if item.get("id") == item_id:
                    return dict(item)
        return None

    def pop(self, response_id: str) -> StoredResponse:
        """Remove and return the entry; raises ResponseNotFoundError (404)."""
        self.get(response_id)  # 404 unless the caller's
        return self._entries.pop(response_id)


DEFAULT_STORE_MAX_ENTRIES = 1000


def add_responses_args(group: Any) -> None:
    """``--responses-store-max-entries`` (the store's bound)."""
    group.add_argument("--responses-store-max-entries", type=int, default=DEFAULT_STORE_MAX_ENTRIES,
                       help="Most /v1/responses responses kept in memory for GET, previous_response_id and "
                            "background runs; the oldest is evicted first.")
    group.add_argument("--responses-unsupported-tools", choices=("drop", "reject"), default="drop",
                       help="What /v1/responses does with tools it cannot run (web_search, image_generation, "
                            "file_search, local_shell, mcp, namespace and custom tools: only function tools reach "
                            "the model): drop them with a warning in the log and the x-llmserve-dropped-tools "
                            "response header naming them (the default: Codex CLI sends web_search and namespace "
                            "tools every turn), or reject the request with a 400 naming them.")


def check_responses_args(args: Any) -> None:
    """Raise ValueError naming the flag for a bound below 1."""
    n = getattr(args, "responses_store_max_entries", DEFAULT_STORE_MAX_ENTRIES)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--responses-store-max-entries must be an integer >= 1, got {n!r}")
