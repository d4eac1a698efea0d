"""Why a request misses the cache, named as a person would name it, from the request it was matched with.

Each cause is registered here with the one line that explains it (the CLI, the JSON and the tab use these names).
A value that changed is a cause by its kind (a clock, an id, a counter, a nonce); a change outside any message's
content is a tool list changed or reordered, or a history rewritten; and where the common prefix stops tells the
block causes (shorter than one block, or ending mid-block: vLLM recomputes the partial block).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

from kvscope.engine.audit.changes.fields import FieldChange, TurnDiff, common_prefix, value_kind
from kvscope.engine.audit.logs.render import RenderedRequest
from kvscope.engine.audit.logs.requests import Request
from kvscope.engine.audit.report.records import Record

CAUSES = {
    "new_prefix": "no earlier request shares a prefix with this one: a cold prefill",
    "other_conversation": "the longest cached prefix is another conversation's: only their shared head (system prompt, tools) is reused",
    "clock": "a clock or date changed",
    "id": "an id or UUID changed",
    "counter": "a counter or other number changed",
    "nonce": "a random value or nonce changed",
    "value": "a value changed inside shared content",
    "key_order": "JSON keys reordered: the same object, serialised differently",
    "whitespace": "whitespace only changed",
    "tools_changed": "the tool list changed (a tool added, removed or edited)",
    "tools_reordered": "the same tools in another order",
    "history_rewritten": "earlier messages changed outside their text (roles, tool calls, messages dropped or inserted)",
    "reply_rerendered": "the chat template resends the previous reply with other tokens than the server generated (reasoning "
    "stripped, whitespace, tool-call formatting): the server's cached reply is lost from there on",
    "short_prefix": "the common prefix is shorter than one block, so a block cache reuses none of it",
    "block_straddle": "the common prefix ends mid-block: a block cache recomputes the partial block",
    "observed_shortfall": "the server reported fewer cached tokens than the simulated engine reuses (eviction, a replica, a TTL, "
    "another block size or tokenizer)",
    "observed_excess": "the server reported more cached tokens than the simulated engine reuses: the simulation missed something",
}
UNRELATED_FIELDS = 4  # more changed values (or messages) than this: the match is another prompt, not this one with new values
_KINDS = {"datetime": "clock", "uuid": "id", "id": "id", "hex": "nonce", "number": "counter"}
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Cause(Record):
    """One reason a request misses the cache: a ``CAUSES`` name, the field it concerns (if any), what changed in
    words, and ``tokens``: the newer request's tokens recomputed from this change on that the match would otherwise
    have served (for the block causes, the tokens of the prefix a block cache loses)."""

    name: str
    field: str | None = dataclasses.field(default=None, kw_only=True)
    detail: str
    tokens: int


def differing_messages(old: Request, new: Request) -> int:
    """The messages both chat requests hold at the same place that differ, plus one for a changed tool list (0 for
    a request that only grows its match, and for completions prompts)."""
    if old.messages is None or new.messages is None:
        return 0
    return sum(a != b for a, b in zip(old.messages, new.messages)) + (old.tools != new.tools)


def another_prompt(old: Request, new: Request) -> bool:
    """Whether the match is another prompt that shares boilerplate (a system prompt, tools), by its messages alone:
    more than ``UNRELATED_FIELDS`` of them differ, so a token diff would only list the differences (and is skipped)."""
    return differing_messages(old, new) > UNRELATED_FIELDS


def causes_of(old: RenderedRequest | None, new: RenderedRequest, diff: TurnDiff | None, block: int) -> tuple[Cause, ...]:
    """Every cause of ``new``'s misses against ``old`` (the request it was matched with), in token order; none for
    a request that only grows its match. ``diff`` is None only where there is no match or it is ``another_prompt``."""
    shared = diff.common_prefix_tokens if diff is not None else common_prefix(old.token_ids, new.token_ids) if old is not None else 0
    if old is None or shared == 0:
        return (Cause("new_prefix", CAUSES["new_prefix"], len(new)),)
    if diff is None:
        detail = f"shares {shared} tokens with {old.request.where}, then differs in {differing_messages(old.request, new.request)} messages"
        return (Cause("other_conversation", detail, len(new) - shared),)
    if len(diff.fields) > UNRELATED_FIELDS:  # another prompt sharing boilerplate, not a prompt with changed values
        detail = f"shares {shared} tokens with {old.request.where}, then differs in {len(diff.fields)} places"
        return (Cause("other_conversation", detail, len(new) - shared),)
    served = diff.growth_start  # what the match could serve: everything before the growth
    found = _field_causes(old, new, diff.fields, served)
    if diff.structural:
        found.append(_structural_cause(old, new, diff, served))
    if not found and diff.common_prefix_tokens >= diff.old_growth_start:
        return tuple(_reply_cause(old, new))
    if not found:  # the older request's tail was dropped: the newer one is shorter
        found.append(Cause("history_rewritten", f"the request stops where {old.request.where} went on", 0))
    if shared < block:
        found.append(Cause("short_prefix", f"{shared} shared tokens, under one {block}-token block", shared))
    elif shared % block:
        found.append(Cause("block_straddle", f"the prefix ends {shared % block} tokens into a {block}-token block", shared % block))
    return tuple(found)


def _reply_cause(old: RenderedRequest, new: RenderedRequest) -> list[Cause]:
    """``reply_rerendered`` where ``new`` goes on from ``old``'s conversation with its reply, whose logged tokens the
    server cached, yet the template writes that reply otherwise: the tokens of the cached reply lost."""
    before, after = old.request.messages, new.request.messages
    if not len(old.reply_ids) or before is None or after is None or len(after) <= len(before):
        return []
    if after[: len(before)] != before or after[len(before)].role != "assistant":
        return []
    held = old.held
    kept = common_prefix(held, new.token_ids)
    if kept >= len(held) or kept < len(old):
        return []
    detail = (
        f"the server cached {len(old.reply_ids)} reply tokens of {old.request.where}; this turn resends the reply as the "
        f"template writes it, which differs after {kept - len(old)} of them"
    )
    return [Cause("reply_rerendered", detail, len(held) - kept)]


def _field_causes(old: RenderedRequest, new: RenderedRequest, fields: tuple[FieldChange, ...], served: int) -> list[Cause]:
    """One cause per changed field, except that a message whose JSON is the same object, or whose text differs only
    in whitespace, gives one ``key_order`` or ``whitespace`` cause."""
    causes, whole, checked = [], set(), set()  # messages given one cause as a whole; messages checked for that
    for change in fields:
        if change.message in whole:
            continue
        lost = max(served - change.start, 0)
        before, after = old.request.contents[change.message], new.request.contents[change.message]
        first = change.message not in checked
        checked.add(change.message)
        if first and _same_json(before, after):
            whole.add(change.message)
            causes.append(Cause("key_order", f"message {change.message + 1}: the same JSON object, keys in another order", lost))
        elif first and _SPACE.sub("", before) == _SPACE.sub("", after):
            whole.add(change.message)
            causes.append(Cause("whitespace", f"message {change.message + 1}: whitespace only", lost))
        else:
            kind = _KINDS.get(value_kind(change.new) or value_kind(change.old) or "", "value")
            causes.append(Cause(kind, f"{change.name}: {change.old!r} -> {change.new!r}", lost, field=change.name))
    return causes


def _structural_cause(old: RenderedRequest, new: RenderedRequest, diff: TurnDiff, served: int) -> Cause:
    """A change outside the messages' text: the tools (changed, reordered, or keys reordered), else the history."""
    lost = max(served - min(start for _, _, start, _ in diff.structural), 0)
    before, after = old.request.tools, new.request.tools
    if before != after:
        old_tools, new_tools = old.request.tool_definitions(), new.request.tool_definitions()
        if old_tools == new_tools:
            return Cause("key_order", "the tool definitions: the same objects, keys in another order", lost)
        canonical = sorted(json.dumps(tool, sort_keys=True) for tool in old_tools)
        if canonical == sorted(json.dumps(tool, sort_keys=True) for tool in new_tools):
            return Cause("tools_reordered", f"tools {_names(old_tools)} -> {_names(new_tools)}", lost)
        added = sorted(set(_names(new_tools)) - set(_names(old_tools)))
        removed = sorted(set(_names(old_tools)) - set(_names(new_tools)))
        words = ", ".join([*(f"added {name}" for name in added), *(f"removed {name}" for name in removed)]) or "a definition edited"
        return Cause("tools_changed", f"tools: {words}", lost)
    count = len(old.request.messages or ()), len(new.request.messages or ())
    return Cause("history_rewritten", f"{count[0]} messages -> {count[1]}: roles, tool calls or turns differ before the end", lost)


def _names(tools: list[dict]) -> list[str]:
    functions = [tool.get("function") if isinstance(tool.get("function"), dict) else tool for tool in tools]
    return [str(function.get("name")) for function in functions]


def _same_json(a: str, b: str) -> bool:
    if a == b or not a.lstrip().startswith(("{", "[")):
        return False
    try:
        return json.loads(a) == json.loads(b)
    except json.JSONDecodeError:
        return False
