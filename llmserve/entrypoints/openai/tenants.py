"""Tenants: who is calling. An API key names a tenant (``--api-key`` several times, or a
keys file, ``--api-keys-file``); the authentication middleware stores the caller's
:class:`Tenant` in ``request.state.tenant`` and everything that scopes data or work by
caller reads it through :func:`tenant_name_of`. Requests without keys configured, or
with a single unnamed ``--api-key``, belong to the one :data:`DEFAULT_TENANT`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_TENANT_NAME = "default"
TENANT_SCOPE_KEY = "tenant"  # the key in the ASGI scope's "state" dict (= request.state.tenant)


@dataclass(frozen=True)
class Tenant:
    """One caller of the server and its limits (from ``--api-keys-file``).

    name: shown in logs and /metrics labels (never the key). weight: its share of the
    engine under fair scheduling (> 0; tokens served are divided by it).
    max_concurrent_requests: requests in flight at once (None: no limit).
    max_tokens_per_second: prompt + max output tokens admitted per second, a token
    bucket of ``burst_tokens`` (default: one second's worth, at least one request).
    allowed_models: served model names it may call (None: all).
    """

    name: str = DEFAULT_TENANT_NAME
    weight: float = 1.0
    max_concurrent_requests: Optional[int] = None
    max_tokens_per_second: Optional[float] = None
    burst_tokens: Optional[int] = None
    allowed_models: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"tenant name must be a non-empty string, got {self.name!r}")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, got {self.weight}")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(f"tenant {self.name!r}: max_concurrent_requests must be >= 1")
        if self.max_tokens_per_second is not None and not self.max_tokens_per_second > 0:
            raise ValueError(f"tenant {self.name!r}: max_tokens_per_second must be > 0")
        if self.burst_tokens is not None and self.burst_tokens < 1:
            raise ValueError(f"tenant {self.name!r}: burst_tokens must be >= 1")


DEFAULT_TENANT = Tenant()


def tenant_of(request: Any) -> Tenant:
    """The :class:`Tenant` of a starlette Request (or an ASGI scope dict):
    :data:`DEFAULT_TENANT` when the server has no keys."""
    scope = request if isinstance(request, dict) else request.scope
    return (scope.get("state") or {}).get(TENANT_SCOPE_KEY) or DEFAULT_TENANT


def tenant_name_of(request: Any) -> str:
    """The tenant name of a starlette Request (or an ASGI scope): use it to scope stored
    records (responses, timelines) so that another tenant sees a 404."""
    return tenant_of(request).name


def set_tenant(scope: dict, tenant: Tenant) -> None:
    """Record the authenticated tenant in the ASGI scope (read back as request.state.tenant)."""
    scope.setdefault("state", {})[TENANT_SCOPE_KEY] = tenant
