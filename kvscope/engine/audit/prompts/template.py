"""The prompt template format: what ``kvscope audit --template-out`` writes and ``--template`` applies to a log
(docs/audit.md, "A rewrite measured, and a CI gate", has the format with examples).

A template is JSON: a list of ``{"role", "content"}`` messages (the leading system / developer ones every request's
prompt; lines holding a placeholder at the end of the last message appended to each request's last message), or an
object ``{"messages": [...], "read": [line, ...]}`` whose values are read from the request's lines matching a ``read``
line (only the names read there are placeholders in its messages). A placeholder is ``{name}`` or ``{name:grain}``
(``date``, ``hour``, ``minute``: what ``coarsen`` sends); any other brace is literal text. Each value is read from the
request's line that matches the template's line around it (whitespace aside). Requests a template gives no value to
are sent as logged; a template for none is refused. ``written_template`` writes a prompt-level repair's request in
this format (the list form wherever it reads the same).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.audit.changes.fields import FieldChange
from kvscope.engine.audit.logs.render import RenderedRequest
from kvscope.engine.audit.logs.requests import Request, RequestLogError
from kvscope.engine.audit.prompts.repair_requests import GRAINS, RepairNotApplicable, coarse, repaired_request, with_lines_appended

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([A-Za-z]+))?\}")  # {name} or {name:grain}
PROMPT_ROLES = ("system", "developer")  # the template's own messages; the conversation after them is each request's
FORM_KEYS = ("messages", "read")


@dataclass(frozen=True)
class Template:
    """A parsed template: the prompt messages, the lines appended to the last message, the lines each value is read
    from (stripped) and the placeholders' names."""

    prompt: tuple[tuple[str, str], ...]  # (role, content)
    appended: tuple[str, ...]
    read: tuple[str, ...]
    names: frozenset[str]

    @classmethod
    def parse(cls, text: str) -> Template:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise RequestLogError(
                f"the template is not JSON ({error.msg}, line {error.lineno}): a template is what --template-out writes, "
                'a JSON list of {role, content} messages or an object {"messages": [...], "read": [...]}'
            ) from None
        items, read = data, None
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(FORM_KEYS))
            if unknown or "messages" not in data:
                raise RequestLogError(f"a template object holds 'messages' and 'read' only, got {', '.join(map(repr, sorted(data)))}")
            items, read = data["messages"], _read_lines(data.get("read"))
        messages = _messages(items)
        names = frozenset(name for line in read for name, _ in _placeholders(line, None)) if read is not None else None
        lead = next((k for k, (role, _) in enumerate(messages) if role not in PROMPT_ROLES), len(messages))
        appended: list[str] = []
        if lead < len(messages):
            lines = messages[-1][1].split("\n")
            while lines and _placeholders(lines[-1], names):
                appended.insert(0, lines.pop())
            messages[-1] = (messages[-1][0], "\n".join(lines))
        for number, (role, content) in enumerate(messages[lead:], lead + 1):
            if _placeholders(content, names):
                raise RequestLogError(
                    f"template message {number} ({role}) holds a placeholder inside the conversation, which differs per request: "
                    "place placeholders in the leading system messages or in the lines that end the last message"
                )
        placing = [line for _, content in messages[:lead] for line in content.split("\n") if _placeholders(line, names)] + appended
        if read is None:
            read = tuple(dict.fromkeys(PLACEHOLDER.sub(lambda m: "{" + m.group(1) + "}", line).strip() for line in placing))
            names = frozenset(name for line in read for name, _ in _placeholders(line, None))
        for line in read:
            if not PLACEHOLDER.sub("", line).strip():
                raise RequestLogError(f"the template line {line!r} has no text beside its placeholder to find the value by")
        for line in placing:
            for name, grain in _placeholders(line, names):
                if grain is not None and grain not in GRAINS:
                    raise RequestLogError(f"{{{name}:{grain}}}: unknown grain {grain!r}; choose one of {', '.join(GRAINS)}")
        return cls(tuple(messages[:lead]), tuple(appended), read, names)

    def values(self, request: Request) -> tuple[dict[str, str], str | None]:
        """Each placeholder's value in ``request`` (from its first line matching a read line), and the first read
        line no line of it matches (None when every one matched)."""
        values: dict[str, str] = {}
        missing = None
        for line in self.read:
            pattern = read_pattern(line)
            found = next((match for content in request.contents if (match := pattern.search(content))), None)
            if found is None:
                missing = missing or line
                continue
            for (name, _), value in zip(_placeholders(line, None), found.groups()):
                values.setdefault(name, value)
        return values, missing

    def applies_to(self, request: Request) -> bool:
        """Whether ``request`` is one this template is for (:meth:`why_not` has nothing to say)."""
        return self.why_not(request) is None

    def why_not(self, request: Request) -> str | None:
        """Why ``request`` is not one this template is for, or None where it is: it must be a chat request starting with
        the template's prompt roles and then a conversation, whose lines give every placeholder a value."""
        if request.messages is None:
            return f"{request.where} is a completions prompt: a template applies to chat requests"
        roles = tuple(m.role for m in request.messages[: len(self.prompt)])
        if roles != tuple(role for role, _ in self.prompt) or len(request.messages) <= len(self.prompt):
            return (
                f"{request.where} starts with the roles {', '.join(roles)}, the template with "
                f"{', '.join(role for role, _ in self.prompt)} and then the conversation"
            )
        values, missing = self.values(request)
        if not self.names <= set(values):
            return f"no line of {request.where} matches the template's {missing!r}, so it has no value for it"
        return None

    def apply(self, request: Request) -> Request:
        """``request`` with its leading prompt messages replaced by the template's and the template's appended lines
        at the end of its last message, each placeholder filled with ``request``'s own value."""
        why = self.why_not(request)
        if why is not None:
            raise RequestLogError(why)
        values, _ = self.values(request)
        contents = [self._filled(content, values, request) for _, content in self.prompt] + list(request.contents[len(self.prompt) :])
        if self.appended:
            contents[-1] = with_lines_appended(contents[-1], [self._filled(line, values, request) for line in self.appended])
        return request.with_contents(contents)

    def _filled(self, text: str, values: dict[str, str], request: Request) -> str:
        def value(match: re.Match) -> str:
            name, grain = match.groups()
            if name not in self.names:
                return match.group(0)
            if grain is None:
                return values[name]
            try:
                return coarse(values[name], grain)
            except RepairNotApplicable as error:
                raise RequestLogError(f"{request.where}: {{{name}:{grain}}}: {error}") from None

        return PLACEHOLDER.sub(value, text)


def read_pattern(line: str) -> re.Pattern:
    """What finds read line ``line`` (text around ``{placeholders}``) in a message's content: the whole line, one group
    per placeholder (:func:`placeholder_names`' order); the gateway's policy finds its fields by the same."""
    literal = PLACEHOLDER.split(line)[::3]
    return re.compile(r"^[ \t]*" + "(.*?)".join(map(re.escape, literal)) + r"[ \t]*$", re.MULTILINE)


def placeholder_names(line: str) -> list[str]:
    """The names of ``line``'s placeholders, in order (a group each in :func:`read_pattern`)."""
    return [name for name, _ in _placeholders(line, None)]


def _placeholders(text: str, names: frozenset[str] | None) -> list[tuple[str, str | None]]:
    """The (name, grain) placeholders of ``text``: every ``{word}`` (``names`` None), or those of ``names``."""
    return [(m.group(1), m.group(2)) for m in PLACEHOLDER.finditer(text) if names is None or m.group(1) in names]


def _messages(items: object) -> list[tuple[str, str]]:
    if not isinstance(items, list) or not items:
        raise RequestLogError("the template's messages must be a non-empty JSON list of {role, content} messages")
    messages = []
    for number, item in enumerate(items, 1):
        if not isinstance(item, dict) or not isinstance(item.get("role"), str) or not isinstance(item.get("content"), str):
            raise RequestLogError(f"template message {number} needs a 'role' and a 'content' string")
        messages.append((item["role"], item["content"]))
    return messages


def _read_lines(items: object) -> tuple[str, ...]:
    """The object form's ``read`` lines, each one line with a placeholder (no grain) and text beside it."""
    if not isinstance(items, list) or not items or not all(isinstance(item, str) for item in items):
        raise RequestLogError("the template's 'read' must be a non-empty list of lines, each holding a {placeholder}")
    for line in items:
        found = _placeholders(line, None)
        if "\n" in line or not found:
            raise RequestLogError(f"the read line {line!r} must be one line holding a {{placeholder}}")
        if any(grain for _, grain in found):
            raise RequestLogError(f"the read line {line!r} reads a value as logged: write {{name}}, the grain goes where it is placed")
    return tuple(dict.fromkeys(line.strip() for line in items))


def written_template(repair: str, new: RenderedRequest, fields: Sequence[FieldChange], grain: str | None = None) -> str:
    """The template that sends every request as prompt-level ``repair`` sent ``new`` (each changed field a
    placeholder; ``coarsen``'s at ``grain``), built by the function that built the measured request
    (:func:`~kvscope.engine.audit.prompts.repair_requests.repaired_request`). A completions prompt gives its text with
    the placeholders (to read; ``--template`` applies chat templates only)."""
    spec = f":{grain}" if repair == "coarsen" else ""
    sent = repaired_request(repair, new, fields, lambda change: "{" + change.name + spec + "}")
    if sent.messages is None:
        return sent.prompt
    lead = next((k for k, m in enumerate(sent.messages) if m.role not in PROMPT_ROLES), len(sent.messages))
    outside = next((change for change in fields if change.message >= lead), None)
    if outside is not None:
        role = sent.messages[outside.message].role
        raise RequestLogError(
            f"{outside.name} changes in message {outside.message + 1} ({role}), each request's own conversation: "
            "a template replaces the leading system / developer messages only"
        )
    logged = repaired_request("recompute", new, fields, lambda change: "{" + change.name + "}")  # the request as logged
    placed = ["{" + change.name + "}" for change in fields]
    holds = [line for content in logged.contents[:lead] for line in content.split("\n") if any(p in line for p in placed)]
    messages = [{"role": message.role, "content": message.content} for message in sent.messages]
    explicit = {"messages": messages, "read": [line.strip() for line in holds]}
    listed = json.dumps(messages, indent=2, ensure_ascii=False)
    try:
        same = Template.parse(listed) == Template.parse(json.dumps(explicit))
    except RequestLogError:  # a literal {word} of the prompt would read as a placeholder in the list form
        same = False
    if same:
        return listed
    written = json.dumps(explicit, indent=2, ensure_ascii=False)
    Template.parse(written)  # what --template-out writes, --template reads: refused here, by name, if it could not
    return written
