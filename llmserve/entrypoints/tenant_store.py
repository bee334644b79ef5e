"""The bounded, tenant-scoped in-process store that the Responses store
(``openai/responses/store.py``) and Anthropic's message threads (``anthropic/threads.py``)
share: key -> entry, at most ``max_entries``, the oldest evicted first, each entry seen
only by the tenant that stored it (the current tenant of ``engine/tenant_context.py``;
without API keys everything is the default tenant's), so another tenant's key reads as
an unknown one. Everything runs on the server's event loop, so no lock.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Optional, TypeVar

from llmserve.engine.tenant_context import tenant_fields

E = TypeVar("E")  # an entry: any object with a ``tenant`` attribute (str or None)


def caller_tenant() -> str:
    """The calling request's tenant name, ``"default"`` without one."""
    return tenant_fields()[0] or "default"


class TenantBoundedStore(Generic[E]):
    """Key -> entry, at most ``max_entries`` (an int >= 1; else ValueError naming
    ``bound_name``), the oldest evicted first past the bound."""

    def __init__(self, max_entries: int, bound_name: str = "max_entries") -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"{bound_name} must be an integer >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: "OrderedDict[str, E]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _mine(self, key: str) -> Optional[E]:
        """The caller's entry under ``key``, None when there is none (or another tenant's)."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.tenant == caller_tenant() else None

    def _keep(self, key: str, entry: E) -> None:
        """Keep ``entry`` under ``key`` and evict the oldest entries past the bound."""
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
