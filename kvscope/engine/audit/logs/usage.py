"""What a server or provider reported caching for one request, read from the usage a log records beside it, one
entry per usage shape (``SHAPES``; where each shape keeps its counts: docs/audit.md, "Usage shapes").

A count the record leaves null or omits is None: not reported, which is not zero. A count that is not an integer,
is negative, or exceeds the record's own prompt count is dropped to None and flagged (key and why); the request is
kept. Whether a count exceeds the rendered prompt is only known after tokenizing, so it is not checked here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ObservedUsage:
    """Prompt tokens reported read from and written to the cache (None: not reported, or flagged), and the flags:
    ``(key, reason)`` for each count dropped."""

    cached: int | None = None
    written: int | None = None
    flags: tuple[tuple[str, str], ...] = ()
    prompt: int | None = None  # the record's own prompt count, in the server's or provider's tokens (None: not logged)

    def fields(self) -> dict:
        """The keys a reader adds to its request (``Request``'s observed fields, and the flags to report)."""
        return {
            "observed_cached_tokens": self.cached,
            "observed_cache_write_tokens": self.written,
            "observed_prompt_tokens": self.prompt,
            "flags": list(self.flags),
        }


def observed_usage(usage: Any, shape: str, key: str = "usage") -> ObservedUsage:
    """The cached and written prompt tokens of one usage object in ``shape`` (``SHAPES``); ``key`` names where the
    object sits in the record, for the flags ("": the record itself)."""
    if not isinstance(usage, dict):
        return ObservedUsage()
    if shape not in SHAPES:
        raise ValueError(f"unknown usage shape {shape!r}; one of {', '.join(SHAPES)}")
    read_key, write_key, read, written, prompt = SHAPES[shape].read(usage)
    valid_prompt = prompt if _is_count(prompt) else None
    cached, cached_flag = _checked(read, f"{key}.{read_key}" if key else read_key, valid_prompt)
    write, write_flag = _checked(written, f"{key}.{write_key}" if key else write_key, valid_prompt)
    return ObservedUsage(cached, write, tuple(flag for flag in (cached_flag, write_flag) if flag), valid_prompt)


def response_usage(response: Any) -> tuple[Any, str]:
    """The usage object of a provider's response, and its shape: the first shape (in ``SHAPES``' order) whose ``found``
    finds its usage in the response (llama-server's native ``timings``, OpenRouter's generation stats, Anthropic's),
    else OpenAI's ``usage``."""
    if not isinstance(response, dict):
        return None, "openai"
    for shape in SHAPES.values():
        usage = shape.found(response) if shape.found else None
        if usage is not None:
            return usage, shape.name
    return response.get("usage"), "openai"


def answer_usage(response: Any) -> ObservedUsage:
    """What a live answer reports of the server's cache (a completions or chat completions response, or a stream's
    chunk that carries the usage): its usage in the shape ``response_usage`` finds, and where that names no cached
    count, llama-server's ``timings.cache_n``. The endpoint's answers (``endpoint.answers``) and the serving
    benchmarks' load generator read their counts here, as the logs' readers do."""
    usage, shape = response_usage(response)
    observed = observed_usage(usage, shape)
    timings = response.get("timings") if isinstance(response, dict) else None
    if observed.cached is None and shape != "llama_server" and isinstance(timings, dict):
        served = observed_usage(timings, "llama_server", "timings")
        observed = dataclasses.replace(observed, cached=served.cached, flags=observed.flags + served.flags)
    return observed


def answer_marks(response: Any) -> tuple[str, ...]:
    """What a server's answer says about the server that wrote it, engine-neutral: the keys it carries (its own, and
    its choices' as ``choices.KEY``) and its ``system_fingerprint`` as ``system_fingerprint=VALUE``. Each serving
    engine's entry reads its own marks in them (``PrefixCache.wrote``); nothing here names an engine."""
    if not isinstance(response, dict):
        return ()
    choices = response.get("choices") if isinstance(response.get("choices"), list) else []
    keys = {*response, *(f"choices.{key}" for choice in choices if isinstance(choice, dict) for key in choice)}
    fingerprint = response.get("system_fingerprint")
    return tuple(sorted(keys | ({f"system_fingerprint={fingerprint}"} if isinstance(fingerprint, str) and fingerprint else set())))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _sum(first: Any, *rest: Any) -> int | None:
    """A prompt count made of parts: None unless the first is a count; parts not reported count as zero."""
    if not _is_count(first):
        return None
    return first + sum(part for part in rest if _is_count(part))


def _checked(value: Any, key: str, prompt: int | None) -> tuple[int | None, tuple[str, str] | None]:
    """The count, or None with a flag saying why it cannot be a count of this request's cached tokens."""
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, int):
        return None, (key, f"is {value!r}, not an integer count of tokens; read as not reported")
    if value < 0:
        return None, (key, f"is negative ({value}); read as not reported")
    if prompt is not None and value > prompt:
        return None, (key, f"is {value:,} tokens, more than the record's own prompt of {prompt:,}; read as not reported")
    return value, None


# ---------------------------------------------------------------------------------------- each shape, one entry
Raw = tuple[str, str, Any, Any, Any]  # (read key, written key, read, written, the record's prompt count) as logged


def _openai(usage: dict) -> Raw:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    read_key = "prompt_tokens_details.cached_tokens"
    if cached is None and usage.get("cache_read_input_tokens") is not None:  # LiteLLM's, from Anthropic
        cached, read_key = usage["cache_read_input_tokens"], "cache_read_input_tokens"
    return read_key, "cache_creation_input_tokens", cached, usage.get("cache_creation_input_tokens"), usage.get("prompt_tokens")


def _anthropic(usage: dict) -> Raw:
    read, written = usage.get("cache_read_input_tokens"), usage.get("cache_creation_input_tokens")
    return "cache_read_input_tokens", "cache_creation_input_tokens", read, written, _sum(usage.get("input_tokens"), read, written)


def _anthropic_found(response: dict) -> Any:
    usage = response.get("usage")
    anthropic = isinstance(usage, dict) and "prompt_tokens" not in usage
    return usage if anthropic and ("input_tokens" in usage or "cache_read_input_tokens" in usage) else None


def _openrouter_found(response: dict) -> Any:
    holders = (response, response.get("data"), response.get("usage"))
    return next((holder for holder in holders if isinstance(holder, dict) and "native_tokens_cached" in holder), None)


def _langfuse(usage: dict) -> Raw:
    read_key = "input_cached_tokens" if "input_cached_tokens" in usage else "input_cache_read"
    read, written = usage.get(read_key), usage.get("input_cache_creation")
    return read_key, "input_cache_creation", read, written, _sum(usage.get("input"), read, written)


def _helicone(usage: dict) -> Raw:
    read, written = usage.get("prompt_cache_read_tokens"), usage.get("prompt_cache_write_tokens")
    prompt = usage.get("prompt_tokens")
    if str(usage.get("provider") or "").upper() == "ANTHROPIC":  # Anthropic's own input count excludes the cache
        prompt = _sum(prompt, read, written)
    return "prompt_cache_read_tokens", "prompt_cache_write_tokens", read, written, prompt


def _otel(usage: dict) -> Raw:
    read_key, write_key = "gen_ai.usage.cache_read.input_tokens", "gen_ai.usage.cache_creation.input_tokens"
    return read_key, write_key, usage.get(read_key), usage.get(write_key), usage.get("gen_ai.usage.input_tokens")


def _llama_server_found(response: dict) -> Any:
    timings = response.get("timings")
    return timings if "usage" not in response and isinstance(timings, dict) and "cache_n" in timings else None


@dataclass(frozen=True)
class UsageShape:
    """One shape a usage object comes in (the table above): its name, how its counts are read (``read``: ``Raw``), and
    where a provider's response holds it (``found``: None where a log's reader names the shape itself)."""

    name: str
    read: Callable[[dict], Raw]
    found: Callable[[dict], Any] | None = None


SHAPES = {  # ``response_usage`` tries each ``found`` in this order; adding a shape is adding an entry here
    shape.name: shape
    for shape in (
        UsageShape(
            "llama_server",
            lambda u: ("cache_n", "", u.get("cache_n"), None, _sum(u.get("prompt_n"), u.get("cache_n"))),
            _llama_server_found,
        ),
        UsageShape(
            "openrouter",
            lambda u: ("native_tokens_cached", "", u.get("native_tokens_cached"), None, u.get("native_tokens_prompt")),
            _openrouter_found,
        ),
        UsageShape("anthropic", _anthropic, _anthropic_found),
        UsageShape("openai", _openai),
        UsageShape("langfuse", _langfuse),
        UsageShape("helicone", _helicone),
        UsageShape("otel", _otel),
    )
}
