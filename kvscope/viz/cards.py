"""HTML cards for edit strategies (every piece of text escaped: scenario and model text is user data)."""

from __future__ import annotations

import html

from kvscope.engine.cache.decision import RECOVERY_WORDS
from kvscope.engine.edit.report import EditReport, NotesShare
from kvscope.engine.edit.strategies import REGISTRY, StrategyResult

CARD_CSS = """
<style>
.kv-cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:8px}
.kv-card{border:1px solid #d0d7de;border-radius:8px;padding:8px 10px;font-size:13px;line-height:1.35}
.kv-card h4{margin:0 0 4px 0;font-size:14px}
.kv-card.flip{border-color:#2a9d8f;background:#f0faf8}
.kv-card.stay{border-color:#e76f51;background:#fdf3f0}
.kv-card.na{opacity:.55;background:#f6f8fa}
.kv-card.ref{border-style:dashed}
.kv-card .big{font-size:18px;font-weight:600}
.kv-noise.within{border-left:4px solid #e76f51;padding-left:8px}
.kv-notes{font-size:16px;margin:4px 0 8px 0;padding:6px 10px;border-left:4px solid #6a4c93;background:#f6f2fb}
</style>
"""


def _ms(result: StrategyResult) -> str:
    """Wall time; '≈' marks a share of a fused forward (see EditExperiment.read_together)."""
    return f"≈{result.ms:.0f} ms" if result.ms_is_share else f"{result.ms:.0f} ms"


def _card(result: StrategyResult, oracle_label: str, reference: bool = False) -> str:
    name = html.escape(result.name)
    if not result.applicable:
        reason = html.escape(result.reason or "")
        return f'<div class="kv-card na" data-strategy="{name}">{_title(result)}not applicable<br><small>{reason}</small></div>'
    decision = result.decision
    state = "flip" if decision.label == oracle_label else "stay"
    recovered = "—" if result.recovery is None or result.recovery.value is None else f"{result.recovery.value:.2f}"
    note = "" if result.recovery is None or result.recovery.reason is None else f"<br><small>{html.escape(result.recovery.reason)}</small>"
    return (
        f'<div class="kv-card {state}{" ref" if reference else ""}" data-strategy="{name}" data-decision="{html.escape(decision.label)}" '
        f'data-margin="{decision.margin:+.2f}">'
        f'{_title(result)}<span class="big">{html.escape(decision.label)}</span> margin {decision.margin:+.2f}<br>'
        f'<span title="{html.escape(RECOVERY_WORDS)}">recovery {recovered}</span> · {result.tokens_recomputed} tok · {_ms(result)}'
        f"{note}</div>"
    )


def _title(result: StrategyResult) -> str:
    """The card's heading: the strategy's name, its registry summary on hover."""
    summary = REGISTRY[result.name].summary if result.name in REGISTRY else ""
    return f'<h4 title="{html.escape(summary)}">{html.escape(result.name)}</h4>'


def strategy_cards_html(report: EditReport, dtype: str | None = None) -> str:
    """One card per strategy (green = reaches the oracle's decision), stale and oracle as dashed references, under the
    notes share's headline (naming ``dtype``, the one the numbers were computed in, when given)."""
    oracle_label = report.oracle.decision.label
    cards = [_card(report.stale, oracle_label, reference=True), _card(report.oracle, oracle_label, reference=True)]
    cards += [_card(result, oracle_label) for name, result in report.strategies.items() if name not in ("stale", "oracle")]
    headline = (
        f"<p><b>{html.escape(report.field)}</b>: {html.escape(report.old)} → {html.escape(report.new)} · "
        + (
            "a clean prefill <b>flips</b> the decision"
            if report.flips
            else "a clean prefill does <b>not</b> flip the decision on this model"
        )
        + "</p>"
    )
    legend = f'<p class="kv-legend"><small>{html.escape(RECOVERY_WORDS)} Hover a name for what the strategy does.</small></p>'
    body = headline + noise_html(report.noise_words(), report.within_noise) + '<div class="kv-cards">' + "".join(cards) + "</div>"
    return CARD_CSS + notes_headline_html(report.notes, dtype) + body + legend


def noise_html(words: str, within: bool) -> str:
    """The noise floor of the margins shown (``words``: the engine's sentence; nothing in float32), marked where the
    change's effect is within it."""
    if not words:
        return ""
    marked = " within" if within else ""
    return f'<p class="kv-noise{marked}" id="noise-floor" data-within="{str(within).lower()}"><small>{html.escape(words)}</small></p>'


def notes_headline_html(notes: NotesShare, dtype: str | None = None) -> str:
    """The notes share as a headline sentence, with the numbers it comes from and the dtype they were computed in (the
    share moves by a few points between float32 and bfloat16: the README quotes float32)."""
    share = "" if notes.share is None else f"{notes.share:.4f}"
    evidence = "" if notes.field_recovery is None else f" <small>(field_only recovery {notes.field_recovery:.2f}"
    if evidence and notes.downstream_recovery is not None:
        evidence += f"; the downstream notes patched in alone recover {notes.downstream_recovery:.2f}"
    if evidence and dtype:
        evidence += f"; computed in {html.escape(dtype)}"
    evidence += ")</small>" if evidence else ""
    return f'<p class="kv-notes" id="notes-headline" data-share="{share}">{html.escape(notes.headline())}{evidence}</p>'
