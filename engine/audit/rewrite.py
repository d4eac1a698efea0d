"""Any rewrite of a log measured against the original: what each simulated engine reuses before and after, and what
the rewrite does to the model's output, request by request.

The rewritten log is someone else's (a linter's ``fix`` output) or a prompt template applied to the original's values
(``apply_template``: the format ``--template-out`` writes). It must hold the same requests in the same order: the same
count, the same session keys, and no request carrying another request's last user turn (a rewrite may reword a
request's own question; it may not reorder them).

Per request, the rewritten prompt's clean prefill is compared with the original's (``repairs.fidelity``: next-token
KL, top-1, top-5 overlap, N greedy tokens), and both greedy continuations are decoded to say whether the text is the
same. Both logs go through the token pass (``traffic.scan_log``) with the same engine settings for the reuse.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from engine.audit.caches import CacheSettings
from engine.audit.repairs import Fidelity, fidelity, reference
from engine.audit.requests import Request, RequestLog, RequestLogError
from engine.audit.traffic import TrafficScan, scan_log
from engine.cache.loaded import LoadedModel
from engine.progress import StepProgress, ticker

REUSE_ENGINE = "vllm"  # the engine the verdict's reuse is said for
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")  # other braces (JSON, code) are literal text
PROMPT_ROLES = ("system", "developer")  # the template's own messages; the conversation after them is each request's


@dataclass(frozen=True)
class RewrittenRequest:
    """One request before and after the rewrite: its tokens and reuse per engine, and the output compared."""

    request: int
    tokens_before: int
    tokens_after: int
    reused_before: dict[str, int]
    reused_after: dict[str, int]
    fidelity: Fidelity
    generated: int  # greedy tokens compared (the longer of the two continuations)
    original_text: str
    rewritten_text: str

    @property
    def same_text(self) -> bool:
        return self.original_text == self.rewritten_text

    @property
    def unchanged(self) -> bool:
        """Every greedy token the same, position by position."""
        return self.fidelity.generation_agreement == 1.0

    def words(self) -> str:
        f = self.fidelity
        reuse = f"reuse {self.reused_before[REUSE_ENGINE]:,} → {self.reused_after[REUSE_ENGINE]:,} tokens ({REUSE_ENGINE})"
        first = "the first token unchanged" if f.top1_agree else "the first token changes"
        greedy = f"{f.generation_agreement:.0%} of {self.generated} greedy tokens agree, the first {f.generated_common_prefix} in a row"
        return f"{reuse}; {first}; {greedy}; {'the same text' if self.same_text else 'the text changes'}"

    def as_dict(self) -> dict:
        f = self.fidelity
        return {
            "request": self.request,
            "tokens_before": self.tokens_before,
            "tokens_after": self.tokens_after,
            "reused_tokens_before": dict(self.reused_before),
            "reused_tokens_after": dict(self.reused_after),
            "kl": round(f.kl, 8),
            "top1_agree": f.top1_agree,
            "top5_overlap": round(f.top5_overlap, 4),
            "generation_agreement": round(f.generation_agreement, 4),
            "generated_common_prefix": f.generated_common_prefix,
            "same_text": self.same_text,
            "original_text": self.original_text,
            "rewritten_text": self.rewritten_text,
            "verdict": self.words(),
        }


@dataclass(frozen=True)
class RewriteReport:
    """Every request of a rewrite measured, and the verdict for the log."""

    requests: tuple[RewrittenRequest, ...]
    generated_tokens: int  # N asked for

    def hit_rate(self, engine: str, after: bool) -> float:
        rows = self.requests
        tokens = sum(r.tokens_after if after else r.tokens_before for r in rows)
        reused = sum((r.reused_after if after else r.reused_before)[engine] for r in rows)
        return reused / tokens if tokens else 0.0

    def verdict(self) -> str:
        rows, n = self.requests, len(self.requests)
        changed = [r.request for r in rows if not r.same_text]
        words = (
            f"reuse {self.hit_rate(REUSE_ENGINE, False):.0%} → {self.hit_rate(REUSE_ENGINE, True):.0%} ({REUSE_ENGINE}); "
            f"the first token unchanged on {sum(r.fidelity.top1_agree for r in rows)}/{n}; "
            f"the first {self.generated_tokens} tokens unchanged on {sum(r.unchanged for r in rows)}/{n}"
        )
        return words + (f"; the text changes on request{'s' * (len(changed) > 1)} {', '.join(map(str, changed))}" if changed else "")


def check_pairing(original: Sequence[Request], rewritten: Sequence[Request]) -> None:
    """Refuse a rewrite that does not hold the same requests in the same order, with the numbers."""
    if len(original) != len(rewritten):
        raise RequestLogError(
            f"the original log has {len(original)} requests, the rewritten {len(rewritten)}: a rewrite keeps every request, in order"
        )
    for old, new in zip(original, rewritten):
        if old.session != new.session:
            raise RequestLogError(
                f"request {old.index}: session {old.session!r} in the original, {new.session!r} in the rewrite: the order changed"
            )
    turns = [_last_user_turn(request) for request in original]
    for number, (own, new) in enumerate(zip(turns, rewritten), 1):
        text = _last_user_turn(new)
        if own is None or text is None or _same_turn(own, text):
            continue
        other = next((k for k, turn in enumerate(turns, 1) if turn is not None and turn != own and _same_turn(turn, text)), None)
        if other is not None:
            raise RequestLogError(
                f"rewritten request {number} carries the last user turn of original request {other}, not its own: the order changed"
            )


def _last_user_turn(request: Request) -> str | None:
    users = [m.content for m in request.messages or () if m.role == "user"]
    return users[-1].strip() if users else None


def _same_turn(original: str, rewritten: str) -> bool:
    """The same turn, or that turn with lines appended (a hoisted line)."""
    return rewritten == original or rewritten.startswith(original + "\n")


def measure_rewrite(
    lm: LoadedModel,
    original: RequestLog,
    rewritten: RequestLog,
    *,
    settings: CacheSettings = CacheSettings(),
    tokens: int = 32,
    max_tokens: int | None = None,
    progress: StepProgress = None,
) -> RewriteReport:
    """Both logs through the token pass, then each rewritten request's clean prefill against the original's."""
    check_pairing(original.requests, rewritten.requests)
    if tokens < 1:
        raise RequestLogError(f"generate at least one token per state, got {tokens}")
    limit = max_tokens or int(lm.info().get("max_positions") or 32_768)
    before, after = (scan_log(lm.tokenizer, log, settings, limit=limit, model=lm.name) for log in (original, rewritten))
    _check_rendered(before, after)
    tick = ticker(progress, len(before.requests))
    rows = []
    for old, new in zip(before.requests, after.requests):
        clean = reference(lm, before.rendered[old.request], tokens)
        moved = reference(lm, after.rendered[new.request], tokens)
        measured = fidelity(moved.logprobs, moved.generated, clean)
        texts = (lm.tokenizer.decode(list(clean.generated)), lm.tokenizer.decode(list(moved.generated)))
        generated = max(len(clean.generated), len(moved.generated))
        rows.append(
            RewrittenRequest(old.request, old.tokens, new.tokens, old.reused_tokens, new.reused_tokens, measured, generated, *texts)
        )
        tick()
    return RewriteReport(tuple(rows), tokens)


def _check_rendered(before: TrafficScan, after: TrafficScan) -> None:
    """The same requests rendered in both logs (one that renders in one log only is named, with why)."""
    for scan, other, name in ((before, after, "original"), (after, before, "rewritten")):
        missing = sorted(set(other.rendered) - set(scan.rendered))
        if missing:
            where = f"(request {missing[0]})"
            reason = next((item.reason for item in scan.skipped if item.key == "rendering" and where in item.reason), "")
            raise RequestLogError(f"request {missing[0]} of the {name} log cannot be rendered, so it cannot be compared: {reason}")


# ---------------------------------------------------------------- a prompt template applied to the original's values
@dataclass(frozen=True)
class Template:
    """A prompt template as ``--template-out`` writes it: the leading system / developer messages (the prompt, with
    ``{placeholders}``) and the placeholder lines that end its last message (lines hoisted there)."""

    prompt: tuple[tuple[str, str], ...]  # (role, content)
    appended: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Template:
        try:
            items = json.loads(text)
        except json.JSONDecodeError as error:
            raise RequestLogError(
                f"the template is not JSON ({error.msg}, line {error.lineno}): a template is what --template-out writes, "
                "a JSON list of {role, content} messages"
            ) from None
        if not isinstance(items, list) or not items:
            raise RequestLogError("the template must be a non-empty JSON list of {role, content} messages")
        messages = []
        for number, item in enumerate(items, 1):
            if not isinstance(item, dict) or not isinstance(item.get("role"), str) or not isinstance(item.get("content"), str):
                raise RequestLogError(f"template message {number} needs a 'role' and a 'content' string")
            messages.append((item["role"], item["content"]))
        lead = next((k for k, (role, _) in enumerate(messages) if role not in PROMPT_ROLES), len(messages))
        appended: list[str] = []
        if lead < len(messages):
            lines = messages[-1][1].split("\n")
            while lines and PLACEHOLDER.search(lines[-1]):
                appended.insert(0, lines.pop())
            messages[-1] = (messages[-1][0], "\n".join(lines))
        for number, (role, content) in enumerate(messages[lead:], lead + 1):
            if PLACEHOLDER.search(content):
                raise RequestLogError(
                    f"template message {number} ({role}) holds a placeholder inside the conversation, which differs per request: "
                    "place placeholders in the leading system messages or in the lines that end the last message"
                )
        template = cls(tuple(messages[:lead]), tuple(appended))
        for line in template.lines():
            if not PLACEHOLDER.sub("", line).strip():
                raise RequestLogError(f"the template line {line!r} has no text beside its placeholder to find the value by")
        return template

    def lines(self) -> list[str]:
        """Every line holding a placeholder."""
        return [line for _, content in self.prompt for line in content.split("\n") if PLACEHOLDER.search(line)] + list(self.appended)

    def values(self, request: Request) -> dict[str, str]:
        """Each placeholder's value in ``request``: the text where the template's line has it, on a line of the
        request that matches the template's line around it."""
        values: dict[str, str] = {}
        for line in self.lines():
            names = PLACEHOLDER.findall(line)
            if all(name in values for name in names):
                continue
            literal = PLACEHOLDER.split(line)[::2]
            pattern = re.compile("^" + "(.*?)".join(map(re.escape, literal)) + "$", re.MULTILINE)
            found = next((match for content in request.contents if (match := pattern.search(content))), None)
            if found is None:
                raise RequestLogError(f"{request.where}: no line matches the template's {line.strip()!r}, so it has no value for it")
            for name, value in zip(names, found.groups()):
                values.setdefault(name, value)
        return values

    def apply(self, request: Request) -> Request:
        """``request`` with its leading prompt messages replaced by the template's (filled with its own values) and
        the template's appended lines at the end of its last message."""
        if request.messages is None:
            raise RequestLogError(f"{request.where} is a completions prompt: a template applies to chat requests")
        roles = tuple(m.role for m in request.messages[: len(self.prompt)])
        if roles != tuple(role for role, _ in self.prompt) or len(request.messages) <= len(self.prompt):
            raise RequestLogError(
                f"{request.where} starts with the roles {', '.join(roles)}, the template with "
                f"{', '.join(role for role, _ in self.prompt)} and then the conversation"
            )
        values = self.values(request)
        contents = [_filled(content, values) for _, content in self.prompt] + list(request.contents[len(self.prompt) :])
        if self.appended:
            contents[-1] = contents[-1].rstrip() + "\n\n" + "\n".join(_filled(line, values) for line in self.appended)
        return request.with_contents(contents)


def _filled(text: str, values: dict[str, str]) -> str:
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], text)


def apply_template(text: str, log: RequestLog) -> RequestLog:
    """The log with the template applied to every request (the rewritten log ``--template`` measures)."""
    template = Template.parse(text)
    return RequestLog(tuple(template.apply(request) for request in log.requests), log.skipped, dict(log.formats))
