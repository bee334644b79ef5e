"""The tenant of the request being served, as a context variable, so that every route's
``AsyncLLM.generate`` call carries its caller's tenant to the engine's fair share
without each handler passing it (the server's authentication middleware sets it for the
whole HTTP request; asyncio tasks and generators started inside inherit it).

A tenant here is anything with ``.name`` (str) and ``.weight`` (float > 0), or a plain
name (weight 1): the engine layer does not import the server's Tenant class.
"""
from __future__ import annotations

import contextvars
from typing import Any, Optional

_TENANT: contextvars.ContextVar[Any] = contextvars.ContextVar("llmserve_tenant", default=None)


def set_current_tenant(tenant: Any) -> contextvars.Token:
    """Make ``tenant`` the current one; returns the token for :func:`reset_current_tenant`."""
    return _TENANT.set(tenant)


def reset_current_tenant(token: contextvars.Token) -> None:
    """Undo :func:`set_current_tenant`."""
    _TENANT.reset(token)


def tenant_fields(tenant: Any = None) -> tuple[Optional[str], float]:
    """``(name, weight)`` of ``tenant`` (an object with .name/.weight or a name), or of
    the current tenant when ``tenant`` is None; ``(None, 1.0)`` without one."""
    if tenant is None:
        tenant = _TENANT.get()
    if tenant is None:
        return None, 1.0
    if isinstance(tenant, str):
        return tenant, 1.0
    return tenant.name, float(getattr(tenant, "weight", 1.0) or 1.0)
