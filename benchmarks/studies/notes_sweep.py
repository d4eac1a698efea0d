"""Which scenario designs make a model keep its field-conditioned conclusion in later tokens ("notes")?

    python -m benchmarks.studies.notes_sweep [--model embedded] [--dtype float32] [--quick] [--threads N] [--min-gap G] [--out DIR]

Scenario variants are generated in code from a base design (the bundled demos' shape: a record opening
with the field, the rules after it, four worked examples ``field: value -> label``, a one-line answer
format) by changing one design factor at a time, over three base domains. For every variant a clean
prefill with the old value (stale), a clean prefill with the new value (oracle) and the field-only edit
(the field's K/V recomputed with the new value, every later token's K/V left stale) are read in one fused
forward. Per variant: labels and margins, Δmargin, whether the decision flips, field-only recovery and
label, ``notes_share = 1 − field_only recovery`` (the part of the decision change that lives in the
downstream tokens' cache, not in the field's own K/V) and the context's token count.

Writes benchmarks/studies/results/notes_sweep-<model>-<dtype>.json and a figure: a PNG through plotly + kaleido
when kaleido is installed, otherwise an HTML file (plotly) and a PNG drawn with matplotlib when that is
installed. Progress goes to stderr. See docs/notes-sweep.md for the findings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import cpu_info, results_dir
from kvscope.engine.comparison.models import PAPER_MODELS
from kvscope.engine.edit.calibrate import FLIP_THRESHOLD, NOTES_DEMO_MAX_RECOVERY
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.strategies import EditSettings
from kvscope.engine.models import LoadedModel, dtype_name, load_model
from kvscope.engine.scenario import Scenario
from kvscope.engine.timing import Stopwatch

RESULTS = results_dir(__file__)

# A demo qualifies (the paper's phenomenon on this model) when a clean prefill flips the decision by at
# least FLIP_MIN and the field-only edit keeps the stale label with recovery at most RECOVERY_MAX: the
# criteria of `python -m kvscope calibrate`'s notes demos.
FLIP_MIN = FLIP_THRESHOLD
RECOVERY_MAX = NOTES_DEMO_MAX_RECOVERY


# ---------------------------------------------------------------------------------------------------
# Design space
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Domain:
    """One decision: a record holding a field with a blocking (old) and a permitting (new) value."""

    key: str
    system: str
    header: str  # record header (text format) / top-level key (YAML)
    field: str
    old: str  # the blocking value: the decision is `deny` with it
    new: str  # the permitting value
    record: tuple[str, ...]  # other record lines ("key: value"), placed after the field
    allow: str  # answer label for the new value
    deny: str  # answer label for the old value
    action: str  # what is allowed, e.g. "the trip"
    consequence: str  # what else happens on deny
    never: str  # a distractor that must not override the field
    item: str  # what one example is about (for "other item" examples and the current-case line)
    bool_field: str  # the field's name when its values are false / true

    def rules(self, field_name: str, old: str, new: str) -> tuple[str, str, str]:
        """The gating rule (both cases) and the distractor line, for a field name and its two values."""
        return (
            f"{self.allow.capitalize()} {self.action} only if {field_name} is {new}.",
            f"If {field_name} is {old}, {self.deny} {self.action} and {self.consequence}.",
            self.never.format(field=field_name),
        )


DOMAINS: dict[str, Domain] = {
    domain.key: domain
    for domain in (
        Domain(
            "machine",
            "You are a factory safety assistant. You follow the safety rules exactly.",
            "MACHINE",
            "safety_mode",
            "locked",
            "ready",
            ("machine: hydraulic press P-4", "operator: L. Brandt", "request: start a batch of 200 brackets"),
            "approve",
            "deny",
            "the start",
            "call the supervisor",
            "Production targets never override {field}.",
            "press",
            "safety_ready",
        ),
        Domain(
            "boarding",
            "You are an airline gate assistant. You follow the boarding rules exactly.",
            "PASSENGER",
            "visa_status",
            "expired",
            "valid",
            ("name: R. Haddad", "flight: AF 1180 to Toronto", "request: board the aircraft"),
            "allow",
            "refuse",
            "boarding",
            "send the passenger to the desk",
            "Frequent flyer status never overrides {field}.",
            "passenger",
            "visa_valid",
        ),
        Domain(
            "vehicle",
            "You are a fleet assistant. You follow the fleet rules exactly.",
            "VEHICLE",
            "inspection",
            "failed",
            "passed",
            ("truck: T-19", "driver: S. Ruiz", "request: take the truck on the morning route"),
            "approve",
            "deny",
            "the trip",
            "book a repair",
            "Delivery schedules never override {field}.",
            "truck",
            "inspection_passed",
        ),
    )
}

FILLER = (
    "The shift log notes that the floor was cleaned and the lights in bay 3 were replaced.",
    "A visitor group toured the site in the afternoon and left before five.",
    "The canteen menu for next week was posted on the notice board.",
    "Two new printers were installed in the office on the first floor.",
    "The parking lot will be repainted on Saturday morning.",
    "Someone left an umbrella at the reception desk.",
)


@dataclass(frozen=True)
class Design:
    """The design factors of one scenario variant. The defaults are the bundled demos' shape."""

    record_after: int = 3  # record lines after the field (0: the field sits right before the rules)
    filler: int = 0  # unrelated log lines between the record and the rules (distance)
    examples: int = 4  # worked examples after the rules (0: none)
    example_items: bool = False  # examples name other items ("truck #101, inspection: passed -> approve")
    rules_first: bool = False  # rules and examples before the record (the gating rule precedes the field)
    current: str = "none"  # none | arrow ("This truck ->" ends the context) | status (a STATUS section to fill in)
    question: str = "decision"  # decision | conclusion ("What do the rules decide for this request? ...")
    distractor: bool = True  # the "X never overrides field" line
    deny_rule: str = "named"  # named ("If field is old, deny ...") | otherwise ("Otherwise, deny ...": the old value unnamed in the rules)
    values: str = "named"  # named (locked / ready) | bool (field renamed *_ready etc., false / true) | code (S1/S2 + legend)
    pair: tuple[str, str] | None = None  # (old, new) in place of the domain's named values, same field name
    fmt: str = "text"  # text | yaml | json | table (examples as a markdown table)
    render: str = "chat"  # chat (the tokenizer's chat template) | plain (no template: "...\nAnswer:")

    def changes(self) -> dict:
        """The factors that differ from the base design."""
        base = Design()
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if getattr(self, name) != getattr(base, name)}


BASE = Design()
# One factor at a time from the base design (name -> design); "best" combines the two strongest single
# factors found on the embedded model (field right before the rules, examples as a table).
VARIANTS: dict[str, Design] = {
    "base": BASE,
    "record_after=0": Design(record_after=0),
    "record_after=1": Design(record_after=1),
    "filler=3": Design(filler=3),
    "filler=6": Design(filler=6),
    "examples=0": Design(examples=0),
    "examples=8": Design(examples=8),
    "example_items": Design(example_items=True),
    "rules_first": Design(rules_first=True),
    "current=arrow": Design(current="arrow"),
    "current=status": Design(current="status"),
    "question=conclusion": Design(question="conclusion"),
    "no_distractor": Design(distractor=False),
    "deny_rule=otherwise": Design(deny_rule="otherwise"),
    "values=bool": Design(values="bool"),
    "values=code": Design(values="code"),
    "pair=false/true": Design(pair=("false", "true")),
    "fmt=yaml": Design(fmt="yaml"),
    "fmt=json": Design(fmt="json"),
    "fmt=table": Design(fmt="table"),
    "render=plain": Design(render="plain"),
    "best: record_after=0 + fmt=table": Design(record_after=0, fmt="table"),
}
# The value-pair probe (--pairs): the base design with the field's two values replaced, field name kept.
PAIRS = (
    ("failed", "passed"),
    ("expired", "valid"),
    ("locked", "ready"),
    ("revoked", "active"),
    ("blocked", "clear"),
    ("denied", "approved"),
    ("closed", "open"),
    ("false", "true"),
    ("no", "yes"),
    ("off", "on"),
    ("0", "1"),
)
PAIR_VARIANTS: dict[str, Design] = {f"pair={old}/{new}": Design(pair=(old, new)) for old, new in PAIRS}
QUICK_DOMAINS = ("machine",)
QUICK_VARIANTS = ("base", "record_after=0", "values=bool", "fmt=table")


def _values(domain: Domain, design: Design) -> tuple[str, str, str]:
    """(field name, old, new) under the design's value kind."""
    if design.values == "bool":
        return domain.bool_field, "false", "true"
    if design.values == "code":
        return domain.field.removesuffix("_status").removesuffix("_mode") + "_code", "S1", "S2"
    if design.values != "named":
        raise ValueError(f"unknown values kind {design.values!r}")
    return (domain.field, *design.pair) if design.pair else (domain.field, domain.old, domain.new)


def variant_label(domain: str, design: Design) -> str:
    """A short readable name: the domain and the factors that differ from the base design."""
    changes = ", ".join(f"{k}={'/'.join(v) if isinstance(v, tuple) else v}" for k, v in design.changes().items())
    return f"{domain} / {changes or 'base'}"


def _toml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid TOML basic string


def scenario_text(domain: Domain | str, design: Design = BASE) -> str:
    """The TOML text of one variant (same format as demos/scenarios/*.toml, with an [expect] table)."""
    domain = DOMAINS[domain] if isinstance(domain, str) else domain
    name, old, new = _values(domain, design)
    rule_old, rule_new = (domain.old, domain.new) if design.values == "code" else (old, new)
    allow_rule, deny_rule, distractor = domain.rules(name, rule_old, rule_new)
    if design.values == "code":  # indirection: the field holds a code, a legend maps codes to states
        allow_rule, deny_rule = (
            f"{name} {old} means {domain.field} is {domain.old}; {name} {new} means {domain.field} is {domain.new}.",
            f"{domain.allow.capitalize()} {domain.action} only if {domain.field} is {domain.new}; "
            f"otherwise {domain.deny} {domain.action} and {domain.consequence}.",
        )
    if design.deny_rule == "otherwise":
        deny_rule = f"Otherwise, {domain.deny} {domain.action} and {domain.consequence}."
    elif design.deny_rule != "named":
        raise ValueError(f"unknown deny rule {design.deny_rule!r}")
    rules = [allow_rule, deny_rule] + ([distractor] if design.distractor else [])
    pattern = "nddn"
    shown = [new if pattern[i % 4] == "n" else old for i in range(design.examples)]
    label = {new: domain.allow, old: domain.deny}
    record = [f"{name}: {{{name}}}", *domain.record[: design.record_after]]
    filler = list(FILLER[: design.filler])

    if design.fmt == "text":
        examples = [
            (f"{domain.item} #{101 + i}, " if design.example_items else "") + f"{name}: {v} -> {label[v]}" for i, v in enumerate(shown)
        ]
        record_block = "\n".join([domain.header, *record, *filler])
        rules_block = "\n".join(["RULES", *rules, *(["Examples:", *examples] if examples else [])])
    elif design.fmt == "table":
        head = (
            [f"| {domain.item} | {name} | decision |", "|---|---|---|"] if design.example_items else [f"| {name} | decision |", "|---|---|"]
        )
        rows = [(f"| {domain.item} #{101 + i} " if design.example_items else "") + f"| {v} | {label[v]} |" for i, v in enumerate(shown)]
        record_block = "\n".join([domain.header, *record, *filler])
        rules_block = "\n".join(["RULES", *rules, *(["", *head, *rows] if rows else [])])
    elif design.fmt == "yaml":
        key = domain.header.lower().replace(" ", "_")
        record_block = "\n".join([f"{key}:", *[f"  {line}" for line in record], *[f"  # {line}" for line in filler]])
        examples = [
            (f"  - {domain.item}: {101 + i}\n    " if design.example_items else "  - ") + f"{name}: {v}\n    decision: {label[v]}"
            for i, v in enumerate(shown)
        ]
        rules_block = "\n".join(["rules:", *[f"  - {rule}" for rule in rules], *(["examples:", *examples] if examples else [])])
    elif design.fmt == "json":
        pairs = [f'"{name}": "{{{name}}}"'] + [f'"{k}": "{v}"' for k, v in (line.split(": ", 1) for line in record[1:])]
        pairs += [f'"note_{i + 1}": "{line}"' for i, line in enumerate(filler)]
        examples = [
            "{{" + (f'"{domain.item}": {101 + i}, ' if design.example_items else "") + f'"{name}": "{v}", "decision": "{label[v]}"' + "}}"
            for i, v in enumerate(shown)
        ]
        record_block = "\n".join(['  "record": {{', ",\n".join(f"    {p}" for p in pairs), "  }}"])
        members = ["\n".join(['  "rules": [', ",\n".join(f'    "{r}"' for r in rules), "  ]"])]
        if examples:
            members.append("\n".join(['  "examples": [', ",\n".join(f"    {e}" for e in examples), "  ]"]))
        rules_block = ",\n".join(members)
    else:
        raise ValueError(f"unknown format {design.fmt!r}")

    blocks = [rules_block, record_block] if design.rules_first else [record_block, rules_block]
    context = "{{\n" + ",\n".join(blocks) + "\n}}" if design.fmt == "json" else "\n\n".join(blocks)
    if design.current == "arrow":
        context += f"\nThis {domain.item} ->"
    elif design.current == "status":
        context += f"\n\nSTATUS\ndecision: computed from {name} by the rules above"
    elif design.current != "none":
        raise ValueError(f"unknown current-case line {design.current!r}")
    question = f"Reply with exactly one of: Decision: {domain.allow} / Decision: {domain.deny}."
    if design.question == "conclusion":
        question = "What do the rules decide for this request? " + question
    elif design.question != "decision":
        raise ValueError(f"unknown question kind {design.question!r}")
    return "\n".join(
        [
            f"name = {_toml_string(variant_label(domain.key, design))}",
            f"system = {_toml_string(domain.system)}",
            f'context = """\n{context}\n"""',
            f"question = {_toml_string(question)}",
            "",
            f"[fields.{name}]",
            f"old = {_toml_string(old)}",
            f"new = {_toml_string(new)}",
            "",
            "[answers]",
            f'{domain.allow} = ["Decision: {domain.allow}"]',
            f'{domain.deny} = ["Decision: {domain.deny}"]',
            "",
            "[expect]",
            f"{_toml_string(old)} = {_toml_string(domain.deny)}",
            f"{_toml_string(new)} = {_toml_string(domain.allow)}",
            "",
        ]
    )


def scenario(domain: Domain | str, design: Design = BASE) -> Scenario:
    """The parsed scenario of one variant."""
    key = domain if isinstance(domain, str) else domain.key
    return Scenario.from_toml(scenario_text(domain, design), source=f"notes_sweep:{key}")


def variants(domains: tuple[str, ...] | None = None, names: tuple[str, ...] | None = None) -> Iterator[tuple[str, str, Design]]:
    """(domain, variant name, design) for every domain × variant, in a stable order."""
    for key in domains or tuple(DOMAINS):
        for name in names or tuple(VARIANTS):
            yield key, name, VARIANTS.get(name) or PAIR_VARIANTS[name]


# ---------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def rendering(lm: LoadedModel, mode: str) -> Iterator[None]:
    """Render through the chat template (``chat``) or as plain text (``plain``: the template hidden)."""
    if mode == "chat" or not getattr(lm.tokenizer, "chat_template", None):
        yield
        return
    if mode != "plain":
        raise ValueError(f"unknown rendering {mode!r}")
    saved = lm.tokenizer.chat_template
    lm.tokenizer.chat_template = None
    try:
        yield
    finally:
        lm.tokenizer.chat_template = saved


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def measure(lm: LoadedModel, domain: str, name: str, design: Design, min_gap: float | None = None) -> dict:
    """One variant: stale, oracle and field-only read in one fused forward; margins, flip, recovery."""
    watch = Stopwatch()
    chosen = scenario(domain, design)
    settings = EditSettings() if min_gap is None else EditSettings(min_gap=min_gap)
    with rendering(lm, design.render):
        experiment = EditExperiment(lm, chosen, settings=settings)
        report = experiment.report(["field_only"], fused=True)
    stale, oracle, field_only = report.stale, report.oracle, report.strategies["field_only"]
    delta = oracle.decision.margin - stale.decision.margin
    flips = stale.decision.label != oracle.decision.label and abs(delta) >= FLIP_MIN
    recovery = None if field_only.recovery is None else field_only.recovery.value
    fo_label = field_only.decision.label if field_only.decision else None
    return {
        "domain": domain,
        "variant": name,
        "design": design.changes(),
        "field": report.field,
        "old": report.old,
        "new": report.new,
        "context_tokens": len(stale.notebook),
        "field_tokens": len(experiment.field_positions),
        "stale_label": stale.decision.label,
        "stale_margin": _round(stale.decision.margin),
        "oracle_label": oracle.decision.label,
        "oracle_margin": _round(oracle.decision.margin),
        "delta_margin": _round(delta),
        "flips": flips,
        "field_only_applicable": field_only.applicable,
        "field_only_label": fo_label,
        "field_only_margin": _round(field_only.decision.margin) if field_only.decision else None,
        "field_only_recovery": _round(recovery),
        "notes_share": _round(None if recovery is None else 1 - recovery),
        "note": field_only.reason or (field_only.recovery.reason if field_only.recovery else None),
        "qualifies": bool(flips and fo_label == stale.decision.label and recovery is not None and recovery <= RECOVERY_MAX),
        "ms": round(watch.ms, 1),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per variant over domains: mean notes share, its change from each domain's base, flips, qualifiers."""
    base = {row["domain"]: row for row in rows if row["variant"] == "base"}
    summary = []
    for name in dict.fromkeys(row["variant"] for row in rows):
        group = [row for row in rows if row["variant"] == name]
        shares = [row["notes_share"] for row in group if row["notes_share"] is not None]
        strong = [row["notes_share"] for row in group if row["notes_share"] is not None and abs(row["delta_margin"]) >= FLIP_MIN]
        changes = [
            row["notes_share"] - base[row["domain"]]["notes_share"]
            for row in group
            if row["notes_share"] is not None and row["domain"] in base and base[row["domain"]]["notes_share"] is not None
        ]
        summary.append(
            {
                "variant": name,
                "domains": len(group),
                "mean_notes_share": _round(statistics.fmean(shares)) if shares else None,
                # only where the field moves the decision (|Δmargin| ≥ FLIP_MIN): a recovery over a small gap means little
                "mean_notes_share_strong": _round(statistics.fmean(strong)) if strong else None,
                "mean_change_vs_base": _round(statistics.fmean(changes)) if changes and name != "base" else None,
                "mean_delta_margin": _round(statistics.fmean(row["delta_margin"] for row in group)),
                "flips": sum(row["flips"] for row in group),
                "qualifies": sum(row["qualifies"] for row in group),
                "mean_context_tokens": round(statistics.fmean(row["context_tokens"] for row in group), 1),
            }
        )
    return summary


def run_sweep(
    lm: LoadedModel,
    quick: bool = False,
    min_gap: float | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
    domains: tuple[str, ...] | None = None,
    names: tuple[str, ...] | None = None,
) -> dict:
    """Measure every variant (``quick``: one domain, four variants; or the ``domains`` × ``names`` given)
    and return the result document."""
    watch = Stopwatch()
    if quick:
        domains, names = domains or QUICK_DOMAINS, names or QUICK_VARIANTS
    unknown = [d for d in domains or () if d not in DOMAINS] + [n for n in names or () if n not in VARIANTS and n not in PAIR_VARIANTS]
    if unknown:
        raise ValueError(f"unknown domain or variant {unknown[0]!r}; domains: {', '.join(DOMAINS)}; variants: {', '.join(VARIANTS)}")
    todo = list(variants(domains, names))
    rows = []
    for index, (domain, name, design) in enumerate(todo):
        rows.append(measure(lm, domain, name, design, min_gap=min_gap))
        if progress:
            progress(index + 1, len(todo), rows[-1])
    import transformers

    return {
        "benchmark": "notes_sweep",
        "model": lm.fingerprint.name,
        "dtype": dtype_name(lm.dtype),
        "device": str(lm.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_info(),
        "quick": quick,
        "wall_s": round(watch.ms / 1000, 1),
        "criteria": {
            "flip_min_abs_delta_margin": FLIP_MIN,
            "field_only_recovery_max": RECOVERY_MAX,
            "min_gap": EditSettings().min_gap if min_gap is None else min_gap,
        },
        "base_design": BASE.__dict__,
        "domains": {
            key: {"field": d.field, "old": d.old, "new": d.new, "labels": [d.allow, d.deny]}
            for key, d in DOMAINS.items()
            if key in (domains or DOMAINS)
        },
        "paper_field_only_recovery": {paper.model: paper.field_only_recovery for paper in PAPER_MODELS},
        "variants": rows,
        "summary": summarize(rows),
    }


# ---------------------------------------------------------------------------------------------------
# Figure
# ---------------------------------------------------------------------------------------------------
def figure(data: dict):
    """Plotly: notes share and Δmargin per variant and domain (filled marker: the decision flips)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = data["variants"]
    order = list(dict.fromkeys(row["variant"] for row in rows))[::-1]
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.03,
        subplot_titles=("notes share = 1 − field-only recovery", "Δmargin (oracle − stale)"),
    )
    colours = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2"]
    for index, domain in enumerate(dict.fromkeys(row["domain"] for row in rows)):
        mine = [row for row in rows if row["domain"] == domain]
        symbols = ["circle" if row["flips"] else "circle-open" for row in mine]
        common = dict(mode="markers", marker=dict(color=colours[index % len(colours)], size=10, symbol=symbols), legendgroup=domain)
        hover = [f"{row['stale_label']}→{row['oracle_label']}, field-only {row['field_only_label']}" for row in mine]
        fig.add_trace(
            go.Scatter(x=[row["notes_share"] for row in mine], y=[row["variant"] for row in mine], name=domain, text=hover, **common), 1, 1
        )
        fig.add_trace(
            go.Scatter(
                x=[row["delta_margin"] for row in mine], y=[row["variant"] for row in mine], name=domain, showlegend=False, **common
            ),
            1,
            2,
        )
    for model, value in data["paper_field_only_recovery"].items():
        fig.add_vline(x=1 - value, line=dict(dash="dot", color="grey", width=1), row=1, col=1)
    fig.add_annotation(x=1.0, y=1.02, xref="x", yref="paper", text="paper 7–9B", showarrow=False, font=dict(size=10, color="grey"))
    fig.add_vline(x=1 - RECOVERY_MAX, line=dict(dash="dash", color="black", width=1), row=1, col=1)
    fig.add_vline(x=FLIP_MIN, line=dict(dash="dash", color="black", width=1), row=1, col=2)
    fig.update_yaxes(categoryorder="array", categoryarray=order)
    fig.update_layout(
        title=f"Notes sweep: {data['model']} ({data['dtype']}); filled = clean prefill flips the decision",
        height=200 + 26 * len(order),
        width=1100,
        margin=dict(l=230, r=20, t=80, b=40),
        template="plotly_white",
    )
    return fig


def matplotlib_png(data: dict, path: Path) -> bool:
    """The same figure drawn with matplotlib (when kaleido is missing). Returns whether it was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = data["variants"]
    order = list(dict.fromkeys(row["variant"] for row in rows))[::-1]
    y = {name: i for i, name in enumerate(order)}
    fig, axes = plt.subplots(1, 2, sharey=True, figsize=(12, 1.5 + 0.32 * len(order)))
    colours = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2"]
    for index, domain in enumerate(dict.fromkeys(row["domain"] for row in rows)):
        colour = colours[index % len(colours)]
        for row in (row for row in rows if row["domain"] == domain):
            face = colour if row["flips"] else "none"
            offset = (index - 1) * 0.15
            if row["notes_share"] is not None:
                axes[0].scatter(row["notes_share"], y[row["variant"]] + offset, s=40, facecolors=face, edgecolors=colour)
            axes[1].scatter(row["delta_margin"], y[row["variant"]] + offset, s=40, facecolors=face, edgecolors=colour)
        axes[0].scatter([], [], color=colour, label=domain)
    axes[0].axvline(1 - RECOVERY_MAX, color="black", ls="--", lw=0.8)
    for value in data["paper_field_only_recovery"].values():
        axes[0].axvline(1 - value, color="grey", ls=":", lw=0.8)
    axes[0].text(1.0, len(order) - 0.3, "paper 7–9B", color="grey", fontsize=8, ha="right")
    axes[0].text(1 - RECOVERY_MAX, -0.9, f" recovery {RECOVERY_MAX}", fontsize=8, va="bottom")
    axes[1].axvline(FLIP_MIN, color="black", ls="--", lw=0.8)
    axes[0].set_yticks(range(len(order)), order, fontsize=8)
    axes[0].set_xlabel("notes share = 1 − field-only recovery")
    axes[1].set_xlabel("Δmargin (oracle − stale)")
    axes[0].legend(fontsize=8, loc="lower left")
    for axis in axes:
        axis.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Notes sweep: {data['model']} ({data['dtype']}); filled = clean prefill flips the decision", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(data: dict, stem: str, folder: Path = RESULTS) -> dict[str, str]:
    """JSON, and the figure as PNG (kaleido) or HTML + matplotlib PNG. Returns kind -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / f"{stem}.json"}
    paths["json"].write_text(json.dumps(data, indent=2) + "\n")
    png = folder / f"{stem}.png"
    try:
        fig = figure(data)
    except ImportError:
        fig = None
    written = False
    if fig is not None:
        try:
            fig.write_image(png)
            written = True
        except Exception:  # kaleido missing or unable to start: fall back below
            paths["html"] = folder / f"{stem}.html"
            fig.write_html(paths["html"], include_plotlyjs="cdn")
    if not written:
        written = matplotlib_png(data, png)
    if written:
        paths["png"] = png
    return {kind: str(path) for kind, path in paths.items()}


def result_stem(model: str, dtype: str) -> str:
    """notes_sweep-<model>-<dtype> with a file-safe model name."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.split(":")[0].split("/")[-1])
    return f"notes_sweep-{safe}-{dtype.removeprefix('torch.')}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="model spec (alias, HF id or local dir)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="one domain, four variants")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--domains", default="", help=f"comma-separated subset of: {', '.join(DOMAINS)}")
    parser.add_argument("--variants", default="", help="comma-separated subset of the variant names (see VARIANTS)")
    parser.add_argument(
        "--pairs",
        action="store_true",
        help="the value-pair probe instead: the base design with each of PAIRS "
        "as the field's values (writes notes_sweep-<model>-<dtype>-pairs.json)",
    )
    parser.add_argument(
        "--min-gap", type=float, default=None, help="smallest |oracle − stale| margin gap with a recovery (engine default 0.25)"
    )
    parser.add_argument("--out", default=str(RESULTS), help="folder for the JSON and figure")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device, dtype=args.dtype, progress=lambda message: print(message, file=sys.stderr))
    elapsed = Stopwatch()

    def report(done: int, total: int, row: dict) -> None:
        share = "—" if row["notes_share"] is None else f"{row['notes_share']:.2f}"
        print(
            f"[{done}/{total}] {row['domain']:<9} {row['variant']:<34} {row['stale_label']}→{row['oracle_label']} "
            f"Δ{row['delta_margin']:+.2f} field-only {row['field_only_label']} notes {share} "
            f"{'✓' if row['qualifies'] else ''} ({elapsed.ms / 1000:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    pick = lambda text: tuple(part.strip() for part in text.split(",") if part.strip()) or None  # noqa: E731
    names = pick(args.variants) or (tuple(PAIR_VARIANTS) if args.pairs else None)
    data = run_sweep(lm, quick=args.quick, min_gap=args.min_gap, progress=report, domains=pick(args.domains), names=names)
    name = args.model if args.model in ("embedded", "smollm2") or args.model.startswith("tiny-") else lm.fingerprint.name
    paths = write_outputs(data, result_stem(name, data["dtype"]) + ("-pairs" if args.pairs else ""), Path(args.out))
    for line in data["summary"]:
        print(
            f"{line['variant']:<34} notes {line['mean_notes_share']} (vs base {line['mean_change_vs_base']}) "
            f"Δmargin {line['mean_delta_margin']} flips {line['flips']}/{line['domains']} qualify {line['qualifies']}",
            file=sys.stderr,
        )
    print(f"wall {data['wall_s']} s; wrote {', '.join(paths.values())}", file=sys.stderr)
    return data


if __name__ == "__main__":
    main()
