"""A fleet: N serving replicas behind a router, each with its own caches (``registry.Caches``), fed a log in order.

A user's hit rate is the fleet's, not one server's: a request reuses only what its own replica holds. Each routing
policy (``ROUTINGS``) decides the replica from what it has seen so far:

- ``round_robin``: the i-th request of the log (from 0, in the pass's order: time order) goes to replica i mod N.
- ``session``: session affinity. Sessions are numbered in order of first appearance; the k-th (from 0) goes to
  replica k mod N, always. A request without a session key is routed round robin.
- ``prefix``: cache-aware routing. The replica whose radix cache (the SGLang engine's) holds the longest prefix of the
  request's tokens; ties (a cold request included) to the least loaded, then the lowest replica number. SGLang's router
  keeps an approximate tree per replica; here the replica's own cache answers, so this is the ideal it approximates.
- ``least_loaded``: the replica with the least load, ties to the lowest number. A replica's load is the prompt tokens
  it has computed so far: each request's tokens less what its SGLang cache reused. (By requests alone, least loaded
  would be round robin exactly; a log has no durations, so requests in flight cannot be counted.)

Every replica runs every registered serving engine with the audit's settings (a budget is per replica, as each
server has its own memory), so one fleet gives each engine's reuse under the same routing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvscope.engine.audit.report.records import Record, derived
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest
from kvscope.engine.audit.simulate.registry import ENGINES, MATCHING, Caches
from kvscope.engine.errors import KVScopeError

ROUTINGS = {
    "round_robin": "the i-th request to replica i mod N",
    "session": "each session to one replica (sessions in order of first appearance, the k-th to replica k mod N)",
    "prefix": "the replica holding the longest prefix (its radix cache), ties to the least loaded",
    "least_loaded": "the replica that has computed the fewest prompt tokens so far",
}


class FleetError(KVScopeError):
    """A fleet that cannot be simulated: the message names the setting and why."""


@dataclass(frozen=True)
class FleetResult(Record):
    """One fleet's reuse: per engine, the tokens its replicas reused and that share of the log's tokens."""

    replicas: int
    routing: str
    tokens: int
    reused_tokens: dict[str, int]
    hit_rate: dict[str, float] = derived()
    requests_per_replica: tuple[int, ...]

    def __post_init__(self) -> None:
        self.derive(hit_rate=hit_rates(self.reused_tokens, self.tokens))


def hit_rates(reused: dict[str, int], tokens: int) -> dict[str, float]:
    """Each engine's reused tokens as a share of ``tokens`` (0 for none)."""
    return {engine: round(count / tokens, 4) if tokens else 0.0 for engine, count in reused.items()}


class Fleet:
    """N replicas' engines behind one routing policy, fed requests in order (``insert``)."""

    def __init__(self, replicas: int, routing: str, settings: CacheSettings = CacheSettings()):
        if replicas < 1:
            raise FleetError(f"--replicas must be at least 1, got {replicas}")
        if routing not in ROUTINGS:
            raise FleetError(f"--routing {routing!r} is not a policy; expected one of {', '.join(ROUTINGS)}")
        self.routing = routing
        self.engines = [Caches(settings) for _ in range(replicas)]
        self.requests = [0] * replicas
        self.load = [0] * replicas  # prompt tokens computed (tokens less the SGLang engine's reuse)
        self.reused = dict.fromkeys(ENGINES, 0)
        self.tokens = 0
        self._sessions: dict[str, int] = {}  # session -> its replica
        self._time = 0

    def route(self, request: CacheRequest) -> int:
        """The replica the policy sends this request to (nothing is cached yet)."""
        count = len(self.engines)
        if self.routing == "session" and request.session is not None:
            return self._sessions.setdefault(request.session, len(self._sessions) % count)
        if self.routing in ("round_robin", "session"):
            return self._time % count
        if self.routing == "prefix":
            depths = [engines[MATCHING].match(request) for engines in self.engines]
            return min(range(count), key=lambda r: (-depths[r], self.load[r], r))
        return min(range(count), key=lambda r: (self.load[r], r))

    def insert(self, request: CacheRequest) -> int:
        """Route the request and cache it (then ``request.tokens``: it and its reply) on its replica, at the fleet's
        own time (its count of requests); returns the replica."""
        replica = self.route(request)
        self._time += 1
        reused = self.engines[replica].insert(dataclasses.replace(request, time=self._time))
        for engine, count in reused.items():
            self.reused[engine] += count
        self.tokens += len(request.ids)
        self.requests[replica] += 1
        self.load[replica] += len(request.ids) - reused[MATCHING]
        return replica

    def result(self) -> FleetResult:
        return FleetResult(len(self.engines), self.routing, self.tokens, dict(self.reused), tuple(self.requests))


def fleet_grid(replicas: str, routing: str | None) -> list[tuple[int, str]]:
    """The fleets asked for: every routing (comma-separated, default all) at every replica count (comma-separated)."""
    try:
        counts = [int(part) for part in replicas.split(",") if part.strip()]
    except ValueError:
        raise FleetError(f"--replicas takes replica counts separated by commas, e.g. 2,4; got {replicas!r}") from None
    policies = [part.strip() for part in (routing or ",".join(ROUTINGS)).split(",") if part.strip()]
    for name in policies:
        if name not in ROUTINGS:
            raise FleetError(f"--routing {name!r} is not a policy; expected one of {', '.join(ROUTINGS)}")
    for count in counts:
        if count < 1:
            raise FleetError(f"--replicas must be at least 1, got {count}")
    if not counts:
        raise FleetError("--replicas names no replica count")
    return [(count, name) for count in counts for name in policies]
