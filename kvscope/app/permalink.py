"""Permalinks: a Notes-tab state as a URL query, and back, parsed strictly (no Gradio imports here).

A link names a bundled scenario (``scenario=refund_gate``) or carries the scenario's TOML itself, zlib-compressed
and URL-safe base64 encoded (``toml=…``), at most :data:`MAX_ENCODED_TOML` characters; never a server path. With it
travel the field, the new value, the strategies, K, the attention head, the composer's remedy and the two
checkboxes. Every value is checked against what the page offers, and a bad one is refused with a message that
names it: the page then stays as it was.
"""

from __future__ import annotations

import base64
import binascii
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

from kvscope.app.handlers.common import AppError, bundled_scenario_text, parse_scenario
from kvscope.app.handlers.notes import EditInputs
from kvscope.app.hosting import HostingProfile
from kvscope.engine import AUTO_REMEDY, RENAMED_STRATEGIES, KVScopeError, Remedy, bundled_scenarios

MAX_ENCODED_TOML = 8192  # characters of the toml parameter (8 KB): a URL stays well within what browsers and proxies take
MAX_DECODED_BYTES = 512 * 1024  # a compressed scenario may not expand beyond this (no zip bombs)
MAX_VALUE_CHARS = 200
KEYS = ("scenario", "toml", "field", "value", "strategies", "k", "head", "remedy", "separately", "all")
GRADIO_KEYS = ("view", "ui", "write_token")  # the page's own query parameters (and any starting with "__")
BOUND_WORDS = (
    f"Bundled scenarios travel by name; an edited or uploaded scenario travels in the link, compressed, up to "
    f"{MAX_ENCODED_TOML // 1024} KB ({MAX_ENCODED_TOML:,} characters) encoded."
)
_BASE64 = re.compile(r"[A-Za-z0-9_-]+")
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


class LinkError(AppError):
    """A link this page cannot restore; the message names the parameter and what it accepts."""


@dataclass(frozen=True)
class NotesLink:
    """A Notes-tab state restored from a link (every value checked)."""

    edit: EditInputs  # the Notes tab's edit it restores: its text is the scenario's TOML as the editor holds it
    scenario: str | None  # the bundled scenario's name, when the link named one
    remedy: str | None
    ignored: tuple[str, ...] = ()  # parameters that are not KVScope's

    def summary(self) -> str:
        """What was restored, in a line (Markdown-safe parts are the caller's job)."""
        edit = self.edit
        where = f"bundled scenario {self.scenario}" if self.scenario else "the scenario carried in the link"
        return f"{where}, {edit.field} → {edit.new}, strategies {', '.join(edit.strategies) or '(default)'}, K {edit.top_k}"


# ---------------------------------------------------------------------------- TOML in a link
def encode_toml(text: str) -> str:
    """Scenario text as a link parameter: zlib (level 9) then URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"), 9)).decode("ascii").rstrip("=")


def decode_toml(token: str) -> str:
    """The scenario text of a ``toml`` parameter, refused when too long, not URL-safe base64, not zlib, expanding
    past :data:`MAX_DECODED_BYTES` or not UTF-8."""
    if len(token) > MAX_ENCODED_TOML:
        raise LinkError(f"the link's scenario is {len(token):,} characters encoded; a link carries at most {MAX_ENCODED_TOML:,}")
    if not _BASE64.fullmatch(token):
        raise LinkError("the link's scenario (toml=…) is not URL-safe base64 (letters, digits, - and _ only)")
    try:
        data = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (binascii.Error, ValueError) as error:
        raise LinkError("the link's scenario (toml=…) is not valid base64: it was cut or altered") from error
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(data, MAX_DECODED_BYTES)
    except zlib.error as error:
        raise LinkError("the link's scenario (toml=…) is not zlib-compressed text: it was cut or altered") from error
    if inflate.unconsumed_tail:
        raise LinkError(f"the link's scenario expands past {MAX_DECODED_BYTES // 1024} KB; links carry small scenarios only")
    if not inflate.eof:
        raise LinkError("the link's scenario (toml=…) ends early: the link was cut")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise LinkError("the link's scenario is not UTF-8 text") from error


# ---------------------------------------------------------------------------- state -> link
def bundled_name(text: str, hint: str | None = None) -> str | None:
    """The bundled scenario whose file is ``text`` (``hint`` tried first), or None. Whitespace around the whole text
    is not compared: the editor strips it, and it means nothing in TOML."""
    names = sorted(bundled_scenarios())
    for name in ([hint] if hint in names else []) + names:
        if bundled_scenario_text(name).strip() == text.strip():
            return name
    return None


def link_query(edit: EditInputs, *, hint: str | None = None, remedy: str | None = None) -> str:
    """The query (``?scenario=…&field=…``) of a Notes-tab state (``hint``: the bundled scenario the menu names, tried
    first; ``remedy``: the composer's); an unbundled scenario travels compressed, refused beyond :data:`MAX_ENCODED_TOML`."""
    text = edit.text or ""
    if not text.strip():
        raise LinkError("the scenario editor is empty: there is nothing to link to")
    name = bundled_name(text, hint)
    params: dict[str, str] = {}
    if name:
        params["scenario"] = name
    else:
        token = encode_toml(text)
        if len(token) > MAX_ENCODED_TOML:
            raise LinkError(
                f"this scenario takes {len(token):,} characters in a link (compressed); a link carries at most "
                f"{MAX_ENCODED_TOML:,} ({MAX_ENCODED_TOML // 1024} KB): pick a bundled scenario, or share the exported files"
            )
        params["toml"] = token
    if edit.field:
        params["field"] = edit.field
    if edit.new:
        params["value"] = edit.new
    params["strategies"] = ",".join(edit.strategies or ())
    for key, number in (("k", edit.top_k), ("head", edit.head)):
        if number is not None and number != "":
            params[key] = str(int(float(number)))
    if remedy and remedy.strip():
        params["remedy"] = remedy.strip()
    params["separately"] = "1" if edit.separately else "0"
    params["all"] = "1" if edit.all_positions else "0"
    return "?" + urlencode(params)


# ---------------------------------------------------------------------------- link -> state
def is_link(params: Mapping[str, str]) -> bool:
    """Whether a page's query asks to restore a state (any KVScope parameter present)."""
    return any(key in params for key in KEYS)


def _integer(params: Mapping[str, str], key: str, default: int, low: int, high: int, what: str) -> int:
    raw = params.get(key)
    if raw is None or raw == "":
        return default
    if not re.fullmatch(r"-?\d{1,6}", raw.strip()):
        raise LinkError(f"{key}={raw!r} in the link is not a whole number; {what} takes {low} to {high}")
    number = int(raw)
    if not low <= number <= high:
        raise LinkError(f"{key}={number} in the link is out of range; {what} takes {low} to {high}")
    return number


def _flag(params: Mapping[str, str], key: str) -> bool:
    raw = (params.get(key) or "0").strip().lower()
    if raw not in _FLAGS:
        raise LinkError(f"{key}={params.get(key)!r} in the link is not a yes/no flag; use 1 or 0")
    return _FLAGS[raw]


def parse_link(
    params: Mapping[str, str],
    *,
    offered_strategies: Sequence[str],
    default_strategies: Sequence[str],
    heads: int,
    k_range: tuple[int, int] = (1, 64),
    default_k: int = 8,
    profile: HostingProfile | None = None,
) -> NotesLink | None:
    """The Notes-tab state a page's query asks for (None when it asks for none), every value checked: a bundled
    scenario by name or the TOML carried in the link, a field of that scenario, a new value without braces,
    strategies the page offers, K and the head within the sliders' ranges, a remedy the composer parses."""
    params = {str(key): str(value) for key, value in dict(params).items()}
    if not is_link(params):
        return None
    ignored = tuple(sorted(key for key in params if key not in KEYS and key not in GRADIO_KEYS and not key.startswith("__")))
    if "scenario" in params and "toml" in params:
        raise LinkError("the link names a bundled scenario and carries one too (scenario= and toml=): keep one")
    if "scenario" in params:
        name = params["scenario"]
        if name not in bundled_scenarios():
            raise LinkError(f"unknown scenario {name!r} in the link; bundled: {', '.join(sorted(bundled_scenarios()))}")
        text = bundled_scenario_text(name)
    elif "toml" in params:
        name, text = None, decode_toml(params["toml"])
    else:
        raise LinkError("the link names no scenario: add scenario=NAME (a bundled one) or toml=… (a copied link)")
    try:
        scenario = parse_scenario(text, profile)
    except AppError as error:
        raise LinkError(f"the link's scenario does not parse: {error}") from error
    field_name = params.get("field") or scenario.field().name
    if field_name not in scenario.fields:
        raise LinkError(f"unknown field {field_name!r} in the link; scenario {name or scenario.name!r} has: {', '.join(scenario.fields)}")
    value = params["value"] if "value" in params else scenario.fields[field_name].new
    if not value.strip() or "{" in value or "}" in value or len(value) > MAX_VALUE_CHARS or not value.isprintable():
        raise LinkError(
            f"value={value[:40]!r} in the link is not a new value: it must be non-empty printable text of at most "
            f"{MAX_VALUE_CHARS} characters, without braces"
        )
    if "strategies" in params:
        named = (s.strip() for s in params["strategies"].split(",") if s.strip())
        strategies = tuple(dict.fromkeys(RENAMED_STRATEGIES.get(name, name) for name in named))  # a link made before a rename
    else:
        strategies = tuple(default_strategies)
    unknown = [name for name in strategies if name not in offered_strategies]
    if unknown:
        names = ", ".join(map(repr, unknown))
        raise LinkError(f"unknown strategy {names} in the link; choose from {', '.join(offered_strategies)}")
    if profile is not None:
        try:
            profile.checked_strategies(strategies)
        except KVScopeError as error:
            raise LinkError(str(error)) from error
    k = _integer(params, "k", default_k, *k_range, "K")
    head = _integer(params, "head", -1, -1, heads - 1, "the attention head (-1 = mean over heads)")
    remedy = params.get("remedy") or None
    # empty is the default remedy; auto names the loaded model's calibrated choice
    if remedy is not None and remedy.strip() not in ("", AUTO_REMEDY):
        try:
            Remedy.parse(remedy.strip())
        except KVScopeError as error:
            raise LinkError(f"remedy={remedy!r} in the link: {error}") from error
    edit = EditInputs(
        text.strip(),  # as the editor holds it (gr.Code strips it; whitespace around TOML means nothing)
        field=field_name,
        new=value,
        strategies=strategies,
        top_k=k,
        head=head,
        separately=_flag(params, "separately"),
        all_positions=_flag(params, "all"),
    )
    return NotesLink(edit, scenario=name, remedy=remedy, ignored=ignored)
