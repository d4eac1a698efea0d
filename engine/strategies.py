"""Edit strategies: repairing a prefilled cache after a field changes old → new.

| strategy | what it does to the stale cache | cost | failure mode |
|---|---|---|---|
| ``stale`` | nothing (baseline) | 0 | reads the old notes |
| ``field_only`` | recompute the field's K/V with the new value | |field| tokens | later notes still say "old": recovery ≈ 0 |
| ``field_only_cot`` | field-only, then a short greedy chain of thought before answering | |field| + chain | needs decoding; the chain re-reads the field |
| ``field_topk`` | field + the top-K downstream tokens (ranked by causal effect or K/V deviation) | |field| + K | K is model-dependent |
| ``erratum`` | append ``[STATE UPDATE] field -> new; ...`` after the context | |erratum| | can revert when the field is buried early |
| ``field_erratum`` | field-only plus the erratum (robust default) | |field| + |erratum| | — |
| ``hoist`` | restate ``field: new`` at the end | |restatement| | prompt surgery in real systems |
| ``full_downstream`` | recompute the field and everything after it | context − prefix | O(L) recompute |
| ``oracle`` | clean prefill with the new value (reference) | whole context | — |
| ``auto`` | cheapest of field_only / erratum / hoist / field_erratum agreeing with field_erratum | varies | — |

In-place strategies need the new value to have the old value's token count; otherwise they report
"not applicable" and why (use ``erratum``, ``field_erratum`` via errata, or ``full_downstream``).
Recovery = (s − s_stale) / (s_oracle − s_stale) on the decision margin; chain-of-thought variants are
compared with stale and oracle under the same chain-of-thought protocol.

The reference oracle reuses the stale cache's prefix when the stale is a clean prefill (a prefix-cache
hit: the same K/V as a clean prefill); the ``oracle`` *strategy* is always a clean prefill, the cost of
recomputing from scratch. :meth:`EditExperiment.report` builds every strategy's cache and reads them all,
with the oracle, in one fused forward (``fused=True``; each strategy's ms is then its share of that
forward by tokens, marked in its detail) or one strategy at a time with its own wall time.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from engine.decision import RECOVERY_MIN_GAP, Decision, Recovery, recovery
from engine.models import LoadedModel
from engine.notebook import Notebook, NotebookError
from engine.patching import EffectMap, attribution_effects, kv_deviation
from engine.runs import PreparedRun, ScenarioRun, prepare_scenario, run_scenario
from engine.scenario import RenderedPrompt, Scenario, ScenarioError

DEFAULT_ERRATUM = "[STATE UPDATE] {field} -> {new}; overrides any earlier value and conclusion"
STRATEGIES = (
    "stale", "field_only", "field_only_cot", "field_topk", "erratum",
    "field_erratum", "hoist", "full_downstream", "oracle", "auto",
)
AUTO_CANDIDATES = ("field_only", "erratum", "hoist", "field_erratum")
FUSABLE = ("stale", "field_only", "field_topk", "erratum", "field_erratum", "hoist", "full_downstream", "oracle")
RANKINGS = ("causal", "deviation")
RANKING_LABELS = {"causal": "causal (attribution patching)", "deviation": "deviation (CacheBlend-style)"}


class NotApplicable(Exception):
    """A strategy that cannot apply to this edit; the message says why."""


@dataclass(frozen=True)
class EditSettings:
    """Knobs of the strategies; the defaults follow the paper."""

    erratum: str = DEFAULT_ERRATUM
    hoist: str = "{field}: {new}"
    top_k: int = 8
    ranking: str = "causal"
    cot_tokens: int = 24
    cot_prefix: str = "Let me check the current {field} against the policy."
    cot_answer_prefix: str = "\nSo the answer is:"
    min_gap: float = RECOVERY_MIN_GAP

    def __post_init__(self) -> None:
        if self.ranking not in RANKINGS:
            raise ValueError(f"unknown ranking {self.ranking!r}; choose one of {', '.join(RANKINGS)}")
        if self.top_k < 1 or self.cot_tokens < 0:
            raise ValueError("top_k must be ≥ 1 and cot_tokens ≥ 0")


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


@dataclass(frozen=True)
class NotesShare:
    """How much of a decision change the downstream notes carry, against the field's own K/V.

    ``share`` = 1 − field_only recovery: the part of the stale → oracle margin change that recomputing the
    field alone does not bring back. ``downstream_recovery`` (when measured) patches the oracle's K/V of
    every token after the field into the stale cache with the field left stale: the notes alone.
    """

    share: float | None
    field_recovery: float | None
    field_only_label: str | None
    stale_label: str
    oracle_label: str
    downstream_recovery: float | None = None
    reason: str | None = None

    @classmethod
    def of(cls, field_only: StrategyResult, stale: Decision, oracle: Decision, downstream: Recovery | None = None) -> "NotesShare":
        """From the field_only strategy's result (and the downstream patch's recovery, if read)."""
        down = None if downstream is None else downstream.value
        if not field_only.applicable:
            return cls(None, None, None, stale.label, oracle.label, down, f"field_only is not applicable: {field_only.reason}")
        value = field_only.recovery.value
        share = None if value is None else 1.0 - value
        return cls(share, value, field_only.decision.label, stale.label, oracle.label, down, field_only.recovery.reason)

    @property
    def field_alone_flips(self) -> bool | None:
        """Whether recomputing the field alone already reaches the oracle's decision."""
        return None if self.field_only_label is None else self.field_only_label == self.oracle_label

    def headline(self) -> str:
        """One sentence computed from the numbers (plain text)."""
        if self.share is None:
            return f"Notes share undefined: {self.reason}"
        percent = f"{max(0.0, min(1.0, self.share)):.0%}"
        if self.stale_label == self.oracle_label:
            return f"Notes carry {percent} of this margin change; a clean prefill keeps the decision at {self.oracle_label}"
        if self.field_alone_flips:
            return (f"Notes carry {percent} of this decision; recomputing the field alone already reaches {self.field_only_label}: "
                    "this model still reads much of the field directly")
        return f"Notes carry {percent} of this decision; recomputing the field alone leaves it at {self.field_only_label}"

    def as_dict(self) -> dict:
        rounded = lambda value: None if value is None else round(value, 4)  # noqa: E731
        return {
            "share": rounded(self.share),
            "field_recovery": rounded(self.field_recovery),
            "downstream_recovery": rounded(self.downstream_recovery),
            "field_only_decision": self.field_only_label,
            "field_alone_flips": self.field_alone_flips,
            "headline": self.headline(),
            "reason": self.reason,
        }


@dataclass
class EditReport:
    """All requested strategies for one field change, with stale and oracle for reference."""

    model: str
    scenario: str
    field: str
    old: str
    new: str
    stale: StrategyResult
    oracle: StrategyResult
    strategies: dict[str, StrategyResult]
    notes: NotesShare

    @property
    def flips(self) -> bool:
        """Whether a clean prefill with the new value changes the decision."""
        return self.stale.decision.label != self.oracle.decision.label

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "scenario": self.scenario,
            "field": self.field,
            "old": self.old,
            "new": self.new,
            "context_tokens": len(self.stale.notebook),
            "flips": self.flips,
            "delta_margin": round(self.oracle.decision.margin - self.stale.decision.margin, 4),
            "notes": self.notes.as_dict(),
            "stale": self.stale.as_dict(),
            "oracle": self.oracle.as_dict(),
            "strategies": {name: result.as_dict() for name, result in self.strategies.items()},
        }


class EditExperiment:
    """A field change on one scenario: the stale and oracle runs, and every strategy on demand."""

    def __init__(
        self,
        lm: LoadedModel,
        scenario: Scenario,
        field_name: str | None = None,
        new: str | None = None,
        settings: EditSettings | None = None,
        build: Callable[[RenderedPrompt], Notebook] | None = None,
        capture_attention: bool = False,
        stale: ScenarioRun | None = None,
    ) -> None:
        """``build`` makes the stale notebook (default: a clean prefill; e.g. skills spliced); ``stale``
        reuses a run of this scenario at its old values (e.g. cached across edits). The oracle is a clean
        prefill with the new value (prefix reused from a clean stale). ``capture_attention`` keeps the
        decision tokens' attention in the stale and oracle decisions (saves a read for attention views)."""
        self.lm, self.scenario, self.settings = lm, scenario, settings or EditSettings()
        self.capture_attention = capture_attention
        chosen = scenario.field(field_name)
        self.field, self.old, self.new = chosen.name, chosen.old, chosen.new if new is None else new
        if not self.new or "{" in self.new or "}" in self.new:
            raise ScenarioError(f"new value for field {self.field!r} must be non-empty and contain no braces, got {self.new!r}")
        if stale is not None and (stale.scenario != scenario or stale.prompt.values != scenario.values_with()):
            raise ScenarioError(f"the cached stale run is not scenario {scenario.name!r} at its old values")
        self.stale = stale or run_scenario(lm, scenario, {self.field: self.old}, build, capture_attention=capture_attention)
        self._fused: dict[str, StrategyResult] = {}
        self._oracle_timing: str | None = None  # set when the oracle was read in a fused forward

    @cached_property
    def _oracle_plan(self) -> PreparedRun:
        """The oracle's prompt and (still pending) notebook."""
        return prepare_scenario(self.lm, self.scenario, {self.field: self.new}, reuse=self.stale)

    @cached_property
    def oracle(self) -> ScenarioRun:
        """The reference: a clean prefill with the new value, and its decision."""
        started = time.perf_counter()
        prepared = self._oracle_plan
        decision = prepared.notebook.read_prompt(prepared.prompt, answer_texts=self.scenario.answers, capture_attention=self.capture_attention)
        return prepared.finish(decision, (time.perf_counter() - started) * 1000)

    # ------------------------------------------------------------------ shared pieces
    @property
    def prompt(self):
        return self.stale.prompt

    @cached_property
    def field_positions(self) -> list[int]:
        span = self.stale.prompt.field_spans[self.field]
        return list(range(span.start, span.end))

    @cached_property
    def new_field_ids(self) -> list[int]:
        prompt = self._oracle_plan.prompt
        span = prompt.field_spans[self.field]
        return list(prompt.context_ids[span.start : span.end])

    @cached_property
    def downstream_positions(self) -> list[int]:
        """Context positions after the field (the candidates for notes)."""
        end = self.field_positions[-1]
        return [p for p in self.stale.notebook.visible_positions() if p > end]

    def _require_same_length(self) -> None:
        old, new = len(self.field_positions), len(self.new_field_ids)
        if old != new:
            raise NotApplicable(
                f"the new value is {new} tokens and the old one {old}: an in-place edit cannot keep later "
                "positions; use erratum, field_erratum with errata only, or full_downstream"
            )

    def field_edited(self) -> Notebook:
        """The stale cache with the field's K/V recomputed for the new value (same token length only)."""
        self._require_same_length()
        return self.stale.notebook.replace(self.field_positions, self.new_field_ids)

    def _line(self, template: str) -> list[int]:
        text = template.format(field=self.field, new=self.new, old=self.old) + "\n\n"
        return self.lm.tokenizer(text, add_special_tokens=False).input_ids

    def _read(self, notebook: Notebook) -> Decision:
        return notebook.read_prompt(self.prompt, answer_texts=self.scenario.answers)

    def _check_k(self, k: int) -> None:
        if k > len(self.downstream_positions):
            raise NotebookError(f"K={k} is larger than the {len(self.downstream_positions)} downstream tokens of field {self.field!r}")

    def downstream_effects(self, base: Notebook, ranking: str | None = None) -> EffectMap:
        """Every downstream position of ``base`` scored against the oracle run's K/V by ``ranking`` (default:
        the settings'): causal = attribution patching (one backward), deviation = CacheBlend-style ‖ΔK/V‖."""
        ranking = ranking or self.settings.ranking
        if ranking not in RANKINGS:
            raise ValueError(f"unknown ranking {ranking!r}; choose one of {', '.join(RANKINGS)}")
        if ranking == "causal":
            return attribution_effects(base, self.oracle.notebook, self.prompt, self.downstream_positions)
        return kv_deviation(base, self.oracle.notebook, self.downstream_positions)

    def top_downstream(self, effects: EffectMap, k: int) -> list[int]:
        """The k highest-ranked positions of :meth:`downstream_effects` (causal: those that move the margin
        towards the oracle's)."""
        self._check_k(k)
        direction = self.oracle.decision.margin - self.stale.decision.margin if effects.method == "attribution" else 1.0
        return effects.top_positions(k, direction)

    def rank_downstream(self, base: Notebook, k: int) -> tuple[list[int], dict]:
        """Top-k downstream positions by the configured ranking, against the oracle run's K/V."""
        self._check_k(k)
        return self.top_downstream(self.downstream_effects(base), k), {"ranking": RANKING_LABELS[self.settings.ranking]}

    # ------------------------------------------------------------------ strategies (caches, read later)
    def _stale(self):
        return self.stale.notebook, 0, {}

    def _oracle(self):
        prompt = self._oracle_plan.prompt
        return Notebook.from_prompt(self.lm, prompt), len(prompt.context_ids), {}

    def _field_only(self):
        return self.field_edited(), len(self.field_positions), {}

    def _erratum(self):
        line = self._line(self.settings.erratum)
        return self.stale.notebook.append(line, "erratum"), len(line), {"text": self.settings.erratum.format(field=self.field, new=self.new, old=self.old)}

    def _field_erratum(self):
        line = self._line(self.settings.erratum)
        return self.field_edited().append(line, "erratum"), len(self.field_positions) + len(line), {}

    def _hoist(self):
        line = self._line(self.settings.hoist)
        return self.stale.notebook.append(line, "hoist"), len(line), {"text": self.settings.hoist.format(field=self.field, new=self.new, old=self.old)}

    def _full_downstream(self):
        positions = self.field_positions + self.downstream_positions
        tail = self.new_field_ids + [self.prompt.context_ids[p] for p in self.downstream_positions]
        stale = self.stale.notebook
        labels = [stale.segments[int(stale.entries_at([self.field_positions[0]])[0])]] * len(self.new_field_ids)
        labels += [stale.segments[int(i)] for i in stale.entries_at(self.downstream_positions)]
        return stale.replace(positions, tail, labels), len(tail), {}

    def _field_topk(self):
        self._check_k(self.settings.top_k)
        edited = self.field_edited()
        started = time.perf_counter()
        top, detail = self.rank_downstream(edited, self.settings.top_k)
        detail.update(k=self.settings.top_k, positions=top, rank_ms=round((time.perf_counter() - started) * 1000, 1))
        return edited.recompute(top), len(self.field_positions) + len(top), detail

    def cot_decision(self, notebook: Notebook) -> tuple[Decision, str]:
        """Greedy chain of thought after the question, then the answer scored after an answer prefix."""
        tokenizer = self.lm.tokenizer
        prefix = tokenizer(self.settings.cot_prefix.format(field=self.field), add_special_tokens=False).input_ids
        eos = self.lm.model.generation_config.eos_token_id
        stops = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        extended, generated = notebook.generate(list(self.prompt.decode_ids) + prefix, self.settings.cot_tokens, tuple(stops))
        answer_prefix = tokenizer(self.settings.cot_answer_prefix, add_special_tokens=False).input_ids
        answers = {label: [tokenizer(" " + s, add_special_tokens=False).input_ids for s in strings] for label, strings in self.scenario.answers.items()}
        decision = extended.read(answer_prefix, answers, answer_texts=self.scenario.answers)
        return decision, tokenizer.decode(generated)

    @cached_property
    def _cot_baselines(self) -> tuple[Decision, Decision]:
        return self.cot_decision(self.stale.notebook)[0], self.cot_decision(self.oracle.notebook)[0]

    # ------------------------------------------------------------------ running
    def _recovery(self, decision: Decision) -> Recovery:
        return recovery(decision.margin, self.stale.decision.margin, self.oracle.decision.margin, self.settings.min_gap)

    def run(self, name: str) -> StrategyResult:
        """Run one strategy by name (see STRATEGIES); reuses its fused result when it has one."""
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
        if name in self._fused:
            return self._fused[name]
        if name == "auto":
            return self._auto()
        if name == "field_only_cot":
            return self._field_only_cot()
        started = time.perf_counter()
        try:
            notebook, tokens, detail = getattr(self, f"_{name}")()
        except NotApplicable as reason:
            return StrategyResult(name, applicable=False, reason=str(reason))
        decision = self._read(notebook)
        ms = (time.perf_counter() - started) * 1000
        return StrategyResult(name, True, decision, self._recovery(decision), tokens, ms, detail=detail, notebook=notebook)

    def _field_only_cot(self) -> StrategyResult:
        started = time.perf_counter()
        try:
            notebook = self.field_edited()
        except NotApplicable as reason:
            return StrategyResult("field_only_cot", applicable=False, reason=str(reason))
        decision, chain = self.cot_decision(notebook)
        ms = (time.perf_counter() - started) * 1000
        stale, oracle = self._cot_baselines
        detail = {"chain": chain, "stale_cot_margin": round(stale.margin, 4), "oracle_cot_margin": round(oracle.margin, 4)}
        gain = recovery(decision.margin, stale.margin, oracle.margin, self.settings.min_gap)
        return StrategyResult("field_only_cot", True, decision, gain, len(self.field_positions), ms, detail=detail, notebook=notebook)

    def _auto(self) -> StrategyResult:
        candidates = {name: self.run(name) for name in AUTO_CANDIDATES}
        reference = candidates["field_erratum"] if candidates["field_erratum"].applicable else candidates["erratum"]
        agreeing = [c for c in candidates.values() if c.applicable and c.decision.label == reference.decision.label]
        chosen = min(agreeing, key=lambda c: (c.tokens_recomputed, c.ms))
        detail = {"chosen": chosen.name, "reference": reference.name}
        return StrategyResult("auto", True, chosen.decision, chosen.recovery, chosen.tokens_recomputed, chosen.ms, detail=detail, notebook=chosen.notebook)

    def read_together(self, names: Sequence[str]) -> float:
        """Build the named strategies' caches and read them, with the oracle if not read yet, in one forward.

        Results are kept for :meth:`run`; each strategy's ms is its build time plus its share of the
        forward by the tokens it ran there. Returns the fused forward's wall time in ms.
        """
        wanted = list(dict.fromkeys(n for name in names for n in (AUTO_CANDIDATES if name == "auto" else [name])))
        prepared: dict[str, tuple[Notebook, int, dict, float]] = {}
        for name in wanted:
            if name not in FUSABLE or name in self._fused:
                continue
            started = time.perf_counter()
            try:
                notebook, tokens, detail = getattr(self, f"_{name}")()
            except NotApplicable as reason:
                self._fused[name] = StrategyResult(name, applicable=False, reason=str(reason))
                continue
            prepared[name] = (notebook, tokens, detail, (time.perf_counter() - started) * 1000)
        oracle = None if "oracle" in self.__dict__ else self._oracle_plan
        notebooks = [notebook for notebook, *_ in prepared.values()] + ([oracle.notebook] if oracle else [])
        if not notebooks:
            return 0.0
        computations = [notebook.computation() for notebook in notebooks]  # equal ones run once: share their time
        ran = {key: len(self.prompt.decode_ids) + notebook.pending_tokens for key, notebook in zip(computations, notebooks)}
        started = time.perf_counter()
        decisions = Notebook.read_many(notebooks, self.prompt.decode_ids, self.prompt.answer_ids,
                                       answer_texts=self.scenario.answers, capture_attention=self.capture_attention)
        fused_ms = (time.perf_counter() - started) * 1000
        shares = [fused_ms * ran[key] / sum(ran.values()) for key in computations]
        timing = f"share of one fused forward of {len(notebooks)} caches ({fused_ms:.0f} ms)"
        if oracle:
            self.__dict__["oracle"] = oracle.finish(decisions[-1], shares[-1])
            self._oracle_timing = timing
        for (name, (notebook, tokens, detail, build_ms)), decision, share in zip(prepared.items(), decisions, shares):
            detail = detail | {"timing": timing}
            self._fused[name] = StrategyResult(name, True, decision, self._recovery(decision), tokens, build_ms + share, detail=detail, notebook=notebook)
        return fused_ms

    def downstream_patch_recovery(self) -> Recovery | None:
        """Recovery when the oracle's K/V of every token after the field are patched into the stale cache
        and the field is left stale (the notes alone); None when the values differ in token length."""
        if len(self.field_positions) != len(self.new_field_ids):
            return None
        return self._recovery(self._read(self.stale.notebook.patch(self.oracle.notebook, self.downstream_positions)))

    def notes_share(self, downstream_patch: bool = False) -> NotesShare:
        """The notes share of this edit (field_only's recovery; ``downstream_patch`` adds one more read)."""
        return NotesShare.of(self.run("field_only"), self.stale.decision, self.oracle.decision,
                             self.downstream_patch_recovery() if downstream_patch else None)

    def report(self, names: Sequence[str] = STRATEGIES, progress: Callable[[int, int], None] | None = None, fused: bool = False,
               downstream_patch: bool = False) -> EditReport:
        """Run the named strategies and collect them with stale, oracle and the notes share (``fused``: see
        :meth:`read_together`; field_only is always read, for the notes share)."""
        unknown = [n for n in names if n not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
        if fused:
            self.read_together([*names, "field_only"])
        results = {}
        for index, name in enumerate(names):
            results[name] = self.run(name)
            if progress:
                progress(index + 1, len(names))
        stale = StrategyResult("stale", True, self.stale.decision, Recovery(0.0), self.stale.computed_tokens, self.stale.ms, notebook=self.stale.notebook)
        reused = {"reused_prefix_tokens": len(self.oracle.prompt.context_ids) - self.oracle.computed_tokens}
        oracle = StrategyResult("oracle", True, self.oracle.decision, Recovery(1.0), self.oracle.computed_tokens, self.oracle.ms, notebook=self.oracle.notebook,
                                detail=reused | ({"timing": self._oracle_timing} if self._oracle_timing else {}))
        return EditReport(self.lm.fingerprint.name, self.scenario.name, self.field, self.old, self.new, stale, oracle, results,
                          self.notes_share(downstream_patch))
