"""The same scenario and field edit on up to three models, one row of numbers per model.

Each number is the single-model analysis of that model, reduced to one value:

- ``notes_share`` and ``recoveries``: :meth:`EditExperiment.report` of field_only, erratum and field_erratum (read
  with the oracle in one fused forward); the notes share is 1 − field_only recovery.
- ``notes_depth``: where the notes are written, the mean relative depth (layer / layers) of the notes map's
  ``NOTES_TOP`` strongest cells after the field (:func:`~kvscope.engine.probes.notes_map.probe_notes_map`; the field's own
  cells are the field, not notes). 0 is the first layer, close to 1 the last.
- ``read_heads``: how many heads carry the decision's reading of the notes, the fewest (layer, head) pairs holding
  ``READ_HEAD_MASS`` of the last decision token's attention mass on the top notes
  (:func:`~kvscope.engine.probes.heads.probe_heads`; its knockout of its top heads is in the details).
- ``splice_cosine``: next-token logit cosine of one skill (``SPLICE_SKILL``) spliced before the scenario with the
  composer's default remedy against a full recompute (:func:`~kvscope.engine.compose.fidelity.compare`).

Models are loaded one after another through the caller's loader and released before the next one, so only the
loader decides how many stay in memory. The paper's values at 7–9B (field-only recovery of its notes demos) sit
beside the rows: ``PAPER_MODELS``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.compose.fidelity import compare
from kvscope.engine.compose.placing import with_skills
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.strategies import EditSettings
from kvscope.engine.errors import KVScopeError
from kvscope.engine.jsonable import attributes, rounded
from kvscope.engine.probes.common import ProbeError
from kvscope.engine.probes.heads import HeadsResult, probe_heads
from kvscope.engine.probes.notes_map import NotesMapResult, probe_notes_map
from kvscope.engine.progress import MessageProgress, StepProgress, ticker
from kvscope.engine.scenario import Scenario, bundled_skills
from kvscope.engine.timing import Stopwatch

COMPARED_STRATEGIES = ("field_only", "erratum", "field_erratum")
MAX_MODELS = 3
NOTES_TOP = 8  # the notes map's strongest cells whose depth is averaged (and the probe's own `top`)
READ_HEAD_MASS = 0.5  # read heads: the fewest heads holding this share of the attention mass on the notes
SPLICE_SKILL = "refund_policy"
STAGES = ("load", "edit report", "notes map", "read heads", "splice")  # progress steps per model


class ComparisonError(KVScopeError):
    """A comparison that cannot run: too many or repeated models, or a model whose cache entries cannot be edited."""


@dataclass(frozen=True)
class PaperModel:
    """A model of the paper (arXiv 2606.17107) with its field-only recovery; its notes share is 1 − recovery."""

    model: str
    parameters: int
    field_only_recovery: float

    @property
    def notes_share(self) -> float:
        return 1.0 - self.field_only_recovery

    def as_dict(self) -> dict:
        return {**attributes(self, "model", "parameters", "field_only_recovery"), "notes_share": round(self.notes_share, 4)}


PAPER_MODELS = (
    PaperModel("Mistral-7B", 7_240_000_000, 0.137),
    PaperModel("Llama-3.1-8B", 8_030_000_000, -0.028),
    PaperModel("Gemma-2-9B", 9_240_000_000, 0.005),
)


def notes_depth(result: NotesMapResult, field_positions: Sequence[int], top: int = NOTES_TOP) -> tuple[float | None, list[tuple[int, int]]]:
    """Mean relative depth (layer / layers) of the notes map's ``top`` strongest cells after the field, towards the
    oracle's decision, and those cells as (layer, position); (None, []) when no position follows the field."""
    layers = len(result.effects)
    skip = set(field_positions)
    columns = [index for index, position in enumerate(result.positions) if position not in skip]
    cells = [(layer, index) for layer in range(layers) for index in columns]
    if not cells or layers == 0:
        return None, []
    direction = result.gap.direction
    strongest = sorted(cells, key=lambda cell: -direction * result.effects[cell[0]][cell[1]])[:top]
    depth = sum(layer / layers for layer, _ in strongest) / len(strongest)
    return depth, [(layer, result.positions[index]) for layer, index in strongest]


def read_heads(result: HeadsResult, share: float = READ_HEAD_MASS) -> int | None:
    """The fewest (layer, head) pairs holding ``share`` of the last decision token's attention mass on the top notes
    (None when no head attends to them)."""
    masses = sorted((mass for row in result.mass_last for mass in row), reverse=True)
    total = sum(masses)
    if total <= 0:
        return None
    held = 0.0
    for count, mass in enumerate(masses, start=1):
        held += mass
        if held >= share * total - 1e-12:
            return count
    return len(masses)


@dataclass
class ModelRow:
    """One model's numbers on the compared edit, with what each rests on and why any is missing."""

    model: str
    spec: str
    parameters: int
    parameter_bytes: int
    dtype: str
    layers: int
    heads: int  # query heads in all layers
    notes_share: float | None
    recoveries: dict[str, float | None]
    notes_depth: float | None
    read_heads: int | None
    splice_cosine: float | None
    flips: bool
    stale_label: str
    oracle_label: str
    delta_margin: float
    headline: str
    notes_cells: list[tuple[int, int]] = field(default_factory=list)
    top_heads_recovery_drop: float | None = None
    splice_decision_agree: bool | None = None
    missing: dict[str, str] = field(default_factory=dict)  # number -> why it is None
    ms: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            **attributes(self, "model", "parameters"),
            "notes_share": rounded(self.notes_share),
            "recoveries": {name: rounded(value) for name, value in self.recoveries.items()},
            "notes_depth": rounded(self.notes_depth),
            "read_heads": self.read_heads,
            "splice_cosine": rounded(self.splice_cosine, 6),
            "details": {
                **attributes(self, "spec", "parameter_bytes", "dtype", "layers", "heads", "flips"),
                "stale_decision": self.stale_label,
                "oracle_decision": self.oracle_label,
                "delta_margin": rounded(self.delta_margin),
                "headline": self.headline,
                "notes_cells": [list(cell) for cell in self.notes_cells],
                "top_heads_recovery_drop": rounded(self.top_heads_recovery_drop),
                "splice_decision_agree": self.splice_decision_agree,
                "missing": self.missing,
                "ms": {stage: round(value, 1) for stage, value in self.ms.items()},
            },
        }


@dataclass
class ModelComparison:
    """The compared edit and one row per model, beside the paper's 7–9B values."""

    scenario: str
    field: str
    old: str
    new: str
    skill: str
    remedy: Remedy
    rows: list[ModelRow]

    def as_dict(self) -> dict:
        return {
            **attributes(self, "scenario", "field", "old", "new"),
            "strategies": list(COMPARED_STRATEGIES),
            "splice_skill": self.skill,
            "remedy": self.remedy.name,
            "notes_top": NOTES_TOP,
            "read_head_mass": READ_HEAD_MASS,
            "models": [row.as_dict() for row in self.rows],
            "paper": [model.as_dict() for model in PAPER_MODELS],
        }


def compare_model(
    lm: LoadedModel,
    scenario: Scenario,
    field_name: str | None = None,
    new: str | None = None,
    *,
    spec: str | None = None,
    store: SkillStore | None = None,
    skill: str = SPLICE_SKILL,
    remedy: Remedy = DEFAULT_REMEDY,
    settings: EditSettings | None = None,
    progress: MessageProgress | None = None,
    step: Callable[[], None] | None = None,
) -> ModelRow:
    """One model's row: the edit report, the notes map, the read heads and one skill's splice, on one experiment
    (``settings``: the edit's, e.g. its minimum stale–oracle gap for a defined recovery)."""
    if lm.recurrent_layers:
        raise ComparisonError(
            f"{lm.fingerprint.name} is a hybrid (layers {lm.recurrent_layers} keep a recurrent state): its cache entries cannot "
            "be edited or patched, so it has no notes share, notes map or read heads to compare"
        )
    stages = _Stages(progress or (lambda message: None), step or (lambda: None))
    info, missing = lm.info(), stages.missing
    name = lm.fingerprint.name

    with stages.stage(f"{name}: edit report ({', '.join(COMPARED_STRATEGIES)})", "edit_report"):
        experiment = EditExperiment(lm, scenario, field_name, new, settings)
        report = experiment.report(COMPARED_STRATEGIES, fused=True)
        recoveries = {}
        for strategy, result in report.strategies.items():
            recoveries[strategy] = result.recovery.value if result.applicable and result.recovery is not None else None
            if recoveries[strategy] is None:
                missing[f"recoveries.{strategy}"] = result.reason or (result.recovery.reason if result.recovery else "not measured")
        if report.notes.share is None:
            missing["notes_share"] = report.notes.reason or "undefined"

    depth, cells = None, []
    with stages.stage(f"{name}: notes map", "notes_map", "notes_depth", ProbeError):
        depth, cells = notes_depth(probe_notes_map(experiment, top=NOTES_TOP), experiment.field_positions)
        if depth is None:
            missing["notes_depth"] = f"no token follows field {experiment.field!r}"

    heads, drop = None, None
    with stages.stage(f"{name}: read heads", "read_heads", "read_heads", ProbeError):
        probed = probe_heads(experiment)
        heads = read_heads(probed)
        drop = None if probed.top.recovery is None else 1 - probed.top.recovery
        if heads is None:
            missing["read_heads"] = "no head attends to the top notes"

    cosine, agree = None, None
    with stages.stage(f"{name}: splicing skill {skill}", "splice", "splice_cosine", KVScopeError):
        fidelity = compare(lm, with_skills(scenario, [skill], "start"), store or SkillStore(), remedy=remedy)
        cosine, agree = fidelity.agreement["cosine"], fidelity.decision_agree

    return ModelRow(
        model=name,
        spec=spec or name,
        parameters=info["parameters"],
        parameter_bytes=info["parameter_bytes"],
        dtype=info["dtype"],
        layers=info["layers"],
        heads=info["layers"] * info["attention_heads"],
        notes_share=report.notes.share,
        recoveries=recoveries,
        notes_depth=depth,
        read_heads=heads,
        splice_cosine=cosine,
        flips=report.flips,
        stale_label=report.stale.decision.label,
        oracle_label=report.oracle.decision.label,
        delta_margin=report.oracle.decision.margin - report.stale.decision.margin,
        headline=report.notes.headline(),
        notes_cells=cells,
        top_heads_recovery_drop=drop,
        splice_decision_agree=agree,
        missing=missing,
        ms=stages.ms,
    )


@dataclass
class _Stages:
    """:func:`compare_model`'s stages: each says what it does, is timed, advances the progress, and records an error
    it may meet as the value it could not measure."""

    say: Callable[[str], None]
    advance: Callable[[], None]
    missing: dict[str, str] = field(default_factory=dict)
    ms: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(
        self, message: str, timed: str, missed: str = "", errors: type[Exception] | tuple[type[Exception], ...] = ()
    ) -> Iterator[None]:
        """Say ``message``, time the block as ``ms[timed]``; an ``errors`` it raises becomes ``missing[missed]``."""
        self.say(message)
        watch = Stopwatch()
        try:
            yield
        except errors as error:
            self.missing[missed] = str(error)
        self.ms[timed] = watch.ms
        self.advance()


def check_specs(specs: Sequence[str]) -> list[str]:
    """The model specs to compare: one to ``MAX_MODELS``, each once (blank entries ignored)."""
    chosen = [spec.strip() for spec in specs if spec and spec.strip()]
    if not 1 <= len(chosen) <= MAX_MODELS:
        raise ComparisonError(f"compare 1 to {MAX_MODELS} models, got {len(chosen)}")
    repeated = sorted({spec for spec in chosen if chosen.count(spec) > 1})
    if repeated:
        raise ComparisonError(f"model {repeated[0]!r} is named twice: compare different models")
    return chosen


def compare_models(
    specs: Sequence[str],
    load: Callable[[str], LoadedModel],
    scenario: Scenario,
    field_name: str | None = None,
    new: str | None = None,
    *,
    stores: Callable[[str], SkillStore] | None = None,
    skill: str = SPLICE_SKILL,
    remedy: Remedy = DEFAULT_REMEDY,
    settings: EditSettings | None = None,
    progress: MessageProgress | None = None,
    steps: StepProgress = None,
) -> ModelComparison:
    """The same edit on each model, loaded by ``load(spec)`` one after another (each released before the next);
    ``stores(spec)`` gives a model's compiled-skill store (default: a fresh one)."""
    chosen = check_specs(specs)
    edited = scenario.field(field_name)  # a bad field or skill fails before any model loads
    if skill not in bundled_skills():
        raise ComparisonError(f"unknown skill {skill!r} to splice; bundled: {', '.join(sorted(bundled_skills()))}")
    new_value = edited.new if new is None else new
    say = progress or (lambda message: None)
    advance = ticker(steps, len(chosen) * len(STAGES))
    rows = []
    for index, spec in enumerate(chosen, start=1):
        say(f"model {index}/{len(chosen)}: loading {spec}")
        lm = load(spec)
        advance()
        store = stores(spec) if stores else SkillStore()
        rows.append(
            compare_model(
                lm,
                scenario,
                edited.name,
                new_value,
                spec=spec,
                store=store,
                skill=skill,
                remedy=remedy,
                settings=settings,
                progress=say,
                step=advance,
            )
        )
        del lm, store
        gc.collect()  # the model goes before the next one loads, unless the loader keeps it
    return ModelComparison(scenario.name, edited.name, edited.old, new_value, skill, remedy, rows)
