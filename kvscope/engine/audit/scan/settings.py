"""What the token pass runs with (``ScanSettings``): the simulated engines' settings, the engine the log's observed
counts are compared with, the fleets simulated beside, and the context limit a prompt is cut at. One object, checked
in its constructor, travels whole from the CLI, the app or Ray to every stage of the token pass. Text only: no torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvscope.engine.audit.logs.render import DEFAULT_CONTEXT_LIMIT, context_limit
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.paged_blocks import BLOCK_TOKENS, block_of_counts
from kvscope.engine.audit.simulate.budgets import ModelKV
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.observed import OBSERVED_ENGINES, LogServer, Reported, log_server
from kvscope.engine.audit.simulate.registry import CACHES, budgets


@dataclass(frozen=True)
class ScanSettings:
    """The token pass's settings: ``cache`` (the simulated engines'), ``observed_engine`` (what the log's cached counts
    are compared with), ``fleet`` ((replicas, routing) fleets also simulated, each checked by ``fleet.Fleet``) and
    ``context_limit`` (tokens a prompt is cut at; None: the model's own, ``logs.render.context_limit``) and
    ``block_given`` (whether the user named vLLM's block size: if not, and the cache's is the default, ``for_log`` reads
    it from a vLLM log's counts)."""

    cache: CacheSettings = CacheSettings()
    observed_engine: str | None = None  # None: the server the log's answers name (``observed.log_server``)
    fleet: tuple[tuple[int, str], ...] = ()
    context_limit: int | None = None
    block_given: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fleet", tuple((int(count), routing) for count, routing in self.fleet))
        _check_cache(self.cache)
        if self.observed_engine is not None and self.observed_engine not in OBSERVED_ENGINES:
            engines = ", ".join(OBSERVED_ENGINES)
            raise RequestLogError(f"observed counts are compared with one of {engines}, got {self.observed_engine!r} (--observed-engine)")
        if self.context_limit is not None and self.context_limit < 1:
            raise RequestLogError(f"the context limit is at least 1 token, got {self.context_limit}")

    @property
    def limit(self) -> int:
        """The tokens a prompt is cut at: the context limit, else ``DEFAULT_CONTEXT_LIMIT`` (no model known)."""
        return self.context_limit or DEFAULT_CONTEXT_LIMIT

    def for_log(self, reported: Sequence[Reported]) -> tuple[ScanSettings, LogServer]:
        """These settings decided for a log: the observed engine where not named (the server its answers name, else
        ``DEFAULT_ENGINE``), llama.cpp's mode (the server's own slot choice unless the log pins slots) and, where the
        block size is not given and the engine reports counts in whole blocks (``counts_in_blocks``: vLLM, named or read
        from the answers; an assumed one's counts may be a hosted provider's), the block its counts were served with;
        and why."""
        server = log_server(reported, self.observed_engine)
        cache = self.cache.for_log(pinned=server.pinned > 0)
        if CACHES[server.engine].cache.counts_in_blocks and not server.assumed and not self.block_given and cache.block == BLOCK_TOKENS:
            counts = [item.observed_cached_tokens for item in reported]
            block = block_of_counts(counts)
            if block is not None:
                cache = dataclasses.replace(cache, block=block)
                nonzero = sum(bool(count) for count in counts)
                said = f"block size {block} read from the log's counts: all {nonzero:,} nonzero counts are multiples of {block}"
                server = dataclasses.replace(server, evidence=f"{server.evidence}; {said}")
        return dataclasses.replace(self, cache=cache, observed_engine=server.engine), server

    def for_model(self, lm: Any) -> ScanSettings:
        """These settings with what the model ``lm`` gives where they set none: its context limit (``limited``) and its
        KV shape (``ModelKV.known``: it sizes byte budgets, such as llama.cpp's RAM prompt cache)."""
        settings = self.limited(context_limit(lm))
        if settings.cache.model is not None:
            return settings
        return dataclasses.replace(settings, cache=dataclasses.replace(settings.cache, model=ModelKV.known(lm)))

    def limited(self, limit: int) -> ScanSettings:
        """These settings with the context limit ``limit`` where none is set (the model's, ``logs.render.context_limit``)."""
        return self if self.context_limit is not None else dataclasses.replace(self, context_limit=limit)


def _check_cache(cache: CacheSettings) -> None:
    """The simulated engines' settings, each named where it cannot be simulated."""
    if cache.block < 1:
        raise RequestLogError(f"--block-size is at least 1 token, got {cache.block}")
    bounds = {"--kv-budget-blocks": cache.budget_blocks, "--kv-budget-tokens": cache.budget_tokens, "--slots": cache.slots}
    for flag, value in bounds.items():
        if value is not None and value < 1:
            raise RequestLogError(f"{flag} is at least 1 (leave it out: unbounded), got {value}")
    if cache.cache_reuse < 0:
        raise RequestLogError(f"--cache-reuse is at least 0 (0: off), got {cache.cache_reuse}")
    if cache.prompt_cache and cache.cache_reuse:
        raise RequestLogError("--prompt-cache simulates the server's default slot choice; --cache-reuse is not simulated with it")
    budgets(cache)  # a server's size that leaves an engine no KV is refused here, by name
