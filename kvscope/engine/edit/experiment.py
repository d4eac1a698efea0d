"""One field change on one scenario: the stale and oracle runs, and every edit strategy run against them.

:class:`EditExperiment` holds the stale run (a clean prefill with the old value, or a cached/composed one),
the oracle (a clean prefill with the new value; it reuses the stale cache's prefix when the stale is a clean
prefill: a prefix-cache hit, the same K/V as a clean prefill), the field's and downstream positions, the
downstream rankings (causal and K/V deviation) and the notes share. Probes, attribution, the linear probe and
the frontier import it; the strategies themselves live in the registry of ``kvscope.engine.edit.strategies``.

:meth:`EditExperiment.report` builds every strategy's cache and reads them all in one fused forward (``fused=True``;
each strategy's ms is then its share of that forward by tokens, marked in its detail) or one strategy at a time with
its own wall time.

The references of every recovery and of the notes share (the oracle, and ``field_only``, whose recovery the notes
share is) are read first, each in a forward of its own (:meth:`EditExperiment.read_references`), whatever else is
asked: every caller (the Notes tab, the Learn tab, the locality probe, the CLI, an export) then reads the same two
margins. Exact arithmetic does not care what shares a forward, but a bfloat16 forward does (its margins move by
about 0.1 logit with the other forks beside them, enough to show 0.09 in one place and 0.12 in another).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

from kvscope.engine.cache.decision import Decision, Recovery, recovery, recovery_gap
from kvscope.engine.cache.loaded import LoadedModel, dtype_name
from kvscope.engine.cache.notebook import Knockout, Notebook, NotebookError
from kvscope.engine.cache.patching import EffectMap, attribution_effects, kv_deviation
from kvscope.engine.edit.erratum import erratum_ids
from kvscope.engine.edit.report import EditReport, NotesShare
from kvscope.engine.edit.runs import PreparedRun, ScenarioRun, prepare_scenario, run_scenario
from kvscope.engine.edit.strategies import (
    AUTO_CANDIDATES,
    FUSABLE,
    RANKING_LABELS,
    REGISTRY,
    STRATEGIES,
    EditSettings,
    NotApplicable,
    StrategyResult,
    check_names,
    check_ranking,
)
from kvscope.engine.progress import StepProgress
from kvscope.engine.scenario import RenderedPrompt, Scenario, ScenarioError
from kvscope.engine.timing import Stopwatch

NOTES_REFERENCE = "field_only"  # the strategy whose recovery the notes share is, read with the oracle


class EditExperiment:
    """A field change on one scenario: the stale and oracle runs, positions and rankings; strategies on demand."""

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
        oracle: ScenarioRun | None = None,
    ) -> None:
        """``build`` makes the stale notebook (default: a clean prefill; e.g. skills spliced); ``stale``
        reuses a run of this scenario at its old values (e.g. cached across edits). The oracle is a clean
        prefill with the new value (prefix reused from a clean stale) unless ``oracle`` gives another
        reference run of the new value (e.g. a perturbed or composed cache). ``capture_attention`` keeps the
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
        self._results: dict[str, StrategyResult] = {}  # strategies read in a fused forward, by name
        self._oracle_run: ScenarioRun | None = oracle

    # ------------------------------------------------------------------ the two reference runs
    @cached_property
    def _oracle_prepared(self) -> PreparedRun:
        """The oracle's prompt and (still pending) notebook."""
        return prepare_scenario(self.lm, self.scenario, {self.field: self.new}, reuse=self.stale)

    @property
    def oracle(self) -> ScenarioRun:
        """The reference: a clean prefill with the new value, and its decision (read on first use, with field_only:
        see :meth:`read_references`)."""
        if self._oracle_run is None:
            self.read_references()
        return self._oracle_run

    @property
    def prompt(self) -> RenderedPrompt:
        """The stale prompt (its decode and answer ids are the oracle's too)."""
        return self.stale.prompt

    @property
    def new_prompt(self) -> RenderedPrompt:
        """The prompt rendered with the new value."""
        return self._oracle_prepared.prompt

    # ------------------------------------------------------------------ positions
    @cached_property
    def field_positions(self) -> list[int]:
        span = self.stale.prompt.field_spans[self.field]
        return list(range(span.start, span.end))

    @cached_property
    def new_field_ids(self) -> list[int]:
        span = self.new_prompt.field_spans[self.field]
        return list(self.new_prompt.context_ids[span.start : span.end])

    @cached_property
    def downstream_positions(self) -> list[int]:
        """Context positions after the field (the candidates for notes)."""
        end = self.field_positions[-1]
        return [p for p in self.stale.notebook.visible_positions() if p > end]

    @property
    def same_length(self) -> bool:
        """Whether the new value has the old one's token count, so every later position stays where it was."""
        return len(self.field_positions) == len(self.new_field_ids)

    def check_k(self, k: int) -> None:
        """Refuse a top-K larger than the downstream tokens."""
        if k > len(self.downstream_positions):
            raise NotebookError(f"K={k} is larger than the {len(self.downstream_positions)} downstream tokens of field {self.field!r}")

    # ------------------------------------------------------------------ caches the strategies build on
    def field_edited(self) -> Notebook:
        """The stale cache with the field's K/V recomputed for the new value (same token length only)."""
        if not self.same_length:
            raise NotApplicable(
                f"the new value is {len(self.new_field_ids)} tokens and the old one {len(self.field_positions)}: an in-place "
                "edit cannot keep later positions; use erratum, field_erratum with errata only, or full_downstream"
            )
        return self.stale.notebook.replace(self.field_positions, self.new_field_ids)

    def line_ids(self, template: str) -> list[int]:
        """Token ids of a line appended after the context (erratum, restate), its blank line included."""
        return erratum_ids(self.lm.tokenizer, self.field, self.new, self.old, template)

    def read(self, notebook: Notebook) -> Decision:
        """The decision read from ``notebook`` with this scenario's question and answers."""
        return notebook.read_prompt(self.prompt, answer_texts=self.scenario.answers)

    # ------------------------------------------------------------------ where the notes are
    def downstream_effects(self, base: Notebook, ranking: str | None = None) -> EffectMap:
        """Every downstream position of ``base`` scored against the oracle run's K/V by ``ranking`` (default:
        the settings'): causal = attribution patching (one backward), deviation = CacheBlend-style ‖ΔK/V‖."""
        if check_ranking(ranking or self.settings.ranking) == "causal":
            return attribution_effects(base, self.oracle.notebook, self.prompt, self.downstream_positions)
        return kv_deviation(base, self.oracle.notebook, self.downstream_positions)

    def top_downstream(self, effects: EffectMap, k: int) -> list[int]:
        """The k highest-ranked positions of :meth:`downstream_effects` (causal: those that move the margin
        towards the oracle's)."""
        self.check_k(k)
        direction = self.oracle.decision.margin - self.stale.decision.margin if effects.method == "attribution" else 1.0
        return effects.top_positions(k, direction)

    def rank_downstream(self, base: Notebook, k: int) -> tuple[list[int], dict]:
        """Top-k downstream positions by the configured ranking, against the oracle run's K/V."""
        self.check_k(k)
        return self.top_downstream(self.downstream_effects(base), k), {"ranking": RANKING_LABELS[self.settings.ranking]}

    def notes_effects(self) -> EffectMap | None:
        """Attribution patch effects of the oracle's K/V on the stale decision over the field and every later
        token, from the stale run's cached gradients; None when the values differ in token length."""
        if not self.same_length:
            return None
        return attribution_effects(
            self.stale.notebook,
            self.oracle.notebook,
            self.prompt,
            self.field_positions + self.downstream_positions,
            gradients=self.stale.gradients,
        )

    def top_notes(self, effects: EffectMap, k: int) -> list[int]:
        """The k positions of :meth:`notes_effects` that move the stale decision most towards the oracle's."""
        return effects.top_positions(k, self.oracle.decision.margin - self.stale.decision.margin)

    def knocked_out(self, positions: Sequence[int]) -> Decision:
        """The oracle's decision with these context positions hidden from it in every layer and head."""
        return self.oracle.notebook.read_prompt(self.oracle.prompt, knockout=Knockout(tuple(positions)), answer_texts=self.scenario.answers)

    # ------------------------------------------------------------------ chain of thought
    def cot_decision(self, notebook: Notebook) -> tuple[Decision, str]:
        """Greedy chain of thought after the question, then the answer scored after an answer prefix."""
        tokenizer = self.lm.tokenizer
        prefix = tokenizer(self.settings.cot_prefix.format(field=self.field), add_special_tokens=False).input_ids
        extended, generated = notebook.generate(list(self.prompt.decode_ids) + prefix, self.settings.cot_tokens, self.lm.stop_ids)
        answer_prefix = tokenizer(self.settings.cot_answer_prefix, add_special_tokens=False).input_ids
        answers = {
            label: [tokenizer(" " + s, add_special_tokens=False).input_ids for s in strings]
            for label, strings in self.scenario.answers.items()
        }
        decision = extended.read(answer_prefix, answers, answer_texts=self.scenario.answers)
        return decision, tokenizer.decode(generated)

    @cached_property
    def cot_baselines(self) -> tuple[Decision, Decision]:
        """Stale and oracle decisions under the same chain-of-thought protocol."""
        return self.cot_decision(self.stale.notebook)[0], self.cot_decision(self.oracle.notebook)[0]

    # ------------------------------------------------------------------ running strategies
    @property
    def min_gap(self) -> float:
        """The smallest stale → oracle margin change a recovery is measured against: the settings' bar plus the model
        dtype's noise floor (:func:`recovery_gap`)."""
        return recovery_gap(dtype_name(self.lm.dtype), self.settings.min_gap)

    def recovery_of(self, decision: Decision) -> Recovery:
        """Recovery of a decision between this experiment's stale (0) and oracle (1) margins."""
        return recovery(decision.margin, self.stale.decision.margin, self.oracle.decision.margin, self.min_gap)

    def _build(self, name: str) -> tuple[Notebook, int, dict, float] | StrategyResult:
        """A fusable strategy's cache, tokens, detail and build ms, or its not-applicable result."""
        watch = Stopwatch()
        try:
            notebook, tokens, detail = REGISTRY[name].build(self)
        except NotApplicable as reason:
            return StrategyResult(name, applicable=False, reason=str(reason))
        return notebook, tokens, detail, watch.ms

    def run(self, name: str) -> StrategyResult:
        """Run one strategy by name (see ``kvscope.engine.edit.strategies``); reuses its fused result when it has one."""
        strategy = REGISTRY[check_names([name])[0]]
        if name == NOTES_REFERENCE:
            self.read_references()
        if name in self._results:
            return self._results[name]
        if not strategy.fusable:
            return strategy.run(self)
        return self._read_alone(name)

    def _read_alone(self, name: str) -> StrategyResult:
        """A fusable strategy built and read in a forward of its own, timed."""
        built = self._build(name)
        if isinstance(built, StrategyResult):
            return built
        notebook, tokens, detail, build_ms = built
        watch = Stopwatch()
        decision = self.read(notebook)
        ms = build_ms + watch.ms
        return StrategyResult(name, True, decision, self.recovery_of(decision), tokens, ms, detail=detail, notebook=notebook)

    def read_references(self) -> None:
        """Read the oracle (unless given), then field_only, each in a forward of its own and once: the margins every
        recovery and the notes share rest on, the same whichever strategies a caller reads beside or after them (and
        each timed on its own)."""
        if self._oracle_run is None:
            watch = Stopwatch()
            prepared = self._oracle_prepared
            decision = prepared.notebook.read_prompt(
                prepared.prompt, answer_texts=self.scenario.answers, capture_attention=self.capture_attention
            )
            self._oracle_run = prepared.finish(decision, watch.ms)
        if NOTES_REFERENCE not in self._results:
            self._results[NOTES_REFERENCE] = self._read_alone(NOTES_REFERENCE)

    def read_together(self, names: Sequence[str]) -> float:
        """Build the named strategies' caches and read them in one fused forward (several for work beyond
        ``MAX_FORWARD_TOKENS``), after the references (:meth:`read_references`, not fused); a strategy marked
        ``own_forward`` is left to :meth:`run`, which reads it alone.

        Results are kept for :meth:`run`; each strategy's ms is its build time plus its share of the
        forward by the tokens it ran there. Returns the fused forward's wall time in ms.
        """
        self.read_references()
        wanted = dict.fromkeys(n for name in check_names(names) for n in (AUTO_CANDIDATES if name == "auto" else [name]))
        prepared: dict[str, tuple[Notebook, int, dict, float]] = {}
        for name in wanted:
            if name not in FUSABLE or REGISTRY[name].own_forward or name in self._results:
                continue
            built = self._build(name)
            if isinstance(built, StrategyResult):
                self._results[name] = built
            else:
                prepared[name] = built
        notebooks = [notebook for notebook, *_ in prepared.values()]
        if not notebooks:
            return 0.0
        computations = [notebook.computation() for notebook in notebooks]  # equal ones run once: share their time
        ran = {key: len(self.prompt.decode_ids) + notebook.pending_tokens for key, notebook in zip(computations, notebooks)}
        watch = Stopwatch()
        decisions = Notebook.read_many(notebooks, self.prompt.decode_ids, self.prompt.answer_ids, answer_texts=self.scenario.answers)
        fused_ms = watch.ms
        shares = [fused_ms * ran[key] / sum(ran.values()) for key in computations]
        timing = f"share of the fused forwards of {len(notebooks)} caches ({fused_ms:.0f} ms)"
        for (name, (notebook, tokens, detail, build_ms)), decision, share in zip(prepared.items(), decisions, shares):
            detail = detail | {"timing": timing}
            self._results[name] = StrategyResult(
                name, True, decision, self.recovery_of(decision), tokens, build_ms + share, detail=detail, notebook=notebook
            )
        return fused_ms

    def downstream_patch_recovery(self) -> Recovery | None:
        """Recovery when the oracle's K/V of every token after the field are patched into the stale cache
        and the field is left stale (the notes alone); None when the values differ in token length."""
        if not self.same_length:
            return None
        return self.recovery_of(self.read(self.stale.notebook.patch(self.oracle.notebook, self.downstream_positions)))

    def notes_share(self, downstream_patch: bool = False) -> NotesShare:
        """The notes share of this edit (field_only's recovery; ``downstream_patch`` adds one more read)."""
        return NotesShare.of(
            self.run("field_only"),
            self.stale.decision,
            self.oracle.decision,
            self.downstream_patch_recovery() if downstream_patch else None,
        )

    def report(
        self, names: Sequence[str] = STRATEGIES, progress: StepProgress = None, fused: bool = False, downstream_patch: bool = False
    ) -> EditReport:
        """Run the named strategies and collect them with stale, oracle and the notes share (``fused``: see
        :meth:`read_together`; the oracle and field_only are always read first, by :meth:`read_references`)."""
        names = check_names(names)
        if fused:
            self.read_together(names)
        results = {}
        for index, name in enumerate(names):
            results[name] = self.run(name)
            if progress:
                progress(index + 1, len(names))
        stale = StrategyResult(
            "stale", True, self.stale.decision, Recovery(0.0), self.stale.computed_tokens, self.stale.ms, notebook=self.stale.notebook
        )
        reused = {"reused_prefix_tokens": len(self.oracle.prompt.context_ids) - self.oracle.computed_tokens}
        oracle = StrategyResult(
            "oracle",
            True,
            self.oracle.decision,
            Recovery(1.0),
            self.oracle.computed_tokens,
            self.oracle.ms,
            notebook=self.oracle.notebook,
            detail=reused,
        )
        return EditReport(
            self.lm.fingerprint.name,
            self.scenario.name,
            self.field,
            self.old,
            self.new,
            stale,
            oracle,
            results,
            self.notes_share(downstream_patch),
            dtype_name(self.lm.dtype),
        )
