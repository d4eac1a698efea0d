"""The app's text panels as Markdown: pure functions from the engine's results (no model call, no I/O).

Every user or model string (a spec, a scenario value, a token, a label) goes through
:func:`kvscope.viz.common.markdown_literal`, so no Markdown or HTML can be injected through it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from kvscope.engine.audit.measure.notes_scenario import NotesChoice, NotesScenario
from kvscope.engine.audit.policy.document import Policy
from kvscope.engine.cache.decision import DECISIVE_MARGIN, Decision
from kvscope.engine.cache.selftest import SelfTestReport
from kvscope.engine.checks.support import SupportRow
from kvscope.engine.compose.calibration import CalibrationPlan
from kvscope.engine.compose.choice import RemedyChoice
from kvscope.engine.compose.fidelity import SpliceFidelity
from kvscope.engine.compose.pictures import ImageFidelity
from kvscope.engine.compose.remedy import RANKING_WORDS, REMEDY_GRAMMAR
from kvscope.engine.edit.strategies import REGISTRY
from kvscope.engine.words import counted
from kvscope.viz.common import markdown_literal

AUTO_WORDS = (
    f"auto: this model's own calibration, measured once per model and device ({CalibrationPlan().words()}): it shows "
    "each step with the time left as estimated from the steps measured so far, and Cancel stops it."
)


def _values(values: Mapping[str, str]) -> str:
    return ", ".join(f"{markdown_literal(name)} = {markdown_literal(value)}" for name, value in values.items())


# ---------------------------------------------------------------------------- model tab
def model_card_markdown(info: Mapping, cache_layout: str, selftest: SelfTestReport | None = None, support: SupportRow | None = None) -> str:
    """The model card (``LoadedModel.info()``, its cache layout, self-test and support row), values escaped."""
    fingerprint = info["fingerprint"]
    rope = info.get("rope") or "none (learned positions: splicing is off)"
    rows = {
        "Model": fingerprint["name"],
        "Source": info.get("source"),
        "Architecture": info.get("architecture"),
        "Layers / heads / KV heads": f"{info.get('layers')} / {info.get('attention_heads')} / {info.get('kv_heads')}",
        "Head dim": info.get("head_dim"),
        "Cached per token and layer": cache_layout,
        "RoPE": json.dumps(rope) if isinstance(rope, dict) else rope,
        "Device / dtype": f"{info.get('device')} / {fingerprint['dtype']}",
        "Why this dtype": info.get("dtype_reason"),
        "Parameters": f"{info.get('parameters', 0) / 1e6:.1f} M ({info.get('parameter_bytes', 0) / 2**30:.2f} GiB)",
        "Fingerprint": fingerprint["config_hash"],
    }
    if selftest is not None:
        rows["Cache self-test"] = selftest.summary()
    if support is not None:
        rows["Family"] = support.family
        rows["Operations on this model"] = support.summary()
    return "\n".join(f"- **{key}**: {markdown_literal(str(value))}" for key, value in rows.items())


def memory_markdown(profile: Mapping, loaded: Sequence[str], rss_bytes: int, shared: Mapping[str, int], kept: Mapping[str, float]) -> str:
    """What a server keeps in memory against its budgets: ``profile`` as ``HostingProfile.as_dict()``, the loaded
    model specs, the process RSS, shared results by kind (``ModelRegistry.memory()``) and ``SessionStore.stats()``."""
    mb = lambda count: f"{count / 2**20:,.1f} MB"  # noqa: E731
    models = ", ".join(markdown_literal(spec) for spec in loaded) or "none"
    rows = [
        f"**Profile** {markdown_literal(profile['name'])} · models loaded: {models} (at most {profile['model_capacity']}"
        f"{', default pinned' if profile['pin_default_model'] else ''}) · process RSS {mb(rss_bytes)}",
        f"**Sessions** {kept['sessions']} holding {mb(kept['bytes'])} of {mb(kept['budget_bytes'])} (idle ones dropped after "
        f"{kept['ttl_s'] / 60:.0f} min) · **baselines** {mb(shared['baselines'])} of {mb(profile['baseline_budget_bytes'])} · "
        f"**compiled skills** {mb(shared['skills'])}",
    ]
    limits = [
        f"context ≤ {profile['max_context_tokens']:,} tokens" if profile["max_context_tokens"] else "any context length",
        f"≤ {profile['request_seconds']:g} s of model time per request" if profile["request_seconds"] else "no time limit",
        f"≤ {profile['max_agent_turns']} agent turns",
        f"exports ≤ {profile['export_max_bytes'] / 2**20:.0f} MB",
    ]
    rows.append("**Limits** " + " · ".join(limits))
    return "  \n".join(rows)


# ---------------------------------------------------------------------------- notes tab
def baseline_markdown(values: Mapping[str, str], decision: Decision, context_tokens: int) -> str:
    """The current decision of the prepared scenario (prefilled at its old ``values``): the run the edit reuses as its
    stale state, so this margin is the stale card's."""
    return (
        f"Now ({_values(values)}): the model answers **{markdown_literal(decision.label)}** (margin {decision.margin:+.2f}); "
        f"{context_tokens} context tokens cached."
    )


def hybrid_baseline_markdown(values: Mapping[str, str], decision: Decision, context_tokens: int, recurrent_layers: Sequence[int]) -> str:
    """The current decision on a hybrid (read on its own append-only cache), and why in-place edits are refused."""
    return (
        f"Now ({_values(values)}): the model answers **{markdown_literal(decision.label)}** (margin {decision.margin:+.2f}), "
        f"read on its own cache of {context_tokens} tokens. It is a hybrid (recurrent layers {list(recurrent_layers)}): "
        "edits that rewrite cache entries are refused here; `python -m kvscope edit` reads the erratum against a clean prefill."
    )


def knockout_markdown(positions: Sequence[int], token_texts: Sequence[str], knocked: Decision, oracle: Decision, stale: Decision) -> str:
    """The decision after hiding ``positions`` (the first 12 named with their tokens), beside the oracle and stale ones."""
    shown = ", ".join(f"{p}:{token_texts[p]!r}" for p in positions[:12] if p < len(token_texts))
    return (
        f"Knocked out {counted(len(positions), 'position')} ({markdown_literal(shown)}). Decision **{markdown_literal(knocked.label)}** "
        f"(margin {knocked.margin:+.2f}); without knockout **{markdown_literal(oracle.label)}** ({oracle.margin:+.2f}), "
        f"stale **{markdown_literal(stale.label)}** ({stale.margin:+.2f})."
    )


def glossary(summaries: Mapping[str, str], names: Sequence[str] | None = None) -> str:
    """Each name (of ``names``, default all) with its registry's one-line summary, as one plain-text info line."""
    return " · ".join(f"{name}: {summaries[name]}" for name in (summaries if names is None else names))


def strategy_glossary(names: Sequence[str]) -> str:
    """The edit strategies ``names`` with their registry summaries (:func:`glossary`)."""
    return glossary({name: REGISTRY[name].summary for name in names})


# ---------------------------------------------------------------------------- composer tab
def remedy_words(remedy: Mapping) -> str:
    """What a remedy (``Remedy.as_dict()``) recomputes, in words."""
    parts = ["the skill compiled after the scenario's own system prompt"] if remedy["prefix"] else []
    if remedy["seam"]:
        first = "its first token" if remedy["seam"] == 1 else f"its first {remedy['seam']} tokens"
        parts.append(f"{first} recomputed against the real prefix (seam)")
    if remedy.get("tail"):
        parts.append(f"its last {remedy['tail']} tokens recomputed against their real predecessors")
    if remedy["select"] == "aggregators":
        parts.append("every aggregator token (punctuation, line breaks) recomputed")
    elif remedy["select"] in RANKING_WORDS:
        budget = f"at most {remedy['fraction']:.0%}" if remedy.get("cover") else f"{remedy['fraction']:.0%}"
        cover = f", stopping once they hold {remedy['cover']:.0%} of the ranking's score" if remedy.get("cover") else ""
        parts.append(f"{budget} of its other tokens recomputed: those {RANKING_WORDS[remedy['select']]}{cover}")
    if remedy.get("ape"):
        ape = remedy["ape"]
        parts.append(
            f"every later token reads it through APE's rescaled attention (temperature {ape['temperature']:g}, scale {ape['scale']:g})"
        )
    return "; ".join(parts) or "the stored K/V spliced as they are, nothing recomputed"


def remedy_info(default: str, stored: str | None = None, choice: RemedyChoice | None = None, *, model: str | None = None) -> str:
    """What the default remedy costs and buys where it was measured (``stored``: a stored N-skill study's file, or
    ``calibration``: the model's own), why it is the default, the fastest remedy beside it, then the remedy grammar
    (plain text). ``model`` names whose default it is."""
    whose = f" for {model.split(':')[0]}" if model else ""  # the alias of a fingerprint name such as embedded:Qwen2.5-…
    if choice is None or default not in {point.name for point in choice.points}:
        return f"Default{whose} {default}: not measured for this model yet. {AUTO_WORDS} {REMEDY_GRAMMAR}"
    fastest = choice.fastest
    beside = f" Fastest: {fastest.words()}." if fastest.name != default else ""
    why = "" if choice.remedy == default else f" (that study's rule now picks {choice.remedy})"
    reason = f" Why: {choice.reason}." if choice.remedy == default else ""
    where = "this model's stored calibration" if stored == "calibration" else f"the stored N-skill study ({stored})"
    return f"Default{whose} {choice.point(default).words()}, in {where}{why}.{reason}{beside} {AUTO_WORDS} {REMEDY_GRAMMAR}"


def remedy_summary(default: str, choice: RemedyChoice | None = None, *, model: str | None = None, measured_at: str | None = None) -> str:
    """One line under the remedy menu: the model's default and what it buys where it was measured (``measured_at``: the
    context lengths of the study's speed-ups); the rest is in :func:`remedy_info`."""
    measured = {point.name: point for point in choice.points} if choice else {}
    numbers = measured[default].numbers() if default in measured else "not measured for this model yet"
    where = f" on {measured_at}" if measured_at and default in measured else ""
    whose = f" for {model.split(':')[0]}" if model else ""
    return f"Default{whose} {default}: {numbers}{where}. What each part means, and why this default: below the menu."


def remedy_menu(
    default: str, auto: str, names: Sequence[str], choice: RemedyChoice | None = None, measured_at: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """(label, spec) pairs: the default, ``auto``, then ``names``; a remedy the stored study measured shows its decisive
    agreement and median speedup there against a full recompute (and, from ``measured_at``, the context lengths it was
    measured on), one it did not says so."""
    measured = {point.name: point for point in choice.points} if choice else {}
    where = measured_at or {}

    def label(name: str) -> str:
        point = measured.get(name)
        numbers = point.numbers() if point else "not measured for this model yet"
        lengths = f" on {where[name]}" if point and name in where else ""
        return f"{name} — {numbers}{lengths}{' (default)' if name == default else ''}"

    return [(label(default), default), (f"{auto} — this model's calibrated choice (measured once)", auto)] + [
        (label(name), name) for name in names if name != default
    ]


def decision_words(fidelity: SpliceFidelity) -> str:
    """Agreement of the spliced decision with the recomputed one, ties named as such."""
    labels = f"{markdown_literal(fidelity.spliced.label)} vs {markdown_literal(fidelity.recomputed.label)}"
    error = f"margin error {fidelity.match.margin_error:+.3f}"
    if fidelity.match.agree is None:
        return f"**decision** the recomputed margin {fidelity.recomputed.margin:+.3f} is a tie ({labels}, {error})"
    return f"**decision** {'agrees' if fidelity.match.agree else 'differs'} ({labels}, {error})"


def ttft_words(fidelity: SpliceFidelity) -> str:
    """Both times to first token, what each includes and how they were measured (one line of Markdown)."""
    splice, full = fidelity.ttft["splice"], fidelity.ttft["full"]
    rounds = f"median of {splice.reps} round{'s' if splice.reps > 1 else ''} (min {splice.min:.0f} / {full.min:.0f} ms)"
    measured = (
        "full recompute timed earlier in this study" if fidelity.reference_reused else f"both timed in this run, alternating, {rounds}"
    )
    return (
        f"**TTFT** splice {splice.median:.0f} ms (prefill of the text around the skills + the remedy's recompute + "
        f"reading the stored skill K/V) vs full {full.median:.0f} ms (prefill of all {fidelity.context_tokens} context tokens): "
        f"speedup ×{fidelity.speedup:.2f} (full ÷ splice); {measured}; one-time work apart: skills compiled in {fidelity.compile_ms:.0f} ms"
    )


def compose_metrics_markdown(fidelity: SpliceFidelity) -> str:
    """A splice against the full recompute: logits, decision, TTFT and what the remedy recomputed."""
    data = fidelity.as_dict()
    ranked = "; ranked against the full recompute, so no TTFT saving in deployment" if fidelity.remedy.needs_reference else ""
    return (
        f"**cosine** {data['cosine']:.4f} · **KL** {data['kl']:.4f} · "
        f"**top-1** {'agree' if data['top1_agree'] else 'differ'} · **top-5 overlap** {data['top5_agree']:.0%} · "
        f"{decision_words(fidelity)}  \n"
        f"{ttft_words(fidelity)} · "
        f"{data['skill_tokens']} of {data['context_tokens']} context tokens spliced; remedy {markdown_literal(fidelity.remedy.name)} "
        f"recomputed {data['recomputed_tokens']} of them ({data['recomputed_fraction']:.1%}){ranked}  \n"
        f"*{markdown_literal(fidelity.remedy.name)}:* {markdown_literal(remedy_words(data['remedy']))}"
    )


def image_metrics_markdown(result: ImageFidelity) -> str:
    """A spliced picture against the recompute from its pixels: logits, decision, TTFT and the picture's geometry."""
    data = result.as_dict()
    labels = f"{markdown_literal(result.spliced.label)} vs {markdown_literal(result.recomputed.label)}"
    verdict = "a tie in the recomputed decision" if result.match.agree is None else "agrees" if result.match.agree else "differs"
    return (
        f"**cosine** {data['cosine']:.4f} · **KL** {data['kl']:.4f} · "
        f"**top-1** {'agree' if data['top1_agree'] else 'differ'} · "
        f"**decision** {verdict} ({labels}, margin error {result.match.margin_error:+.3f})  \n"
        f"**TTFT** splice {data['ttft_ms']['splice']:.0f} ms vs full {data['ttft_ms']['full']:.0f} ms with the vision tower "
        f"(×{data['speedup']}) · "
        f"picture {data['image_tokens']} tokens over {data['rope_span']} rope positions, moved {counted(data['shift'], 'position')}, "
        f"first {data['seam']} recomputed"
    )


def study_markdown(data: Mapping) -> str:
    """One line per remedy of an N-skill study (``Study.as_dict()``): agreement on decisive cases, ties, margin error,
    recompute share, TTFT; then the best deployable remedy."""
    count = len(data["cases"])
    lines = [
        f"**{count} composed prompt{'' if count == 1 else 's'}**; agreement counts only cases whose recomputed "
        f"|margin| ≥ {DECISIVE_MARGIN}."
    ]
    for name, row in data["summary"].items():
        agreement = f"{row['agree_decisive']}/{row['decisive']} decisive agree" if row["decisive"] else "no decisive case"
        diagnostic = " (ranked against the full recompute: diagnostic)" if row["needs_reference"] else ""
        lines.append(
            f"- {markdown_literal(name)}: {agreement}, {row['ties']} ties · "
            f"mean |margin error| {row['mean_abs_margin_error']:.3f} · median cosine {row['cosine']['median']:.4f} · "
            f"recomputes {row['recomputed_fraction']:.1%} of skill tokens · "
            f"TTFT ×{row['speedup']['median']:.2f}{diagnostic}"
        )
    best = data.get("best")
    lines.append(
        f"**Best deployable here:** {markdown_literal(best)}" if best else "**No deployable remedy agrees on every decisive case here.**"
    )
    return "\n".join(lines)


def open_in_notes_markdown(notes: NotesScenario | str | None) -> str:
    """What Open in Notes would study, said before it is offered: the model's own answers and whether the change moves
    them, or why there is nothing to open (``notes`` is then that reason)."""
    if notes is None:
        return ""
    if isinstance(notes, str):
        return f"**Open in Notes:** nothing to open — {markdown_literal(notes)}."
    return f"**Open in Notes:** {markdown_literal(notes.words())}"


def notes_choice_markdown(choices: Sequence[NotesChoice], key: str) -> str:
    """The picked changed field's pre-check, said before Open in Notes runs it: what the model does with the change, and
    where the change does not move the answer (or cannot be opened), the fields whose change does."""
    picked = next(choice for choice in choices if choice.key == key)
    where = f"*{markdown_literal(picked.field)}* (request {picked.request})"
    head = f"**Open in Notes:** {where} — {markdown_literal(picked.words())}"
    if picked.moves:
        return head
    moving = [choice for choice in choices if choice.moves]
    others = ", ".join(f"*{markdown_literal(choice.field)}* (request {choice.request})" for choice in moving)
    lead = "**This change does not move the model's answer.**" if picked.scenario is not None else "**This field cannot be opened.**"
    offer = f"Pick one whose change does: {others}." if moving else "No changed field of this audit moves the model's answer."
    return f"{head}  \n{lead} {offer}"


POLICY_DEPLOY_WORDS = (
    "To apply it where the traffic runs: put `config.yaml` beside `deploy/litellm/kvscope_hook.py` (KVScope's repository), "
    "set its model and `api_base` to your server, and start the proxy with `KVSCOPE_POLICY=kvscope-policy.json litellm "
    "--config config.yaml`. Requests it does not match pass unchanged; see docs/deploy.md."
)


def policy_markdown(policy: Policy) -> str:
    """The policy in words, for the person who approves it: what the gateway does, then each field with its repair and
    its measured cost (``Policy.words``), then how to deploy it."""
    head, *fields = policy.words()
    return "\n".join(
        [f"**Policy:** {markdown_literal(head)}", "", *(f"- {markdown_literal(line)}" for line in fields), "", POLICY_DEPLOY_WORDS]
    )
