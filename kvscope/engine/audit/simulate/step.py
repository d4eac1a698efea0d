"""One simulation step, the one place a request (and its reply) goes into every simulated cache: the registry's
serving engines (``registry.Caches``), their reuse were no reply ever cached (read off an engine's own cache where it
``tells_prompts_only``: unbounded vLLM's marked blocks and SGLang's marked edges; else a twin of it fed prompts only),
any fleets (``fleet.Fleet``) and the hosted providers' caches (``registry.Caches(hosted=True)``), each as a
``CacheRequest``. The single-process token pass (``scan.traffic_scan``) and the distributed driver
(``distributed.ray_scan``) both feed a ``Simulation``, request by request in time order.

Servers cache their replies (``replies``): after a request, each engine holds its prompt and the reply tokens the
server computed. Where the log records the reply (``Step.reply``), it goes in with the request. Where it does not,
the next turn of the same session resends it: when a request's tokens start with the previous request's prompt of its
session, the tokens after that prompt up to the first end-of-turn token (``end_ids``: what the model generated last,
and so never computed) are that reply, and every cache that served the previous request now holds it (``reply_from``
counts these). The prompts-only reuse never counts a reply: the reuse of a simulation that ignores them, for logs
without replies.

The hosted providers' caches hold prompts only: neither OpenAI nor Anthropic documents caching a reply before the
next request resends it (and Anthropic caches at ``cache_control`` breakpoints alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.fleet import Fleet
from kvscope.engine.audit.simulate.hosted import HostedRequest
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest
from kvscope.engine.audit.simulate.registry import ENGINES, LABELS, Caches

REPLY_COUNTS = {
    "logged": "the log records the reply",
    "next_turn": "the log records none; the session's next turn resends it",
    "none": "no reply known: the log records none and no later turn of the session resends it",
}


@dataclass(frozen=True)
class Step:
    """One request as every simulated cache takes it: its prompt's token ids, the reply tokens the server computed
    after them (empty: none logged), who sent it, and what its hosted provider's cache reads. ``hashes``: the chained
    block hashes of prompt + reply where a worker computed them (``blocks.block_hashes``)."""

    ids: np.ndarray
    reply: np.ndarray
    request: int
    session: str | None
    logged_reply: bool = False
    hosted: HostedRequest | None = None
    hashes: np.ndarray | None = None

    @property
    def held(self) -> np.ndarray:
        """What a server holds after this request: the prompt and the reply tokens it computed."""
        return self.ids if not len(self.reply) else np.concatenate([self.ids, self.reply])


@dataclass(frozen=True)
class StepResult:
    """What one step gives its row: the earlier request matched (the radix tree's), each engine's reuse with replies
    and with prompts only, and the hosted provider's."""

    matched: int | None
    reused: dict[str, int]
    prompts_only: dict[str, int]
    hosted: dict[str, int]


@dataclass
class _Waiting:
    """The last request of a session whose reply is not logged: its prompt, and the replica each fleet sent it to."""

    request: int
    ids: np.ndarray
    hashes: np.ndarray | None
    replicas: list[int]


@dataclass
class Simulation:
    """Every simulated cache, fed one ``Step`` at a time in time order."""

    settings: CacheSettings
    fleet: Sequence[tuple[int, str]] = ()
    end_ids: Collection[int] = ()
    serving: bool = True  # False: the fleets alone (a fleet simulated apart, on its own Ray actor: ``ray_scan``)
    engines: Caches = field(init=False)
    prompts_only: Caches = field(init=False)
    fleets: list[Fleet] = field(init=False)
    hosted: Caches = field(init=False)
    replies: dict[str, int] = field(init=False)
    reply_from: dict[int, tuple[int, int]] = field(init=False)  # request -> (its session's next turn, the reply tokens it resent)
    time: int = 0

    def __post_init__(self) -> None:
        self.engines = Caches(self.settings)
        # were no reply ever cached: read off the engines' own caches where they tell it, else a twin fed prompts alone
        untold = [name for name, cache in self.engines.caches.items() if not cache.tells_prompts_only]
        self.prompts_only = Caches(self.settings, names=untold)
        self.fleets = [Fleet(replicas, routing, self.settings) for replicas, routing in self.fleet]
        self.hosted = Caches(self.settings, hosted=True)
        self.replies = dict.fromkeys(REPLY_COUNTS, 0)
        self.reply_from = {}
        self._waiting: dict[str | None, _Waiting] = {}
        self._ends = np.asarray(sorted(self.end_ids), dtype=np.int32)

    def step(self, step: Step) -> StepResult:
        """``step``'s request served by every cache (after the reply its session's previous turn resends, if any)."""
        self._resent_reply(step)
        self.time += 1
        request = CacheRequest(step.ids, step.request, step.session, self.time, step.held, step.hashes, step.hosted)
        matched = self.engines.matched(request) if self.serving else None  # the radix tree's (``RadixCache.matched``)
        replicas = [simulated.insert(request) for simulated in self.fleets]
        if step.logged_reply:
            self.replies["logged"] += 1
            self._waiting.pop(step.session, None)
        else:
            self._waiting[step.session] = _Waiting(step.request, step.ids, step.hashes, replicas)
        if not self.serving:
            return StepResult(matched, {}, {}, {})
        told = {name: cache.prompts_only(request) for name, cache in self.engines.caches.items() if cache.tells_prompts_only}
        reused = self.engines.insert(request)
        prompt_hashes = None if step.hashes is None else step.hashes[: len(step.ids) // self.settings.block]
        twin = self.prompts_only.insert(dataclasses.replace(request, held=None, hashes=prompt_hashes))
        prompts_only = {name: told[name] if name in told else twin[name] for name in reused}
        return StepResult(matched, reused, prompts_only, self.hosted.insert(request))

    def held(self) -> dict[str, int]:
        """The tokens each serving engine's cache holds now (with replies; the prompts-only and the fleets' apart)."""
        return {name: cache.held_tokens for name, cache in self.engines.caches.items()}

    def finish(self) -> None:
        """Counts the requests whose reply stayed unknown (no later turn of their session resent it)."""
        self.replies["none"] += len(self._waiting)
        self._waiting.clear()

    def _resent_reply(self, step: Step) -> None:
        waiting = self._waiting.pop(step.session, None)
        if waiting is None:
            return
        end = resent_reply_end(waiting.ids, step.ids, self._ends)
        if end is None:
            self.replies["none"] += 1
            return
        self.replies["next_turn"] += 1
        self.reply_from[waiting.request] = (step.request, end - len(waiting.ids))
        hashes = None if step.hashes is None else step.hashes[: end // self.settings.block]
        held = CacheRequest(step.ids[:end], waiting.request, step.session, self.time, hashes=hashes)
        if self.serving:
            self.engines.hold(held)
        for simulated, replica in zip(self.fleets, waiting.replicas):
            simulated.engines[replica].hold(held)


def replies_sentence(totals: dict) -> str:
    """Where the replies in a log's simulation came from, in words, with each engine's reuse with them and with prompts
    only (``TrafficScan.totals()``; empty for a stored result without replies)."""
    replies, plain = totals.get("replies"), totals.get("prompts_only")
    if not replies or not plain:
        return ""
    count = sum(replies.values())
    ways = [f"{replies['logged']:,} logged", f"{replies['next_turn']:,} read off the next turn", f"{replies['none']:,} unknown"]
    rates = " · ".join(
        f"{LABELS[engine]} {totals['hit_rate'][engine]:.0%} (prompts only {plain['hit_rate'][engine]:.0%})" for engine in ENGINES
    )
    lead = "The log records no replies" if not replies["logged"] else f"Replies of {count:,} requests"
    return f"{lead}: {', '.join(ways)}; servers cache their replies, so reuse with them: {rates}."


def resent_reply_end(previous: np.ndarray, ids: np.ndarray, end_ids: np.ndarray) -> int | None:
    """Where the reply to ``previous`` ends in ``ids``, the next turn that resends it: ``ids`` starts with the whole of
    ``previous``, and the reply runs to the first end-of-turn token after it (not included: the model sampled it last,
    so never computed it). None where ``ids`` does not continue ``previous`` or no end-of-turn token follows."""
    if len(ids) <= len(previous) or not np.array_equal(ids[: len(previous)], previous):
        return None
    after = np.flatnonzero(np.isin(ids[len(previous) :], end_ids))
    if not len(after) or after[0] == 0:
        return None
    return len(previous) + int(after[0])
