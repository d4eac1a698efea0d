"""The Your prompt tab's settings as its widgets give them, each group of values that travel together one dataclass
checked into the engine's settings: what the model pass measures (:class:`AuditInputs`) and how the engines are
simulated (:class:`EngineInputs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

from kvscope.app.handlers.common import AppError, number
from kvscope.app.hosting import HostingProfile
from kvscope.engine import REPAIRS, CacheSettings, MeasureSettings, ModelKV, ScanSettings, ServerSize, fleet_grid

AUDIT_REPAIRS = [name for name in REPAIRS if name != "recompute"]  # recompute always runs: the reference
DEFAULTS = MeasureSettings(tuple(AUDIT_REPAIRS))  # the greedy tokens, KL threshold and minimum agreement by default
NO_GRAIN = "none"  # the grain menu's entry for no coarsening
Inputs = TypeVar("Inputs", "AuditInputs", "EngineInputs")


@dataclass(frozen=True)
class AuditInputs:
    """What every audit of the tab is measured and drawn with, as its widgets give it (:meth:`measure` checks it):
    the repairs, greedy tokens, the recommendation's bars, coarsen's grain, and the fidelity figure's axes."""

    repairs: Sequence[str] | None = None
    tokens: int | float | str | None = DEFAULTS.tokens
    threshold: float | str | None = DEFAULTS.threshold
    min_agreement: float | str | None = DEFAULTS.min_agreement
    grain: str | None = None
    x: str = "computed"
    y: str = "kl"

    def measure(self, profile: HostingProfile, requests: int) -> MeasureSettings:
        """The model pass's settings, checked (the profile bounds the requests, the greedy tokens and the context)."""
        tokens = number(self.tokens, "greedy tokens N", DEFAULTS.tokens)
        threshold = number(self.threshold, "KL threshold", DEFAULTS.threshold, float)
        min_agreement = number(self.min_agreement, "minimum agreement", DEFAULTS.min_agreement, float)
        grain = (self.grain or "").strip()
        grain = None if grain in ("", NO_GRAIN) else grain
        profile.check_audit(requests, tokens)
        # checked in its constructor, as the CLI's are (a share outside 0-1, a negative threshold, an unknown grain)
        return MeasureSettings(tuple(self.repairs or ()), tokens, threshold, min_agreement, grain, profile.max_context_tokens)


AUTO_ENGINE = "auto"  # the observed engine where the tab names none: the server the log's answers name, else the default


@dataclass(frozen=True)
class EngineInputs:
    """How the tab simulates the serving engines, as its widgets give it: vLLM's block size and block budget, SGLang's
    token budget, llama.cpp's ``--cache-reuse`` (a budget of 0 or empty: unbounded), the engine the log's observed
    cached counts are compared with, and the replica counts of the fleets (comma-separated; empty: one server).
    :meth:`cache` and :meth:`fleets` check them; the audit and both rewrite measurements read the same ones. A server's
    size (the CLI's server-size flags; 0 or empty: not given) sets each budget left at 0 as that server computes it."""

    block: int | float | str | None = 0  # 0 or empty: the block a vLLM log's counts show, else the default (``ScanSettings.for_log``)
    budget_blocks: int | float | str | None = 0
    budget_tokens: int | float | str | None = 0
    cache_reuse: int | float | str | None = 0
    observed_engine: str = AUTO_ENGINE  # or a serving engine's name (``OBSERVED_ENGINES``)
    replicas: str | None = None
    gpu_gib: int | float | str | None = 0  # --gpu-memory-gib
    gpu_memory_utilization: int | float | str | None = ServerSize.gpu_memory_utilization
    mem_fraction_static: int | float | str | None = 0  # 0: SGLang's assumed default
    cpu_kvcache_gib: int | float | str | None = 0  # --vllm-cpu-kvcache-space
    llama_ctx: int | float | str | None = 0  # --llama-ctx-size
    llama_parallel: int | float | str | None = 0  # --llama-parallel (0: auto)

    def cache(self, model: ModelKV | None = None) -> CacheSettings:
        """The simulated caches' settings, checked (``model``: the loaded model's KV shape, which a server's size needs)."""
        block = number(self.block, "block size", 0) or CacheSettings.block  # a browser sends an empty box as 0
        values = {
            "vLLM block budget": number(self.budget_blocks, "vLLM block budget", 0),
            "SGLang token budget": number(self.budget_tokens, "SGLang token budget", 0),
            "llama.cpp --cache-reuse": number(self.cache_reuse, "llama.cpp --cache-reuse", 0),
        }
        if block < 1:
            raise AppError(f"the block size is at least 1 token, got {block}")
        negative = [name for name, value in values.items() if value < 0]
        if negative:
            raise AppError(f"the {negative[0]} cannot be negative (0: unbounded, or off)")
        blocks, tokens, reuse = values.values()
        return CacheSettings(block, blocks or None, tokens or None, None, reuse, server=self.server(model), model=model)

    def server(self, model: ModelKV | None) -> ServerSize | None:
        """The server's size where the tab gives one (None: none given), checked in its constructor as the CLI's is."""
        sizes = {
            "gpu_gib": number(self.gpu_gib, "GPU memory (GiB)", 0, float),
            "mem_fraction_static": number(self.mem_fraction_static, "SGLang mem_fraction_static", 0, float),
            "cpu_kvcache_gib": number(self.cpu_kvcache_gib, "VLLM_CPU_KVCACHE_SPACE (GiB)", 0, float),
            "context": number(self.llama_ctx, "llama.cpp -c", 0),
            "parallel": number(self.llama_parallel, "llama.cpp -np", 0),
        }
        given = {name: value for name, value in sizes.items() if value}
        if not given:
            return None
        if model is None:
            raise AppError("a server's size needs the model's KV shape: load a model first")
        utilization = number(self.gpu_memory_utilization, "vLLM gpu_memory_utilization", ServerSize.gpu_memory_utilization, float)
        return ServerSize(model, gpu_memory_utilization=utilization, **given)  # a refusal names the CLI's flag, as the labels do

    def scan(self, context_limit: int | None = None, model: ModelKV | None = None) -> ScanSettings:
        """The token pass's settings, built and checked as the CLI builds them (``ScanSettings``): the caches (sized by
        the server where the tab gives one, for ``model``), the observed engine (``AUTO_ENGINE``: the server the log's
        answers name), the fleets and the context limit."""
        named = None if self.observed_engine in (AUTO_ENGINE, None, "") else self.observed_engine
        return ScanSettings(self.cache(model), named, tuple(self.fleets()), context_limit, block_given=self.block_given)

    @property
    def block_given(self) -> bool:
        """Whether the tab names a block size (0 or empty: the log's counts decide, else the default)."""
        return number(self.block, "block size", 0) != 0

    def fleets(self) -> list[tuple[int, str]]:
        """The fleets to simulate (none without replica counts), every router at each (a bad count is refused by name, as
        the CLI refuses it)."""
        return fleet_grid(self.replicas, None) if (self.replicas or "").strip() else []


def taken(kind: type[Inputs], values: Mapping[str, object]) -> Inputs:
    """``kind`` (one of the dataclasses above) from the widget values named by its fields (an event's keyword inputs)."""
    return kind(**{field.name: values[field.name] for field in fields(kind) if field.name in values})
