"""Where in a prompt: the text a user names, the volatile-looking spans offered to pick from, and where an exact
prefix cache stops in a turn's rendered text (the CLI and the Your prompt tab read these; nothing is parsed back).

A change site is a :class:`MessageSpan`: characters of one message's content string, what
:func:`~kvscope.engine.audit.measure.turn.audit_value` takes. The candidate menu pairs each label with the candidate's number, so a
choice comes back as that number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.audit.changes.fields import Candidate, TurnDiff
from kvscope.engine.audit.logs.render import RenderedRequest
from kvscope.engine.audit.logs.requests import Request, RequestLogError
from kvscope.engine.audit.prompts.repair_requests import content_chars

LABEL_CHARS = 40  # a candidate's text in its menu label, cut with an ellipsis beyond this


@dataclass(frozen=True)
class MessageSpan:
    """Characters [start, end) of message ``message``'s content string."""

    message: int
    chars: tuple[int, int]


def find_span(request: Request, find: str) -> MessageSpan:
    """The first occurrence of ``find`` in the prompt's messages, in message order."""
    for message, content in enumerate(request.contents):
        at = content.find(find)
        if at >= 0:
            return MessageSpan(message, (at, at + len(find)))
    raise RequestLogError(f"{find!r} does not occur in the prompt's text")


def candidate_menu(candidates: Sequence[Candidate]) -> list[tuple[str, int]]:
    """(label, number) pairs naming each candidate, numbered from 1: ``("3 · datetime · 2026-05-12 09:41", 3)``."""
    return [
        (f"{number} · {c.kind} · {c.text if len(c.text) <= LABEL_CHARS else c.text[: LABEL_CHARS - 1] + '…'}", number)
        for number, c in enumerate(candidates, 1)
    ]


def candidate_span(rendered: RenderedRequest, candidates: Sequence[Candidate], number: int) -> MessageSpan:
    """Candidate ``number`` (from 1, as :func:`candidate_menu` numbers them) as characters of its message's content."""
    if not 1 <= number <= len(candidates):
        raise RequestLogError(f"no candidate span {number}: find the spans again, then pick one of the {len(candidates)} offered")
    start, end = candidates[number - 1].char_span
    for message, (first, last) in enumerate(rendered.content_spans):
        if first <= start and end <= last:
            return MessageSpan(message, content_chars(rendered, message, (start, end)))
    raise RequestLogError("that span is not inside one message's text")


def prefix_cache_stop(diff: TurnDiff, rendered: RenderedRequest) -> int:
    """The character of ``rendered`` (the newer request of ``diff``) where an exact prefix cache stops reusing: the first
    token past the common prefix, moved back to the start of a changed field that token falls inside."""
    shared = diff.common_prefix_tokens
    cut = int(rendered.offsets[shared][0]) if shared < len(rendered) else len(rendered.text)
    return min([cut, *(change.char_span[0] for change in diff.fields if change.char_span[0] <= cut < change.char_span[1])])


def appended_chars(diff: TurnDiff, rendered: RenderedRequest) -> tuple[int, int] | None:
    """The characters of ``rendered`` appended since the request it follows (None when nothing was appended)."""
    if diff.growth_start >= len(rendered):
        return None
    return int(rendered.offsets[diff.growth_start][0]), len(rendered.text)
