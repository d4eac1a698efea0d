"""One request rewritten by a policy, as a server then sees it (``rewrite_request``: pure, text only, no torch).

Each applied entry's field is found by its line (``FieldPolicy.pattern``, read as a template's read line is:
``template.read_pattern``) in a message of its role before the last one (the last message is each request's own: nothing
of it is cached to keep). The repair is then the registry's own rewrite (``repair_requests.repaired_request``), the
function whose request the audit measured, on the request's text without a tokenizer:

- ``coarsen`` rounds the value to the entry's grain, in place;
- ``erratum`` keeps the session's first value in place and appends the state update (``[STATE UPDATE] …``) to the last
  message; a request still at its session's first value is sent as it came;
- ``hoist`` moves the value's whole line after the last message, so the prefix before it stays the same.

The first values are a ``SessionState``, keyed as the audit keys sessions (``Request.session``: the record's session key,
``formats.SESSION_KEYS``; requests without one share one session, as in the token pass) and bounded: beyond its limit the
least recently seen session is forgotten (its next request starts it again). A request no applied entry matches is
returned as it came.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvscope.engine.audit.changes.fields import FieldChange
from kvscope.engine.audit.logs.render import RenderedRequest
from kvscope.engine.audit.logs.requests import Request
from kvscope.engine.audit.policy.document import FieldPolicy, Policy, PolicyError
from kvscope.engine.audit.prompts.repair_requests import RepairNotApplicable, coarse, new_value, repaired_request
from kvscope.engine.audit.prompts.template import placeholder_names, read_pattern

DEFAULT_SESSIONS = 10_000  # sessions whose first values are kept
ORDER = ("coarsen", "erratum", "hoist")  # values changed in place first, the lines moved last


class SessionState:
    """Each session's first value of each field (what the erratum keeps in place), for the ``limit`` sessions seen
    most recently."""

    def __init__(self, limit: int = DEFAULT_SESSIONS):
        if limit < 1:
            raise PolicyError(f"sessions: keep at least 1 session's first values, got {limit}")
        self.limit = limit
        self._first: OrderedDict[str | None, dict[str, str]] = OrderedDict()

    def first(self, session: str | None, field: str, value: str) -> str:
        """The session's first value of ``field``: ``value`` where this is the first time it is seen."""
        values = self._first.pop(session, {})
        self._first[session] = values  # the most recently seen last
        while len(self._first) > self.limit:
            self._first.popitem(last=False)
        return values.setdefault(field, value)

    def __len__(self) -> int:
        return len(self._first)


@dataclass(frozen=True)
class Site:
    """Where an entry's field is in a request: the message, its characters in that message's content, its value."""

    entry: FieldPolicy
    message: int
    chars: tuple[int, int]
    value: str


@functools.cache
def _finder(pattern: str, field: str) -> tuple[re.Pattern, int]:
    """The compiled line of ``pattern`` and the group holding ``field``'s value."""
    return read_pattern(pattern), placeholder_names(pattern).index(field) + 1


def locate(request: Request, entry: FieldPolicy) -> Site | None:
    """The entry's field in ``request``: the first line matching its pattern in a message of its role before the last
    (None: the request has no such line, or is a completions prompt)."""
    if request.messages is None:
        return None
    pattern, group = _finder(entry.pattern, entry.field)
    for number, message in enumerate(request.messages[:-1]):
        if message.role == entry.role and (match := pattern.search(message.content)) and match.group(group).strip():
            return Site(entry, number, match.span(group), match.group(group))
    return None


def rewrite_request(request: Request, state: SessionState, policy: Policy) -> Request:
    """``request`` as the policy's repairs send it (module docstring); as it came where no applied entry matches."""
    for name in ORDER:
        sites = [site for entry in policy.applied if entry.repair == name and (site := locate(request, entry)) is not None]
        if sites:
            request = _repaired(name, request, sites, state)
    return request


def _repaired(name: str, request: Request, sites: Sequence[Site], state: SessionState) -> Request:
    """``request`` with repair ``name`` applied to its fields at ``sites`` (each old value: the session's first for the
    erratum, the value itself otherwise)."""
    if name == "erratum":
        olds = {site.entry.field: state.first(request.session, site.entry.field, site.value) for site in sites}
        sites = [site for site in sites if olds[site.entry.field] != site.value]
    else:
        olds = {site.entry.field: site.value for site in sites}
    if name == "coarsen":
        sites = [site for site in sites if _coarse(site) is not None]
    if name == "hoist":
        sites = list({(site.message, _line_start(request, site)): site for site in reversed(sites)}.values())  # a line moves once
    if not sites:
        return request
    rendered = plain_rendering(request)
    changes = [_change(rendered, site, olds[site.entry.field]) for site in sites]
    grains = {site.entry.field: site.entry.grain for site in sites}
    value_of = (lambda change: coarse(change.new, grains[change.name])) if name == "coarsen" else new_value
    return repaired_request(name, rendered, changes, value_of)


def _coarse(site: Site) -> str | None:
    try:
        return coarse(site.value, site.entry.grain or "")
    except RepairNotApplicable:  # not a date-time: left as it is
        return None


def _line_start(request: Request, site: Site) -> int:
    return request.contents[site.message].rfind("\n", 0, site.chars[0]) + 1


def plain_rendering(request: Request) -> RenderedRequest:
    """``request`` as the repairs' text functions read it, without a tokenizer: each message's content (stripped, as a
    chat template holds it) one after another, and no tokens."""
    spans, texts, at = [], [], 0
    for content in request.contents:
        stripped = content.strip()
        spans.append((at, at + len(stripped)))
        texts.append(stripped)
        at += len(stripped) + 1
    empty = np.zeros(0, dtype=np.int32)
    return RenderedRequest(request, "\n".join(texts), empty, np.zeros((0, 2), dtype=np.int32), empty, tuple(spans))


def _change(rendered: RenderedRequest, site: Site, old: str) -> FieldChange:
    """The site as the field change the repairs read: its old value, its new one, its characters in ``rendered``."""
    content = rendered.request.contents[site.message]
    base = rendered.content_spans[site.message][0] - (len(content) - len(content.lstrip()))
    span = (base + site.chars[0], base + site.chars[1])
    return FieldChange(site.entry.field, site.message, old, site.value, 0, 0, 0, 0, span, span)
