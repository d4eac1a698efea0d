"""An audited field change as a Notes-tab scenario whose two answers are what the model itself says.

A request's last message is rarely a yes/no question (for a coding agent it is test output), so reading "yes" against
"no" after it measures a decision the model does not make. Instead both clean prefills of the scenario (the field's
old and new value) are decoded greedily: where the two continuations first differ, each one up to and including that
token is an answer, so the margin is the model's own choice between them. Where they never differ within the tokens
generated, the answers are the two likeliest first tokens, and :attr:`NotesScenario.moves` says whether the change
moves their margin at all. Costs two prefills and at most ``2 × tokens`` decode steps.

:func:`notes_choices` runs that pre-check on every field the measured turns changed (the latest turn of each name), so
the user picks which change to open knowing beforehand whether it moves the model's answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.measure.turn import AuditReport, changed_field, scenario_toml
from kvscope.engine.cache.decision import RECOVERY_MIN_GAP, Decision, logit_agreement, recovery_gap
from kvscope.engine.cache.loaded import LoadedModel, dtype_name
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.runs import run_scenario
from kvscope.engine.progress import MessageProgress, StepMessage
from kvscope.engine.scenario import Scenario, encode, render

NOTES_TOKENS = 16  # greedy tokens decoded per value to find where the model's answers part
MOST_CHOICES = 6  # changed fields pre-checked per audit (the latest ones): each costs two prefills
DIVERGENCE = "divergence"  # answers: the two greedy continuations up to where they first differ
ALTERNATIVES = "first-token alternatives"  # answers: the two likeliest first tokens (the continuations never differ)


@dataclass(frozen=True)
class Continuation:
    """One value's clean prefill of the scenario: its greedy text and its decision between the two answers."""

    value: str
    text: str
    decision: Decision


@dataclass(frozen=True)
class NotesScenario:
    """The scenario TOML for the Notes tab, with the evidence for its answers."""

    toml: str
    field: str
    answers: tuple[str, str]
    source: str  # DIVERGENCE or ALTERNATIVES
    divergence: int | None  # the generated token where the two continuations first differ (None: they never do)
    next_token_kl: float  # KL(new ‖ old) of the first answer token's distribution
    old: Continuation
    new: Continuation
    gap: float = RECOVERY_MIN_GAP  # the smallest change a recovery is measured against in the model's dtype (``recovery_gap``)

    @property
    def margin_change(self) -> float:
        """The new value's margin minus the old one's."""
        return self.new.decision.margin - self.old.decision.margin

    @property
    def moves(self) -> bool:
        """Whether the change moves the decision by at least the recovery gap (the Notes tab's bar in this dtype)."""
        return abs(self.margin_change) >= self.gap

    def words(self) -> str:
        """What the model does with the change, and what the Notes tab will read (plain text)."""
        margins = f"margin {self.old.decision.margin:+.2f} → {self.new.decision.margin:+.2f}"
        if self.source == DIVERGENCE:
            head = (
                f"With {self.field} changed, the model's greedy answer changes at generated token {self.divergence + 1}: "
                f"{self.answers[0]!r} (old value) vs {self.answers[1]!r} (new value); {margins}, next-token KL {self.next_token_kl:.3g}."
            )
        else:
            head = (
                f"The change of {self.field} does not move the greedy output in {NOTES_TOKENS} tokens (next-token KL "
                f"{self.next_token_kl:.3g}); the Notes tab reads the two likeliest first tokens {self.answers[0]!r} vs "
                f"{self.answers[1]!r}, {margins}."
            )
        if not self.moves:
            bar = f"{self.gap:.2f} (the recovery bar in the model's dtype)"
            return f"{head} The margin moves by less than {bar}: there is no decision here for the notes to carry."
        return head


def _continue(lm: LoadedModel, scenario: Scenario, field: str, value: str, tokens: int) -> tuple[Notebook, list[int], torch.Tensor]:
    """The clean prefill with ``field`` set to ``value``, its greedy ids after the question and the first logits."""
    prompt = render(scenario, lm.tokenizer, {field: value})
    notebook = Notebook.from_prompt(lm, prompt)
    _, logits = notebook.step(prompt.decode_ids, "question")
    _, generated = notebook.greedy(logits, tokens, lm.stop_ids)
    return notebook, generated, logits


def _answers(
    lm: LoadedModel, old_ids: Sequence[int], new_ids: Sequence[int], first_logits: torch.Tensor
) -> tuple[tuple[str, str], int | None]:
    """Two distinct answer surfaces and where they part: the continuations up to and including their first differing
    token, else (None) the two likeliest first tokens."""
    decode = lm.tokenizer.decode
    index = next((i for i, (old, new) in enumerate(zip(old_ids, new_ids)) if old != new), None)
    if index is not None:
        pair = decode(list(old_ids[: index + 1])), decode(list(new_ids[: index + 1]))
        exact = all(
            encode(lm.tokenizer, text) == list(ids[: index + 1]) for text, ids in zip(pair, (old_ids, new_ids))
        )  # scored as generated
        if exact and all(text.strip() for text in pair) and pair[0].strip() != pair[1].strip():
            return pair, index
    unique: dict[str, str] = {}  # stripped text -> surface, likeliest first
    for token in first_logits.float().topk(16).indices.tolist():
        text = decode([token])
        if text.strip():
            unique.setdefault(text.strip(), text)
    surfaces = list(unique.values())
    return (surfaces[0], surfaces[1]), None


def notes_scenario(
    lm: LoadedModel,
    report: AuditReport,
    *,
    request: int | None = None,
    field: str | None = None,
    tokens: int = NOTES_TOKENS,
    progress: MessageProgress = None,
) -> NotesScenario:
    """Changed field ``field`` of request ``request`` (default: the last turn with a changed field, its first) as a
    scenario (:func:`scenario_toml`), its answers read off the model (module docstring); the user's own labels go
    through :func:`scenario_toml` directly."""
    base = scenario_toml(report, ("yes", "no"), request=request, field=field)  # placeholders, replaced by the model's answers below
    scenario = Scenario.from_toml(base, source="audited request")
    field, spec = next(iter(scenario.fields.items()))
    generated, first = {}, {}
    for side, value in (("old", spec.old), ("new", spec.new)):
        if progress:
            progress(f"reading the model's own answers: clean prefill with the {side} value of {field} ({value!r})")
        _, generated[side], first[side] = _continue(lm, scenario, field, value, tokens)
    answers, divergence = _answers(lm, generated["old"], generated["new"], first["old"])
    text = dataclasses.replace(scenario, answers={answer.strip(): (answer,) for answer in answers}).to_toml()  # each its own label
    final = Scenario.from_toml(text, source="audited request")
    stale = run_scenario(lm, final, {field: spec.old})  # the Notes tab's reads of this scenario: the same margins
    decisions = {"old": stale.decision, "new": run_scenario(lm, final, {field: spec.new}, reuse=stale).decision}
    sides = {
        side: Continuation(value, lm.tokenizer.decode(generated[side]), decisions[side])
        for side, value in (("old", spec.old), ("new", spec.new))
    }
    source = ALTERNATIVES if divergence is None else DIVERGENCE
    kl = logit_agreement(first["new"], first["old"])["kl"]
    gap = recovery_gap(dtype_name(lm.dtype))  # the bar the Notes tab's edit measures against, so both say the same
    return NotesScenario(text, field, tuple(final.answers), source, divergence, kl, sides["old"], sides["new"], gap)


@dataclass(frozen=True)
class NotesChoice:
    """One changed field Open in Notes can open: where it changed, and its pre-check (``scenario``), or why it cannot be
    a scenario (``refusal``: e.g. the value sits in the last message, the scenario's question)."""

    request: int
    field: str
    old: str
    new: str
    scenario: NotesScenario | None
    refusal: str | None = None

    @property
    def key(self) -> str:
        """The menu's value: ``request:field``."""
        return f"{self.request}:{self.field}"

    @property
    def moves(self) -> bool:
        """Whether the pre-check found that the change moves the model's answer."""
        return self.scenario is not None and self.scenario.moves

    def verdict(self) -> str:
        """The pre-check in a few words (the menu shows it beside the field)."""
        if self.scenario is None:
            return "cannot be opened: it sits in the question"
        if self.scenario.source == DIVERGENCE:
            return f"moves the answer (margin {self.scenario.margin_change:+.2f})" if self.moves else "changes the answer, barely"
        return f"moves the first token (margin {self.scenario.margin_change:+.2f})" if self.moves else "does not move the output"

    def label(self) -> str:
        """The menu's label: request, field, old → new, and the pre-check's verdict."""
        return f"request {self.request} · {self.field}: {_short(self.old)} → {_short(self.new)} · {self.verdict()}"

    def words(self) -> str:
        """The pre-check in a sentence (plain text)."""
        return self.scenario.words() if self.scenario is not None else self.refusal or ""


def _short(text: str, limit: int = 24) -> str:
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")


def notes_choices(
    lm: LoadedModel, report: AuditReport, *, most: int = MOST_CHOICES, tokens: int = NOTES_TOKENS, progress: MessageProgress = None
) -> tuple[NotesChoice, ...]:
    """Every field the measured turns changed, each at the latest turn that changed it (at most ``most``, the latest),
    in request order, each with its pre-check (:func:`notes_scenario`) or why it cannot be a scenario; ``progress`` hears
    each prefill's start as a :class:`StepMessage` (prefills done of two per field)."""
    latest: dict[str, int] = {}
    for turn in report.turns:
        for change in turn.fields:
            latest[change.name] = turn.request
    picked = sorted(latest.items(), key=lambda item: item[1])[-most:] if most > 0 else []
    choices, total = [], 2 * len(picked)  # two prefills per field: its old value, then its new one
    started = iter(range(total))
    said = (lambda text: progress(StepMessage(text, next(started), total))) if progress else None
    for field, request in sorted(picked, key=lambda item: (item[1], _position(report, item[1], item[0]))):
        _, change = changed_field(report, request, field)
        try:
            scenario, refusal = notes_scenario(lm, report, request=request, field=field, tokens=tokens, progress=said), None
        except RequestLogError as error:
            scenario, refusal = None, str(error)
        choices.append(NotesChoice(request, field, change.old, change.new, scenario, refusal))
    return tuple(choices)


def _position(report: AuditReport, request: int, field: str) -> int:
    return changed_field(report, request, field)[1].start


def preferred_choice(choices: Sequence[NotesChoice]) -> NotesChoice | None:
    """What Open in Notes opens unless the user picks another: the latest change that moves the answer, else the latest
    that can be opened, else the latest."""
    moving = [choice for choice in choices if choice.moves]
    openable = [choice for choice in choices if choice.scenario is not None]
    return next((found[-1] for found in (moving, openable, list(choices)) if found), None)
