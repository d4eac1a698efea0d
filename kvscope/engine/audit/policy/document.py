"""The policy a gateway applies, declared once (``Policy``): one entry per changed field the audit found, with where it
sits, the line that finds it in a new request, the prompt-level repair measured within the bars (or none, and why), that
repair's measured fidelity and the reuse it gains, and the KV-level repairs that would need a cache-editing engine.

Its JSON and its JSON Schema (docs/audit-policy.schema.json, which ``policy-schema`` prints and a test keeps equal) are
derived from the declarations by pydantic, as the report's are (``ci.report``). ``load_policy`` refuses a malformed
policy by the field and the reason, and refuses an applied repair whose measured fidelity is outside its bars unless
the entry says it was forced (``kvscope rewrite --repair``). Text only, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field, TypeAdapter, ValidationError

from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.prompts.repair_requests import GRAINS, LEVEL_WORDS, PROMPT_REPAIRS, REPAIR_LEVELS, Level
from kvscope.engine.audit.prompts.template import placeholder_names
from kvscope.engine.audit.report.records import Record, json_text, published_schema, rounded

VERSION = 1  # raised when a key changes meaning; a reader refuses another version
PUBLISHED = Path("docs") / "audit-policy.schema.json"  # relative to the repository root


class PolicyError(RequestLogError):
    """A policy that cannot be applied: the field and the reason."""


@dataclass(frozen=True)
class Fidelity(Record):
    """A repair's output against a clean prefill over the turns it was measured on: the worst next-token KL, the
    smallest share of greedy tokens agreeing, whether the top token always agreed, and the bars it was judged by (the
    strictest over the turns: the user's, widened to the noise floor where the exact reference missed them)."""

    kl: Annotated[float, rounded(8)]
    agreement: Annotated[float, rounded(4)]
    top1_agree: bool
    turns: int
    kl_bar: Annotated[float, rounded(8)]
    agreement_bar: Annotated[float, rounded(4)]

    @property
    def within_bars(self) -> bool:
        return self.top1_agree and self.kl <= self.kl_bar and self.agreement >= self.agreement_bar

    def words(self) -> str:
        top = "the same top token" if self.top1_agree else "the top token differs"
        turns = f"{self.turns} turn{'s' if self.turns != 1 else ''}"
        agreeing = f"{self.agreement:.0%} of greedy tokens agreeing (bar {self.agreement_bar:.0%})"
        return f"KL {self.kl:.3g} (bar {self.kl_bar:.3g}), {agreeing}, {top}, over {turns}"


@dataclass(frozen=True)
class MeasuredRepair(Record):
    """One repair as measured on the field's turns: its level, whether it held the bars on every one, its fidelity (None
    where it did not apply), the tokens it reused and computed (summed over the turns), and why it did not apply."""

    repair: str
    level: str
    within_bars: bool
    fidelity: Fidelity | None
    reused_tokens: int
    computed_tokens: int
    reason: str | None = None


@dataclass(frozen=True)
class FieldPolicy(Record):
    """One changed field: where it sits (its message's role and index in the measured request), the line that finds it
    (``pattern``: the text around the value, the value as ``{field}``), the repair applied (a prompt-level one; None:
    requests pass unchanged) with its grain, why, its fidelity, and the reuse it gains over the turns measured."""

    field: str
    role: str
    message: int
    pattern: str
    example: str  # the value as last measured
    repair: str | None
    why: str
    grain: str | None = None
    forced: bool = False  # chosen by the user (``kvscope rewrite --repair``), not by the measurement
    fidelity: Fidelity | None = None
    tokens: int = 0  # the measured turns' tokens
    reused_tokens: int = 0  # what the repair reuses of them (a prefix cache's own reuse without it: ``baseline_reused_tokens``)
    baseline_reused_tokens: int = 0
    measured: tuple[MeasuredRepair, ...] = ()
    needs_cache_editing: Annotated[tuple[str, ...], Field(description="KV-level repairs within the bars: not applied")] = ()

    @property
    def gained_tokens(self) -> int:
        return self.reused_tokens - self.baseline_reused_tokens

    def words(self) -> str:
        """The entry in a sentence: the field, what is done to it and what it costs, said from the numbers."""
        where = f"{self.field} ({self.role} message {self.message + 1}, found by {self.pattern!r})"
        editing = (
            f"; {', '.join(self.needs_cache_editing)} held the bars too ({LEVEL_WORDS[Level.KV]}): not applied"
            if self.needs_cache_editing
            else ""
        )
        if self.repair is None:
            return f"{where}: passes unchanged; {self.why}{editing}"
        grain = f" to the {self.grain}" if self.grain else ""
        cost = f"; measured: {self.fidelity.words()}" if self.fidelity else ""
        gain = f"; reuse {self.baseline_reused_tokens:,} → {self.reused_tokens:,} of {self.tokens:,} tokens" if self.tokens else ""
        return f"{where}: {self.repair}{grain}{cost}{gain}; {self.why}{editing}"


@dataclass(frozen=True)
class Policy(Record):
    """What ``kvscope audit LOG --policy-out`` writes and the gateway applies: the version, the model the repairs were
    measured on, the user's bars, and one entry per changed field."""

    version: int
    model: str
    dtype: str
    threshold: float
    min_agreement: float
    fields: tuple[FieldPolicy, ...]
    source: str = ""  # what it was made from (the log)

    @property
    def applied(self) -> tuple[FieldPolicy, ...]:
        """The entries whose repair a gateway applies."""
        return tuple(entry for entry in self.fields if entry.repair is not None)

    def words(self) -> list[str]:
        """One sentence per field, then what a gateway does with them."""
        count = len(self.fields)
        head = f"{len(self.applied)} of {count} field{'s' if count != 1 else ''} repaired at the gateway"
        if not all(entry.forced for entry in self.fields):
            head += f", as measured on {self.model} ({self.dtype})"
        return [head, *(entry.words() for entry in self.fields)]

    def text(self) -> str:
        """The policy as its file holds it (two-space indent, a final newline)."""
        return json_text(self.as_dict())


def load_policy(text: str) -> Policy:
    """A policy read from its JSON, refused (``PolicyError``: the field and the reason) where it is malformed, another
    version, applies a KV-level or unknown repair, lacks a grain to coarsen to, has a pattern that cannot find its field,
    or applies a measured repair whose fidelity is outside its bars."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PolicyError(f"the policy is not JSON ({error.msg}, line {error.lineno})") from None
    if isinstance(data, dict) and data.get("version") != VERSION:
        raise PolicyError(f"version: this KVScope reads policy version {VERSION}, the file says {data.get('version')!r}")
    try:
        policy = TypeAdapter(Policy).validate_python(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the policy"
        count = error.error_count()
        raise PolicyError(f"{where}: {first['msg']} ({count} problem{'s' if count != 1 else ''} in all)") from None
    for number, entry in enumerate(policy.fields):
        problem = _entry_problem(entry)
        if problem is not None:
            raise PolicyError(f"fields.{number} ({entry.field}): {problem}")
    return policy


def _entry_problem(entry: FieldPolicy) -> str | None:
    """Why a gateway cannot apply ``entry`` as written (None: it can)."""
    if entry.pattern.count("{" + entry.field + "}") != 1 or entry.field not in placeholder_names(entry.pattern):
        return f"pattern {entry.pattern!r} must hold {{{entry.field}}} once, where the value is"
    if not entry.pattern.replace("{" + entry.field + "}", "").strip():
        return f"pattern {entry.pattern!r} has no text beside the value to find it by"
    if entry.message < 0:
        return f"message {entry.message} is not a message index"
    if entry.repair is None:
        return None
    if entry.repair not in REPAIR_LEVELS:
        return f"repair {entry.repair!r} is not a repair; a policy applies one of {', '.join(PROMPT_REPAIRS)}"
    if entry.repair not in PROMPT_REPAIRS or entry.repair == "recompute":
        what = "the exact reference, what a server does unrepaired" if entry.repair == "recompute" else LEVEL_WORDS[Level.KV]
        return f"repair {entry.repair!r} is {what}: a gateway applies {', '.join(r for r in PROMPT_REPAIRS if r != 'recompute')}"
    if entry.repair == "coarsen" and entry.grain not in GRAINS:
        return f"grain {entry.grain!r}: coarsen needs one of {', '.join(GRAINS)}"
    if not entry.forced and (entry.fidelity is None or not entry.fidelity.within_bars):
        measured = entry.fidelity.words() if entry.fidelity else "no fidelity measured"
        return f"repair {entry.repair!r} is applied but was not measured within the bars ({measured}); set forced: true to apply it anyway"
    return None


def policy_schema() -> dict:
    """The JSON Schema of a policy, as its records serialize."""
    description = (
        "What `kvscope audit LOG --policy-out FILE` writes and the gateway applies "
        "(kvscope/engine/audit/policy/document.py; docs/deploy.md)."
    )
    return published_schema(TypeAdapter(Policy), "KVScope repair policy", description)
