"""Fields found, not declared: what changed between two consecutive requests, and what a prefix cache reuses.

The reuse figures are token-exact: the longest common prefix (what llama.cpp's slot reuse or any exact-prefix cache
keeps) and its block-aligned part (vLLM's automatic prefix caching hashes whole 16-token blocks). The changes come
from a token-level diff of the two requests. A change inside content both requests share is a *mutable field*,
widened to a natural unit of the text (a whole timestamp, id, hex string, number or word, never half a token); tokens
added after everything the older request held are *growth* (ordinary conversation turns, which break no cache); a
change that touches the chat template's own tokens is refused by name.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field

from kvscope.engine.audit.logs.render import RenderedRequest
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.paged_blocks import block_prefix
from kvscope.engine.audit.report.records import HIDDEN, Record

ANCHOR_TOKENS = 8  # equal tokens that resynchronise the diff after a change
REFINE_TOKENS = 600  # changed regions up to this long are aligned exactly (difflib); longer ones are one change
DATETIME = re.compile(
    r"(?P<date>\d{4}-\d{2}-\d{2})(?:[T ](?P<hour>\d{1,2}):(?P<minute>\d{2})(?::\d{2}(?:\.\d+)?)?(?P<zone>Z|[+-]\d{2}:?\d{2})?)?"
)
"""An ISO date or date-time (``2026-12-01``, ``2026-12-01 9:14``, ``2026-12-01T09:14:33.25+02:00``): the one pattern that
the diff widens a change to, the volatile-span finder marks and ``coarsen`` reads (groups: date, hour, minute, zone)."""
# Natural units a changed character range widens to, longest first where they overlap.
_UNITS = re.compile(
    DATETIME.pattern  # ISO date[time]
    + r"|\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?"  # a time of day
    r"|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"  # a UUID
    r"|[A-Za-z0-9_]+(?:[-./:][A-Za-z0-9_]+)*"  # ids, hex strings, numbers, words (with inner separators)
    r"|\S"
)
_KEY_BEFORE = re.compile(r"([A-Za-z][A-Za-z0-9 _-]{0,40}?)\s*[:=]\s*[\"']?$")
# "The current time is …", "Today's date was …": the words before a linking verb name the value.
_PHRASE_BEFORE = re.compile(
    r"(?:^|[.;!?]\s+)(?:(?:the|a|an|your|our|my|this)\s+)?((?:[A-Za-z][\w'-]*\s+){0,3}[A-Za-z][\w'-]*)"
    r"\s+(?:is|are|was|were|is now|as of|at|on)\s*[\"']?$",
    re.IGNORECASE,
)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    count = min(len(a), len(b))
    if count == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:count]) != np.asarray(b[:count]))
    return int(differ[0]) if len(differ) else count


def token_opcodes(a: np.ndarray, b: np.ndarray) -> list[tuple[str, int, int, int, int]]:
    """The changes turning ``a`` into ``b``, as difflib's non-equal opcodes, in linear time on logs' shapes: equal
    runs are taken greedily, each change ends at the nearest ``ANCHOR_TOKENS`` equal tokens, and a change region up to
    ``REFINE_TOKENS`` long is aligned exactly by difflib (so nearby values stay apart)."""
    a, b = np.ascontiguousarray(a, dtype=np.int32), np.ascontiguousarray(b, dtype=np.int32)
    haystack, ops, i, j = a.tobytes(), [], 0, 0
    while True:
        shared = common_prefix(a[i:], b[j:])
        i, j = i + shared, j + shared
        if i == len(a) or j == len(b):
            if i < len(a) or j < len(b):
                ops.append(("replace" if i < len(a) and j < len(b) else "insert" if j < len(b) else "delete", i, len(a), j, len(b)))
            return ops
        next_i, next_j = _resync(haystack, a, b, i, j)
        ops += _aligned(a, b, i, next_i, j, next_j)
        i, j = next_i, next_j


def _resync(haystack: bytes, a: np.ndarray, b: np.ndarray, i: int, j: int) -> tuple[int, int]:
    """The nearest (i', j') ≥ (i, j), by (i' - i) + (j' - j), where ``ANCHOR_TOKENS`` equal tokens start; the ends
    when there is none."""
    best, at_j = None, j
    while at_j + ANCHOR_TOKENS <= len(b) and (best is None or at_j - j < best[0]):
        needle = b[at_j : at_j + ANCHOR_TOKENS].tobytes()
        found = haystack.find(needle, i * 4)
        while found >= 0 and found % 4:  # a match must start on a token boundary
            found = haystack.find(needle, found + 1)
        if found >= 0 and (best is None or found // 4 - i + at_j - j < best[0]):
            best = (found // 4 - i + at_j - j, found // 4, at_j)
        at_j += 1
    return (best[1], best[2]) if best else (len(a), len(b))


def _aligned(a: np.ndarray, b: np.ndarray, i1: int, i2: int, j1: int, j2: int) -> list[tuple[str, int, int, int, int]]:
    if i2 - i1 > REFINE_TOKENS or j2 - j1 > REFINE_TOKENS:
        return [("replace", i1, i2, j1, j2)]
    matcher = difflib.SequenceMatcher(None, a[i1:i2].tolist(), b[j1:j2].tolist(), autojunk=False)
    return [(tag, i1 + x1, i1 + x2, j1 + y1, j1 + y2) for tag, x1, x2, y1, y2 in matcher.get_opcodes() if tag != "equal"]


@dataclass(frozen=True)
class FieldChange(Record):
    """A value that changed inside shared content: tokens [old_start, old_end) of the older request became
    [start, end) of the newer one; ``old`` and ``new`` are the widened texts."""

    name: str
    message: Annotated[int, HIDDEN]  # the message index holding it (0 for a completions prompt)
    old: str
    new: str
    start: int
    end: int
    old_start: Annotated[int, HIDDEN]
    old_end: Annotated[int, HIDDEN]
    char_span: Annotated[tuple[int, int], HIDDEN]  # the new value in the newer request's text
    old_char_span: Annotated[tuple[int, int], HIDDEN]


@dataclass(frozen=True)
class TurnDiff:
    """Two requests compared (the newer against the one it was matched with): reuse figures, the fields that
    changed, growth at the end, and the changes outside any one message's content (``structural``: the chat
    template's own tokens, tool definitions or calls, roles, messages added or dropped before the end)."""

    common_prefix_tokens: int
    block_prefix_tokens: int
    fields: tuple[FieldChange, ...]
    growth_start: int  # tokens of the newer request from here on are growth (its length when none)
    old_growth_start: int  # the older request's tokens from here on were replaced by that growth
    structural: tuple[tuple[int, int, int, int], ...] = ()  # (old_start, old_end, start, end) token spans


def compare_requests(old: RenderedRequest, new: RenderedRequest, block: int) -> TurnDiff:
    """Compare ``new`` against ``old`` without refusing anything: changes inside one message's content become
    fields, any other change is structural."""
    shared = common_prefix(old.token_ids, new.token_ids)
    opcodes = token_opcodes(old.token_ids, new.token_ids)
    growth_start, old_growth_start = len(new), len(old)
    if opcodes and opcodes[-1][2] == len(old) and _is_growth(old, new, opcodes[-1]):
        _, growth_old, _, growth_start, _ = opcodes.pop()
        old_growth_start = growth_old
    changes, structural = [], []
    for op in opcodes:
        change = _field_change(old, new, op)
        if change is None:
            structural.append(op[1:])
        else:
            changes.append(change)
    merged = _merge(old, new, changes)
    return TurnDiff(shared, block_prefix(shared, block), tuple(_named(new, merged)), growth_start, old_growth_start, tuple(structural))


def diff_requests(old: RenderedRequest, new: RenderedRequest, block: int) -> TurnDiff:
    """Compare ``new`` against ``old`` (the request it follows), refusing what the repairs cannot work on: no shared
    prefix at all, or a change to the chat template's own tokens."""
    diff = compare_requests(old, new, block)
    if diff.common_prefix_tokens == 0:
        raise RequestLogError(f"{new.request.where} shares no prefix with {old.request.where}: not the same conversation or template")
    if diff.structural:
        _, _, j1, j2 = diff.structural[0]
        raise RequestLogError(
            f"tokens {j1}..{max(j2 - 1, j1)} of {new.request.where} change the chat template's own tokens (role markers, "
            "turn boundaries, tools or tool calls), not a message's content; KVScope audits values inside messages"
        )
    return diff


def _is_growth(old: RenderedRequest, new: RenderedRequest, op: tuple) -> bool:
    """The last change reaches the older request's end: new turns (and the generation prompt they replace)."""
    _, i1, _, j1, j2 = op
    return j2 == len(new) and (i1 == len(old) or -1 in old.owners[i1:] or -1 in new.owners[j1:j2])


def _field_change(old: RenderedRequest, new: RenderedRequest, op: tuple) -> tuple[int, tuple[int, int], tuple[int, int]] | None:
    """(message, old character span, new character span) of one change, widened to natural units; None when the
    change is not inside one message's content in both requests."""
    _, i1, i2, j1, j2 = op
    old_owners = set(old.owners[i1:i2].tolist() or old.owners[i1 - 1 : i1].tolist())
    new_owners = set(new.owners[j1:j2].tolist() or new.owners[j1 - 1 : j1].tolist())
    owners = old_owners | new_owners
    if len(owners) != 1 or -1 in owners:
        return None
    message = owners.pop()
    if message >= len(new.content_spans) or message >= len(old.content_spans):
        return None
    old_chars = _char_span(old, i1, i2)
    new_chars = _char_span(new, j1, j2)
    return message, _widen(old, message, old_chars), _widen(new, message, new_chars)


def _char_span(rendered: RenderedRequest, first: int, stop: int) -> tuple[int, int]:
    if stop > first:
        return int(rendered.offsets[first][0]), int(rendered.offsets[stop - 1][1])
    at = int(rendered.offsets[first][0] if first < len(rendered) else rendered.offsets[-1][1])
    return at, at


def _widen(rendered: RenderedRequest, message: int, chars: tuple[int, int]) -> tuple[int, int]:
    """The union of the natural units (inside the message's content) that overlap ``chars``."""
    content_start, content_end = rendered.content_spans[message]
    text = rendered.text
    start, end = chars
    window_start = max(text.rfind("\n", content_start, max(start - 1, content_start)) + 1, content_start)
    window_end = text.find("\n", end, content_end)  # units never cross a line: only the change's lines are scanned
    window_end = content_end if window_end < 0 else window_end
    units = [
        m.span()
        for m in _UNITS.finditer(text, window_start, window_end)
        if m.start() < max(end, start + 1) and m.end() > start - (start == end)
    ]
    if not units:
        return chars
    return min(a for a, _ in units), max(b for _, b in units)


def _merge(old: RenderedRequest, new: RenderedRequest, changes: list) -> list[FieldChange]:
    """Overlapping widened changes joined; token spans are the tokens covering each widened value."""
    changes = sorted(changes, key=lambda change: change[2][0])
    joined: list[list] = []
    for message, old_chars, new_chars in changes:
        if joined and joined[-1][0] == message and new_chars[0] <= joined[-1][2][1]:
            joined[-1][1] = (joined[-1][1][0], max(joined[-1][1][1], old_chars[1]))
            joined[-1][2] = (joined[-1][2][0], max(joined[-1][2][1], new_chars[1]))
        else:
            joined.append([message, old_chars, new_chars])
    fields = []
    for message, old_chars, new_chars in joined:
        old_tokens, new_tokens = old.tokens_in(*old_chars), new.tokens_in(*new_chars)
        fields.append(
            FieldChange(
                name="",
                message=message,
                old=old.text[slice(*old_chars)],
                new=new.text[slice(*new_chars)],
                start=new_tokens.start,
                end=new_tokens.stop,
                old_start=old_tokens.start,
                old_end=old_tokens.stop,
                char_span=new_chars,
                old_char_span=old_chars,
            )
        )
    return fields


def _named(new: RenderedRequest, fields: list[FieldChange]) -> list[FieldChange]:
    """Each field named from its context: the ``key:`` or ``key =`` before it on its line, else the words before a
    linking verb (``The current time is …`` gives ``current_time``), else the kind of value it is, else its order."""
    named, seen = [], {}
    for number, change in enumerate(fields, 1):
        line_start = new.text.rfind("\n", 0, change.char_span[0]) + 1
        before = new.text[line_start : change.char_span[0]]
        found = _KEY_BEFORE.search(before) or _PHRASE_BEFORE.search(before)
        words = found.group(1) if found else value_kind(change.new) or value_kind(change.old) or f"value_{number}"
        base = re.sub(r"\W+", "_", words.strip().lower()).strip("_")
        seen[base] = seen.get(base, 0) + 1
        named.append(dataclasses.replace(change, name=base if seen[base] == 1 else f"{base}_{seen[base]}"))
    return named


@dataclass(frozen=True)
class Candidate(Record):
    """A span of one prompt that looks volatile (dates and times, ids, hex strings, numbers, ``key: value`` values)."""

    kind: str
    text: str
    start: int  # tokens
    end: int
    char_span: Annotated[tuple[int, int], Field(serialization_alias="chars")]


_VOLATILE = (
    (
        "datetime",
        re.compile(DATETIME.pattern + r"|\b\d{1,2}:\d{2}(?::\d{2})?\b"),
    ),
    ("uuid", re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")),
    ("hex", re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{8,}\b")),
    ("id", re.compile(r"\b[A-Za-z]{1,10}[-_#]?\d{3,}\b")),
    ("number", re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\b")),
    ("value", re.compile(r"(?m)^[ \t]*[A-Za-z][\w -]{0,40}:[ \t]*(?P<value>\S[^\n]{0,80})$")),  # the value after its key
)


def candidate_spans(rendered: RenderedRequest) -> list[Candidate]:
    """Volatile-looking spans inside message contents, first match wins where they overlap, in text order."""
    taken: list[tuple[int, int]] = []
    found = []
    for kind, pattern in _VOLATILE:
        for message, (start, end) in enumerate(rendered.content_spans):
            for match in pattern.finditer(rendered.text, start, end):
                span = match.span("value") if "value" in pattern.groupindex else match.span()
                if span[0] == span[1] or any(span[0] < b and span[1] > a for a, b in taken):
                    continue
                taken.append(span)
                tokens = rendered.tokens_in(*span)
                found.append(Candidate(kind, rendered.text[slice(*span)], tokens.start, tokens.stop, span))
    return sorted(found, key=lambda candidate: candidate.char_span)


def value_kind(text: str) -> str | None:
    """The kind of volatile value ``text`` is as a whole (datetime, uuid, hex, id or number), or None."""
    stripped = text.strip()
    return next((kind for kind, pattern in _VOLATILE[:-1] if pattern.fullmatch(stripped)), None)
