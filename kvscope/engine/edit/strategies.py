"""Edit strategies: repairing a prefilled cache after a field changes old → new, as a registry of small units.

| strategy | what it does to the stale cache | cost | failure mode |
|---|---|---|---|
| ``stale`` | nothing (baseline) | 0 | reads the old notes |
| ``field_only`` | recompute the field's K/V with the new value | |field| tokens | later notes still say "old": recovery ≈ 0 |
| ``field_only_cot`` | field-only, then a short greedy chain of thought before answering | |field| + chain | needs decoding; the chain re-reads the field |
| ``field_topk`` | field + the top-K downstream tokens (ranked by causal effect or K/V deviation) | |field| + K | K is model-dependent |
| ``erratum`` | append ``[STATE UPDATE] field -> new; ...`` after the context | |erratum| | can revert when the field is buried early |
| ``field_erratum`` | field-only plus the erratum (robust default) | |field| + |erratum| | — |
| ``restate`` | append ``field: new`` after the context (the old value stays where it was) | |restatement| | the old value is still read |
| ``full_downstream`` | recompute the field and everything after it | context − prefix | O(L) recompute |
| ``oracle`` | clean prefill with the new value (reference) | whole context | — |
| ``auto`` | cheapest of field_only / erratum / restate / field_erratum agreeing with field_erratum | varies | — |

In-place strategies need the new value to have the old value's token count; otherwise they report
"not applicable" and why (use ``erratum``, ``field_erratum`` via errata, or ``full_downstream``).
Recovery = (s − s_stale) / (s_oracle − s_stale) on the decision margin; chain-of-thought variants are
compared with stale and oracle under the same chain-of-thought protocol.

Each strategy is a :class:`Strategy`: a name, a one-line summary and either ``build(experiment) → (notebook,
tokens computed, detail)`` — a cache read later, fused with the others — or ``run(experiment) →
StrategyResult`` for those that decode on their own (``field_only_cot``, ``auto``). The CLI, the app and
``auto`` read :data:`REGISTRY`; :func:`check_names` is the one validation of strategy names. The experiment
that runs them (stale and oracle runs, positions, rankings) is :class:`kvscope.engine.edit.experiment.EditExperiment`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvscope.engine.cache.decision import RECOVERY_MIN_GAP, Decision, Recovery, recovery
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.erratum import DEFAULT_ERRATUM, erratum_text
from kvscope.engine.edit.runs import ScenarioRun
from kvscope.engine.errors import KVScopeError
from kvscope.engine.scenario import RenderedPrompt
from kvscope.engine.timing import Stopwatch

AUTO_CANDIDATES = ("field_only", "erratum", "restate", "field_erratum")
RANKINGS = ("causal", "deviation")
RANKING_LABELS = {"causal": "causal (attribution patching)", "deviation": "deviation (CacheBlend-style)"}


class StrategyError(KVScopeError):
    """An unknown strategy or ranking, or strategy settings out of range."""


class NotApplicable(Exception):
    """A strategy that cannot apply to this edit; the message says why (reported, never raised to users)."""


@dataclass(frozen=True)
class EditSettings:
    """Knobs of the strategies; the defaults follow the paper."""

    erratum: str = DEFAULT_ERRATUM
    restate: str = "{field}: {new}"
    top_k: int = 8
    ranking: str = "causal"
    cot_tokens: int = 24
    cot_prefix: str = "Let me check the current {field} against the policy."
    cot_answer_prefix: str = "\nSo the answer is:"
    min_gap: float = RECOVERY_MIN_GAP

    def __post_init__(self) -> None:
        check_ranking(self.ranking)
        if self.top_k < 1 or self.cot_tokens < 0:
            raise StrategyError("top_k must be ≥ 1 and cot_tokens ≥ 0")


def check_ranking(ranking: str) -> str:
    """``ranking`` if it is one of :data:`RANKINGS`, else a :class:`StrategyError`."""
    if ranking not in RANKINGS:
        raise StrategyError(f"unknown ranking {ranking!r}; choose one of {', '.join(RANKINGS)}")
    return ranking


@dataclass
class StrategyResult:
    """One strategy's outcome with its evidence."""

    name: str
    applicable: bool
    decision: Decision | None = None
    recovery: Recovery | None = None
    tokens_recomputed: int = 0
    ms: float = 0.0
    reason: str | None = None
    detail: dict = field(default_factory=dict)
    notebook: Notebook | None = field(default=None, repr=False)

    @property
    def ms_is_share(self) -> bool:
        """Whether ``ms`` is a share of one fused forward rather than this strategy's own wall time."""
        return "timing" in self.detail

    def as_dict(self) -> dict:
        """The CLI's per-strategy JSON."""
        decision = self.decision.as_dict() if self.decision else {}
        return {
            "applicable": self.applicable,
            "reason": self.reason,
            "scores": decision.get("scores"),
            "margin": decision.get("margin"),
            "decision": decision.get("decision"),
            "recovery": None if self.recovery is None else self.recovery.as_dict()["recovery"],
            "recovery_note": None if self.recovery is None else self.recovery.reason,
            "tokens_recomputed": self.tokens_recomputed,
            "ms": round(self.ms, 1),
            **({"detail": self.detail} if self.detail else {}),
        }


Built = tuple[Notebook, int, dict]  # the cache to read, tokens computed for it, detail for the result


@dataclass(frozen=True)
class Strategy:
    """A named edit strategy: ``build`` makes a cache to read (fusable), or ``run`` does its own reads."""

    name: str
    summary: str
    build: Callable[["EditContext"], Built] | None = None
    run: Callable[["EditContext"], StrategyResult] | None = None
    own_forward: bool = False  # read in a forward of its own even where the others are fused (see full_downstream)

    @property
    def fusable(self) -> bool:
        """Whether its cache can be read in one forward with the others."""
        return self.build is not None


# ---------------------------------------------------------------------------- caches (read later)
class EditContext(Protocol):
    """What a strategy reads of the edit it repairs (``kvscope.engine.edit.experiment.EditExperiment`` provides it)."""

    lm: LoadedModel
    field: str
    old: str
    new: str
    settings: EditSettings
    min_gap: float  # the settings' bar plus the dtype's noise floor
    stale: ScenarioRun
    prompt: RenderedPrompt
    new_prompt: RenderedPrompt
    field_positions: list[int]
    new_field_ids: list[int]
    downstream_positions: list[int]

    def check_k(self, k: int) -> None: ...
    def field_edited(self) -> Notebook: ...
    def line_ids(self, template: str) -> list[int]: ...
    def rank_downstream(self, base: Notebook, k: int) -> tuple[list[int], dict]: ...
    def cot_decision(self, notebook: Notebook) -> tuple[Decision, str]: ...
    def cot_baselines(self) -> tuple[Decision, Decision]: ...
    def run(self, name: str) -> StrategyResult: ...


def _stale(experiment: "EditContext") -> Built:
    return experiment.stale.notebook, 0, {}


def _oracle(experiment: "EditContext") -> Built:
    prompt = experiment.new_prompt
    return Notebook.from_prompt(experiment.lm, prompt), len(prompt.context_ids), {}


def _field_only(experiment: "EditContext") -> Built:
    return experiment.field_edited(), len(experiment.field_positions), {}


def _line_text(experiment: "EditContext", template: str) -> str:
    return erratum_text(experiment.field, experiment.new, experiment.old, template)


def _erratum(experiment: "EditContext") -> Built:
    line = experiment.line_ids(experiment.settings.erratum)
    return experiment.stale.notebook.append(line, "erratum"), len(line), {"text": _line_text(experiment, experiment.settings.erratum)}


def _field_erratum(experiment: "EditContext") -> Built:
    line = experiment.line_ids(experiment.settings.erratum)
    return experiment.field_edited().append(line, "erratum"), len(experiment.field_positions) + len(line), {}


def _restate(experiment: "EditContext") -> Built:
    line = experiment.line_ids(experiment.settings.restate)
    return experiment.stale.notebook.append(line, "restate"), len(line), {"text": _line_text(experiment, experiment.settings.restate)}


def _full_downstream(experiment: "EditContext") -> Built:
    stale, downstream = experiment.stale.notebook, experiment.downstream_positions
    positions = experiment.field_positions + downstream
    tail = experiment.new_field_ids + [experiment.prompt.context_ids[p] for p in downstream]
    labels = [stale.segments[int(stale.entries_at([experiment.field_positions[0]])[0])]] * len(experiment.new_field_ids)
    labels += [stale.segments[int(i)] for i in stale.entries_at(downstream)]
    return stale.replace(positions, tail, labels), len(tail), {}


def _field_topk(experiment: "EditContext") -> Built:
    k = experiment.settings.top_k
    experiment.check_k(k)
    edited = experiment.field_edited()
    watch = Stopwatch()
    top, detail = experiment.rank_downstream(edited, k)
    detail |= {"k": k, "positions": top, "rank_ms": round(watch.ms, 1)}
    return edited.recompute(top), len(experiment.field_positions) + len(top), detail


# ---------------------------------------------------------------------------- strategies with their own reads
def _field_only_cot(experiment: "EditContext") -> StrategyResult:
    watch = Stopwatch()
    try:
        notebook = experiment.field_edited()
    except NotApplicable as reason:
        return StrategyResult("field_only_cot", applicable=False, reason=str(reason))
    decision, chain = experiment.cot_decision(notebook)
    ms = watch.ms  # the baselines' chains are the experiment's, not this strategy's
    stale, oracle = experiment.cot_baselines
    detail = {"chain": chain, "stale_cot_margin": round(stale.margin, 4), "oracle_cot_margin": round(oracle.margin, 4)}
    gain = recovery(decision.margin, stale.margin, oracle.margin, experiment.min_gap)
    return StrategyResult("field_only_cot", True, decision, gain, len(experiment.field_positions), ms, detail=detail, notebook=notebook)


def _auto(experiment: "EditContext") -> StrategyResult:
    candidates = {name: experiment.run(name) for name in AUTO_CANDIDATES}
    reference = candidates["field_erratum"] if candidates["field_erratum"].applicable else candidates["erratum"]
    agreeing = [c for c in candidates.values() if c.applicable and c.decision.label == reference.decision.label]
    chosen = min(agreeing, key=lambda c: (c.tokens_recomputed, c.ms))
    detail = {"chosen": chosen.name, "reference": reference.name}
    return StrategyResult(
        "auto", True, chosen.decision, chosen.recovery, chosen.tokens_recomputed, chosen.ms, detail=detail, notebook=chosen.notebook
    )


REGISTRY: dict[str, Strategy] = {
    strategy.name: strategy
    for strategy in (
        Strategy("stale", "nothing recomputed (baseline)", build=_stale),
        Strategy("field_only", "recompute the field's K/V with the new value; later entries keep their stale K/V", build=_field_only),
        Strategy("field_only_cot", "field_only, then a short chain of thought before answering", run=_field_only_cot),
        Strategy("field_topk", "recompute the field and the K later tokens that matter most (by effect or K/V change)", build=_field_topk),
        Strategy("erratum", "append [STATE UPDATE] field -> new after the context; nothing cached changes", build=_erratum),
        Strategy("field_erratum", "field_only plus the erratum (the robust default)", build=_field_erratum),
        Strategy(
            "restate", "append the field with its new value (field: new) after the context; the old value stays cached", build=_restate
        ),
        # Its cache is the oracle's computation (the prefix's K/V, then the new field and everything after it), so read
        # alone it gives the oracle's numbers bit for bit; in a forward shared with other caches a bfloat16 model gave
        # it the field_only margin (+0.38 against the oracle's +0.63 on an audited support log's account_tier change).
        Strategy("full_downstream", "recompute the field and everything after it", build=_full_downstream, own_forward=True),
        Strategy("oracle", "a clean prefill with the new value (reference)", build=_oracle),
        Strategy("auto", "cheapest of field_only / erratum / restate / field_erratum agreeing with field_erratum", run=_auto),
    )
}
STRATEGIES = tuple(REGISTRY)  # every strategy name, in the table's order
FUSABLE = tuple(name for name, strategy in REGISTRY.items() if strategy.fusable)


RENAMED = {"hoist": "restate"}  # old strategy names (links, notebooks, stored results) and what they are called now


def check_names(names: Iterable[str]) -> list[str]:
    """The names as a list, or a :class:`StrategyError` naming the first unknown one and the choices."""
    names = list(names)
    unknown = [name for name in names if name not in REGISTRY]
    if unknown:
        renamed = f" ({unknown[0]!r} is now {RENAMED[unknown[0]]!r})" if unknown[0] in RENAMED else ""
        raise StrategyError(f"unknown strategy {unknown[0]!r}{renamed}; choose from {', '.join(STRATEGIES)}")
    return names
