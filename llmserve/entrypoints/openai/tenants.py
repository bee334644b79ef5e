"""Tenants: who is calling. An API key names a tenant (``--api-key`` several times, or a
keys file, ``--api-keys-file``); the authentication middleware stores the caller's
:class:`Tenant` in ``request.state.tenant`` and everything that scopes data or work by
caller reads it through :func:`tenant_name_of`. Requests without keys configured, or
with a single unnamed ``--api-key``, belong to the one :data:`DEFAULT_TENANT`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import signal
import threading
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Optional

from llmserve.served_names import latest_match

logger = logging.getLogger(__name__)

DEFAULT_TENANT_NAME = "default"
TENANT_SCOPE_KEY = "tenant"  # the key in the ASGI scope's "state" dict (= request.state.tenant)
# scope["state"] key of a callable: the tenant's requests in flight (tenant_quotas.py), read by admission
TENANT_IN_FLIGHT_KEY = "llmserve.tenant_in_flight"
# scope["state"] key of a callable taking the global admission's verdict on a request that
# passed its tenant's quotas (tenant_quotas.py): None (admitted) or the refusal's reason
TENANT_OUTCOME_KEY = "llmserve.tenant_outcome"


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
        if not 0 < self.weight < math.inf:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0 and finite, got {self.weight}")
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


def tenant_sees_model(request: Any, name: str) -> bool:
    """Whether the request's tenant may call (and so may see listed) the served model or
    adapter ``name``: its ``allowed_models``, or every model when it has none (issue 34).
    ``name`` and an allowed name that differ only by Ollama's default tag are one model
    (``served_names.latest_match``: /api/tags lists ``m:latest`` for ``m``)."""
    allowed = tenant_of(request).allowed_models
    return allowed is None or latest_match(name, allowed) is not None


def tenant_name_of(request: Any) -> str:
    """The tenant name of a starlette Request (or an ASGI scope): use it to scope stored
    records (responses, timelines) so that another tenant sees a 404."""
    return tenant_of(request).name


def set_tenant(scope: dict, tenant: Tenant) -> None:
    """Record the authenticated tenant in the ASGI scope (read back as request.state.tenant)."""
    scope.setdefault("state", {})[TENANT_SCOPE_KEY] = tenant


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


_ENTRY_FIELDS = {f.name for f in fields(Tenant)} - {"name"}
# Counts: 1.5 requests in flight has no meaning (it was taken as "at most 1").
_INTEGER_FIELDS = ("max_concurrent_requests", "burst_tokens")


def _check_entry_types(kwargs: dict, where: str) -> None:
    """ValueError naming the field for a wrong-typed value: ``allowed_models`` a list of
    strings (a bare string was split into characters and allowed no model), the limits
    numbers (a string failed later as a comparison between str and int)."""
    models = kwargs.get("allowed_models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
        raise ValueError(f"{where}: 'allowed_models' must be a list of model names, got {models!r}")
    for name, value in kwargs.items():
        if name != "allowed_models" and value is not None and (isinstance(value, bool) or
                                                               not isinstance(value, (int, float))):
            raise ValueError(f"{where}: '{name}' must be a number, got {value!r}")
        # Finite first: int(inf) raises OverflowError, int(nan) a message naming no field.
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}: '{name}' must be a finite number, got {value!r}")
        if name in _INTEGER_FIELDS and value is not None and value != int(value):
            raise ValueError(f"{where}: '{name}' must be a whole number, got {value!r}")


def _tenant_from_entry(entry: Any, where: str) -> tuple[str, Tenant]:
    """``(key, Tenant)`` of one keys-file entry; ValueError naming the entry otherwise."""
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not entry["key"]:
        raise ValueError(f"{where}: each entry needs a non-empty string 'key'")
    unknown = set(entry) - _ENTRY_FIELDS - {"key", "tenant"}
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)} (known: key, tenant, {', '.join(sorted(_ENTRY_FIELDS))})")
    kwargs = {k: v for k, v in entry.items() if k in _ENTRY_FIELDS}
    _check_entry_types(kwargs, where)
    if kwargs.get("allowed_models") is not None:
        kwargs["allowed_models"] = tuple(kwargs["allowed_models"])
    for name in _INTEGER_FIELDS:
        if kwargs.get(name) is not None:
            kwargs[name] = int(kwargs[name])
    if "tenant" in entry and not isinstance(entry["tenant"], str):
        raise ValueError(f"{where}: 'tenant' must be a name (a string; leave it out for \"default\"), "
                         f"got {entry['tenant']!r}")
    try:
        return entry["key"], Tenant(name=entry.get("tenant", DEFAULT_TENANT_NAME), **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def load_keys_file(path: str) -> dict[bytes, Tenant]:
    """Parse a keys file: a JSON list of ``{"key", "tenant", "weight",
    "max_concurrent_requests", "max_tokens_per_second", "burst_tokens",
    "allowed_models"}`` objects (only ``key`` is required; ``tenant`` defaults to
    "default"). Several keys may name one tenant, with the same limits; one key may appear
    only once (twice would leave which tenant it names to the order of the file). Returns
    SHA-256 digest of the key -> Tenant. Raises ValueError (naming the file and entry) or
    OSError."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-keys-file {path}: not JSON ({e})") from e
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: cannot be read ({e.strerror or e})") from e
    if not isinstance(entries, list):
        raise ValueError(f"--api-keys-file {path}: expected a JSON list of key entries")
    out: dict[bytes, Tenant] = {}
    by_name: dict[str, Tenant] = {}
    first_entry: dict[bytes, int] = {}
    for i, entry in enumerate(entries):
        key, tenant = _tenant_from_entry(entry, f"--api-keys-file {path} entry {i}")
        if by_name.setdefault(tenant.name, tenant) != tenant:
            raise ValueError(f"--api-keys-file {path} entry {i}: tenant {tenant.name!r} has other limits "
                             f"in an earlier entry; give each tenant's keys the same limits")
        digest = _digest(key)
        if digest in first_entry:
            raise ValueError(f"--api-keys-file {path} entry {i}: the same key as entry {first_entry[digest]}; "
                             f"each key may appear once (it names one tenant)")
        first_entry[digest] = i
        out[digest] = tenant
    return out


def unknown_allowed_models(tenants: Iterable[Tenant], served: Iterable[str]) -> dict[str, list[str]]:
    """Tenant name -> the sorted names in its ``allowed_models`` that call none of ``served``
    (``m:latest`` calls ``m``: served_names.latest_match; tenants whose every allowed name
    is served, or with no list, are left out)."""
    served = list(served)
    out: dict[str, list[str]] = {}
    for tenant in tenants:
        missing = sorted(n for n in set(tenant.allowed_models or ()) if latest_match(n, served) is None)
        if missing:
            out[tenant.name] = missing
    return out


class KeyRing:
    """The API keys and their tenants: the ``--api-key`` keys (the default tenant) and
    the entries of ``--api-keys-file``, re-read by :meth:`reload` (on SIGHUP). A reload
    swaps the whole table at once, so a request sees the old keys or the new ones; a bad
    file keeps the old table (logged). Keys are kept as SHA-256 digests only.

    Once the server knows its models (:meth:`watch_served_models`), the start and every
    reload warn about ``allowed_models`` names it does not serve."""

    def __init__(self, api_keys: Iterable[str] = (), keys_file: Optional[str] = None):
        self.static = {_digest(k): DEFAULT_TENANT for k in api_keys if k}
        self.keys_file = keys_file
        self.table = dict(self.static)
        self.served_models: Optional[Callable[[], Iterable[str]]] = None
        if keys_file:
            self.table.update(load_keys_file(keys_file))  # at start a bad file is an error

    def watch_served_models(self, served_models: Callable[[], Iterable[str]]) -> None:
        """Check the tenants' ``allowed_models`` against ``served_models()`` (the served
        model and LoRA adapter names, read again at each reload) now and after every
        reload. A name not served is only a warning, not an error: like vLLM, the server
        may serve it later (a LoRA adapter loaded by /v1/load_lora_adapter), and until
        then that tenant gets a 404 for it."""
        self.served_models = served_models
        self.warn_unknown_models()

    def warn_unknown_models(self) -> dict[str, list[str]]:
        """Log one warning per tenant whose ``allowed_models`` names a model not served
        now; returns tenant -> those names (empty before :meth:`watch_served_models`)."""
        if self.served_models is None:
            return {}
        served = sorted(set(self.served_models()))
        unknown = unknown_allowed_models(set(self.table.values()), served)
        for name, missing in sorted(unknown.items()):
            logger.warning("%s: tenant %r allows models this server does not serve: %s (served: %s); "
                           "its requests for them get 404 until a model or LoRA adapter of that name is "
                           "loaded", self.keys_file, name, ", ".join(missing), ", ".join(served) or "none")
        return unknown

    def reload(self) -> bool:
        """Re-read the keys file; True when the new table is in use."""
        if not self.keys_file:
            return False
        try:
            table = {**self.static, **load_keys_file(self.keys_file)}
        except (OSError, ValueError) as e:
            logger.error("Keeping the old API keys: reloading %s failed: %s", self.keys_file, e)
            return False
        self.table = table
        logger.info("Reloaded %s: %d keys, tenants %s", self.keys_file, len(table), sorted(self.tenant_names()))
        self.warn_unknown_models()
        return True

    def tenant_names(self) -> set[str]:
        """The tenant names the keys can authenticate as (bounded: a label set)."""
        return {t.name for t in self.table.values()}

    def match(self, given: Iterable[str]) -> Optional[Tenant]:
        """The tenant of the first matching key among ``given``, or None. Constant time
        in which key matched: every candidate is compared with every digest (no early
        exit) with ``hmac.compare_digest``, and digests hide the key lengths."""
        found: Optional[Tenant] = None
        table = self.table  # one snapshot: a reload mid-check changes nothing here
        for candidate in given:
            digest = _digest(candidate)
            for key, tenant in table.items():
                if hmac.compare_digest(digest, key) and found is None:
                    found = tenant
        return found


def make_keyring(args: Any) -> KeyRing:
    """The KeyRing of the serve flags (``--api-key``, ``--api-keys-file``); with a keys
    file, SIGHUP re-reads it (main thread only: signal handlers cannot be set elsewhere)."""
    keys = args.api_key if isinstance(args.api_key, list) else [args.api_key] if args.api_key else []
    ring = KeyRing(keys, getattr(args, "api_keys_file", None))
    if ring.keys_file and threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: ring.reload())
    return ring


def watch_tenant_models(state: Any) -> None:
    """Once ``state`` (the app's) has its served models: let the keys file's ``keyring``
    (``build_app`` puts it on ``state``) warn about allowed models the server does not
    serve, at start and on each reload. The served set is read live: base names plus the
    LoRA adapters loaded at that moment (``--lora-modules`` and /v1/load_lora_adapter).
    No keyring, or no keys file: nothing to check."""
    ring, models = getattr(state, "keyring", None), getattr(state, "openai_serving_models", None)
    if ring is None or not ring.keys_file or models is None:
        return
    ring.watch_served_models(lambda: [*models.model_names, *models.lora_names])
