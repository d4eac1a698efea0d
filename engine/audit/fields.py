"""Fields found, not declared: what changed between two consecutive requests, and what a prefix cache reuses.

The reuse figures are token-exact: the longest common prefix (what llama.cpp's slot reuse or any exact-prefix cache
keeps) and its block-aligned part (vLLM's automatic prefix caching hashes whole 16-token blocks). The changes come
from a token-level diff of the two requests. A change inside content both requests share is a *mutable field*,
widened to a natural unit of the text (a whole timestamp, id, hex string, number or word, never half a token); tokens
added after everything the older request held are *growth* (ordinary conversation turns, which break no cache); a
change that touches the chat template's own tokens is refused by name.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from engine.audit.requests import RenderedRequest, RequestLogError

BLOCK_TOKENS = 16  # vLLM's default KV block size
# Natural units a changed character range widens to, longest first where they overlap.
_UNITS = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"  # ISO date[time]
    r"|\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?"  # a time of day
    r"|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"  # a UUID
    r"|[A-Za-z0-9_]+(?:[-./:][A-Za-z0-9_]+)*"  # ids, hex strings, numbers, words (with inner separators)
    r"|\S"
)
_KEY_BEFORE = re.compile(r"([A-Za-z][A-Za-z0-9 _-]{0,40}?)\s*[:=]\s*[\"']?$")


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token sequences."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def block_prefix(tokens: int, block: int = BLOCK_TOKENS) -> int:
    """The part of a common prefix that whole blocks cover."""
    return tokens // block * block


@dataclass(frozen=True)
class FieldChange:
    """A value that changed inside shared content: tokens [old_start, old_end) of the older request became
    [start, end) of the newer one; ``old`` and ``new`` are the widened texts."""

    name: str
    message: int  # the message index holding it (0 for a completions prompt)
    old: str
    new: str
    start: int
    end: int
    old_start: int
    old_end: int
    char_span: tuple[int, int]  # the new value in the newer request's text
    old_char_span: tuple[int, int]

    def as_dict(self) -> dict:
        return {"name": self.name, "old": self.old, "new": self.new, "start": self.start, "end": self.end}


@dataclass(frozen=True)
class TurnDiff:
    """Two consecutive requests compared: reuse figures, the fields that changed, and growth at the end."""

    common_prefix_tokens: int
    block_prefix_tokens: int
    fields: tuple[FieldChange, ...]
    growth_start: int  # tokens of the newer request from here on are growth (its length when none)
    old_growth_start: int  # the older request's tokens from here on were replaced by that growth


def diff_requests(old: RenderedRequest, new: RenderedRequest) -> TurnDiff:
    """Compare ``new`` against ``old`` (its predecessor in the log)."""
    shared = common_prefix(old.token_ids, new.token_ids)
    if shared == 0:
        raise RequestLogError(f"{new.request.where} shares no prefix with {old.request.where}: not the same conversation or template")
    opcodes = [op for op in difflib.SequenceMatcher(None, old.token_ids, new.token_ids, autojunk=False).get_opcodes() if op[0] != "equal"]
    growth_start, old_growth_start = len(new), len(old)
    if opcodes and opcodes[-1][2] == len(old) and _is_growth(old, new, opcodes[-1]):
        _, growth_old, _, growth_start, _ = opcodes.pop()
        old_growth_start = growth_old
    changes = [_field_change(old, new, op) for op in opcodes]
    merged = _merge(old, new, changes)
    return TurnDiff(shared, block_prefix(shared), tuple(_named(new, merged)), growth_start, old_growth_start)


def _is_growth(old: RenderedRequest, new: RenderedRequest, op: tuple) -> bool:
    """The last change reaches the older request's end: new turns (and the generation prompt they replace)."""
    _, i1, _, j1, j2 = op
    return j2 == len(new) and (i1 == len(old) or -1 in old.owners[i1:] or -1 in new.owners[j1:j2])


def _field_change(old: RenderedRequest, new: RenderedRequest, op: tuple) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(message, old character span, new character span) of one change, widened to natural units."""
    _, i1, i2, j1, j2 = op
    old_owners, new_owners = set(old.owners[i1:i2] or old.owners[i1 - 1 : i1]), set(new.owners[j1:j2] or new.owners[j1 - 1 : j1])
    if -1 in old_owners | new_owners or len(old_owners | new_owners) != 1:
        where = f"tokens {j1}..{max(j2 - 1, j1)} of {new.request.where}"
        raise RequestLogError(
            f"{where} change the chat template's own tokens (role markers or turn boundaries), not a "
            "message's content; KVScope audits values inside messages"
        )
    message = old_owners.pop()
    if message >= len(new.content_spans) or message >= len(old.content_spans):
        raise RequestLogError(f"{new.request.where}: message {message + 1} is not in both requests")
    old_chars = _char_span(old, i1, i2)
    new_chars = _char_span(new, j1, j2)
    return message, _widen(old, message, old_chars), _widen(new, message, new_chars)


def _char_span(rendered: RenderedRequest, first: int, stop: int) -> tuple[int, int]:
    if stop > first:
        return rendered.offsets[first][0], rendered.offsets[stop - 1][1]
    at = rendered.offsets[first][0] if first < len(rendered) else rendered.offsets[-1][1]
    return at, at


def _widen(rendered: RenderedRequest, message: int, chars: tuple[int, int]) -> tuple[int, int]:
    """The union of the natural units (inside the message's content) that overlap ``chars``."""
    content_start, content_end = rendered.content_spans[message]
    content = rendered.text[content_start:content_end]
    start, end = chars[0] - content_start, chars[1] - content_start
    units = [m.span() for m in _UNITS.finditer(content) if m.start() < max(end, start + 1) and m.end() > start - (start == end)]
    if not units:
        return chars
    return content_start + min(a for a, _ in units), content_start + max(b for _, b in units)


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
    """Each field named by the ``key:`` or ``key =`` before it on its line, else by its message and order."""
    named, seen = [], {}
    for number, change in enumerate(fields, 1):
        line_start = new.text.rfind("\n", 0, change.char_span[0]) + 1
        found = _KEY_BEFORE.search(new.text[line_start : change.char_span[0]])
        base = re.sub(r"\W+", "_", found.group(1).strip().lower()).strip("_") if found else f"value_{number}"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}_{seen[base]}"
        named.append(
            FieldChange(
                name,
                *[
                    getattr(change, key)
                    for key in ("message", "old", "new", "start", "end", "old_start", "old_end", "char_span", "old_char_span")
                ],
            )
        )
    return named


@dataclass(frozen=True)
class Candidate:
    """A span of one prompt that looks volatile (dates and times, ids, hex strings, numbers, ``key: value`` values)."""

    kind: str
    text: str
    char_span: tuple[int, int]
    start: int  # tokens
    end: int

    def as_dict(self) -> dict:
        return {"kind": self.kind, "text": self.text, "start": self.start, "end": self.end, "chars": list(self.char_span)}


_VOLATILE = (
    (
        "datetime",
        re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?|\b\d{1,2}:\d{2}(?::\d{2})?\b"),
    ),
    ("uuid", re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")),
    ("hex", re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{8,}\b")),
    ("id", re.compile(r"\b[A-Za-z]{1,10}[-_#]?\d{3,}\b")),
    ("number", re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\b")),
    ("value", re.compile(r"(?m)^[ \t]*[A-Za-z][\w -]{0,40}:[ \t]*(\S[^\n]{0,80})$")),
)


def candidate_spans(rendered: RenderedRequest) -> list[Candidate]:
    """Volatile-looking spans inside message contents, first match wins where they overlap, in text order."""
    taken: list[tuple[int, int]] = []
    found = []
    for kind, pattern in _VOLATILE:
        for message, (start, end) in enumerate(rendered.content_spans):
            for match in pattern.finditer(rendered.text, start, end):
                span = match.span(1) if match.groups() else match.span()
                if span[0] == span[1] or any(span[0] < b and span[1] > a for a, b in taken):
                    continue
                taken.append(span)
                tokens = rendered.tokens_in(*span)
                found.append(Candidate(kind, rendered.text[slice(*span)], span, tokens.start, tokens.stop))
    return sorted(found, key=lambda candidate: candidate.char_span)
