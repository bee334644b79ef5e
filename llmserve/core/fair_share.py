"""Weighted fair sharing of the engine between tenants (issue 34), the policy object the
Scheduler asks which waiting request to admit next and which running one to preempt.

Virtual-time weighted fair queueing over tokens: each tenant has a virtual time, the
tokens scheduled for it (prefill chunks and decode tokens both count) divided by its
weight. When a batch slot frees, the waiting request of the tenant with the *smallest*
virtual time goes next (FIFO within a tenant); when KV blocks run out, a running request
of the tenant with the *largest* virtual time (the one furthest over its share) is
preempted first. A tenant that becomes active again after idling starts at the smallest
virtual time of the active tenants (as Linux CFS's ``min_vruntime``): idle time earns no
credit, so a returning tenant cannot starve the others with a burst.

Composes with ``--scheduling-policy priority``: priority first (lower value first, as
vLLM), fairness between tenants within one priority class, then arrival time.
With one active tenant the scheduler's own order is used unchanged (no extra work).

Requests without a tenant (offline ``LLM``, no API keys) share :data:`DEFAULT_TENANT`.
No torch here.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional, Sequence

DEFAULT_TENANT = "default"


def tenant_of(req) -> str:
    """The tenant name of a scheduler Request (``DEFAULT_TENANT`` when it has none)."""
    return getattr(req, "tenant", None) or DEFAULT_TENANT


class FairShare:
    """Per-tenant virtual time (tokens / weight) and the pick / victim rules above.

    ``add`` / ``remove`` track the live requests of each tenant (a tenant with none is
    idle); ``charge`` adds a step's scheduled tokens. ``pick(waiting, priority)`` returns
    the request to admit next; ``victim(running, priority)`` the one to preempt.
    """

    def __init__(self) -> None:
        self.vtime: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.live: Counter[str] = Counter()  # live (waiting or running) requests per tenant
        self.tokens: Counter[str] = Counter()  # tokens scheduled per tenant (for stats and tests)

    def add(self, req) -> None:
        """A request joined the scheduler; an idle tenant restarts at the active minimum."""
        name = tenant_of(req)
        self.weights[name] = float(getattr(req, "tenant_weight", None) or 1.0)
        if self.live[name] == 0:
            active = [self.vtime[t] for t, n in self.live.items() if n > 0 and t != name]
            floor = min(active) if active else 0.0
            self.vtime[name] = max(self.vtime.get(name, 0.0), floor)
        self.live[name] += 1

    def remove(self, req) -> None:
        """A request left the scheduler (finished or aborted)."""
        name = tenant_of(req)
        if self.live[name] > 0:
            self.live[name] -= 1

    def charge(self, scheduled: Iterable[tuple[object, int]]) -> None:
        """Add ``(request, num_tokens)`` of one step to each tenant's virtual time."""
        for req, n in scheduled:
            name = tenant_of(req)
            self.tokens[name] += n
            self.vtime[name] = self.vtime.get(name, 0.0) + n / self.weights.get(name, 1.0)

    def num_active_tenants(self) -> int:
        return sum(1 for n in self.live.values() if n > 0)

    def _key(self, req, priority: bool) -> tuple:
        v = self.vtime.get(tenant_of(req), 0.0)
        return (req.priority, v) if priority else (v,)

    def pick(self, waiting: Sequence, priority: bool) -> Optional[object]:
        """The waiting request to admit next: lowest (priority,) virtual time, then the
        queue's own order (FIFO, preempted requests at the front) within that; None to
        keep the scheduler's own choice (one active tenant)."""
        if self.num_active_tenants() < 2:
            return None
        best, best_key = None, None
        for i, req in enumerate(waiting):
            key = self._key(req, priority) + ((req.arrival_time,) if priority else (i,))
            if best_key is None or key < best_key:
                best, best_key = req, key
        return best

    def victim(self, running: Sequence, priority: bool) -> Optional[object]:
        """The running request to preempt: highest (priority,) virtual time, then the
        latest to join the batch; None to keep the scheduler's choice (one tenant)."""
        if self.num_active_tenants() < 2:
            return None
        best, best_key = None, None
        for i, req in enumerate(running):
            key = self._key(req, priority) + ((req.arrival_time,) if priority else (i,))
            if best_key is None or key >= best_key:
                best, best_key = req, key
        return best
