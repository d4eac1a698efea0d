"""The Learn tab's sentences: what the loaded model did in each step, computed from the run, beside the paper.

Paper figures (arXiv 2606.17107) are quoted as published, for 7–9B models; a small model can differ, and the
text says so whenever its numbers do.
"""

from __future__ import annotations

import html

from kvscope.engine.cache.decision import Decision
from kvscope.engine.comparison.models import PAPER_MODELS
from kvscope.engine.edit.report import EditReport, NotesShare
from kvscope.viz.text import remedy_words

FIGURE_LABELS = (  # what each step's figure shows (the Learn tab's figure labels)
    "Answer scores at the new value (clean prefill)",
    "Decision margin by strategy: field_only vs full_downstream",
    "Decision margin by strategy: erratum vs field_erratum",
    "Top next tokens: spliced vs recomputed",
)
PAPER_FIELD_ONLY = "field-only recovery ≈ 0 at 7–9B ({})".format(  # the paper's numbers, kept in one table
    ", ".join(
        f"{model.field_only_recovery:.3f}".replace("-", "−") + f" {model.model}"
        for model in sorted(PAPER_MODELS, key=lambda model: model.field_only_recovery)
    )
)
PAPER_ERRATUM = "field+erratum P(correct) 1.00, matching hoist-to-end; erratum alone can revert when the field is buried early"
PAPER_SPLICE = "logit cosine 0.90–0.999 against full recompute over twelve models; decisions preserved for 1–4 skills"
SCALE_CAVEAT = "The paper measured 7–9B models; on a smaller model the field is still partly read directly, so the notes effect is partial."
SPLICE_CAVEAT = (
    "Splice fidelity differs from model to model (that range spans twelve of them) and with the remedy; "
    "what a deployment needs is the spliced decision to agree with the recomputed one."
)


def _paper(text: str, caveat: str = SCALE_CAVEAT) -> str:
    return f'<p class="kv-paper"><small><b>Paper:</b> {html.escape(text)}. {html.escape(caveat)}</small></p>'


def _recovery(report: EditReport, name: str) -> float | None:
    result = report.strategies.get(name)
    if result is None or not result.applicable or result.recovery is None:
        return None
    return result.recovery.value


def decisions_html(model: str, old_value: str, new_value: str, old: Decision, new: Decision) -> str:
    """Step 1: the decision at the old value (``old``, the stale run) and at the new one (``new``, the oracle), both
    clean prefills computed by the caller."""
    moved = "changes" if old.label != new.label else "does <b>not</b> change"
    return (
        f"<p>{html.escape(model)}: with <b>{html.escape(old_value)}</b> the model answers <b>{html.escape(old.label)}</b> "
        f"(margin {old.margin:+.2f}); with <b>{html.escape(new_value)}</b> it answers <b>{html.escape(new.label)}</b> "
        f"(margin {new.margin:+.2f}): a clean prefill {moved} the decision.</p>"
    )


def share_percent(notes: NotesShare) -> str:
    """The notes share as the Notes tab's headline rounds it (within 0–100%)."""
    return f"{max(0.0, min(1.0, notes.share or 0.0)):.0%}"


def strategies_html(report: EditReport, step: int) -> str:
    """Steps 2 and 3: what field_only / full_downstream, or erratum / field_erratum, did on this model."""
    notes = report.notes
    if step == 1:
        field = notes.field_recovery
        if field is None:
            said = f"Recovery is undefined here: {notes.reason}."
        elif notes.field_alone_flips:
            said = (
                f"On this model recomputing the field alone recovers {field:.2f} of the decision and already reaches "
                f"<b>{html.escape(notes.field_only_label)}</b>: it still reads much of the field directly "
                f"(notes carry {share_percent(notes)})."
            )
        else:
            said = (
                f"On this model recomputing the field alone recovers only {field:.2f}: the decision stays "
                f"<b>{html.escape(notes.field_only_label)}</b> because {share_percent(notes)} of it sits in the stale notes; "
                f"recomputing everything after the field recovers {_format(_recovery(report, 'full_downstream'))}."
            )
        return f"<p>{said}</p>" + _paper(PAPER_FIELD_ONLY)
    erratum, both = _recovery(report, "erratum"), _recovery(report, "field_erratum")
    said = (
        f"On this model the erratum alone recovers {_format(erratum)} and field + erratum {_format(both)} "
        f"(1 = a clean prefill with the new value), by appending {report.strategies['erratum'].tokens_recomputed} tokens "
        f"to a {report.context_tokens}-token context."
    )
    return f"<p>{said}</p>" + _paper(PAPER_ERRATUM)


def splice_html(summary: dict) -> str:
    """Step 4: the splice's fidelity and time to first token against a full recompute (``SpliceFidelity.as_dict()``), and
    what its remedy recomputed."""
    agree = "agrees" if summary["decision_agree"] else "differs"
    remedy = summary["remedy"]
    said = (
        f"Spliced vs recomputed: logit cosine {summary['cosine']:.4f}, KL {summary['kl']:.4f}, decision {agree}; "
        f"time to first token {summary['ttft_ms']['splice']:.0f} ms vs {summary['ttft_ms']['full']:.0f} ms "
        f"(×{summary['speedup']}) for {summary['skill_tokens']} spliced of {summary['context_tokens']} context tokens. "
        f"The remedy {remedy['name']} recomputed {summary['recomputed_tokens']} of the {summary['skill_tokens']} skill tokens "
        f"({summary['recomputed_fraction']:.0%}): {remedy_words(remedy)}."
    )
    return f"<p>{html.escape(said)}</p>" + _paper(PAPER_SPLICE, SPLICE_CAVEAT)


def _format(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
