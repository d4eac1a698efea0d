"""What an OpenAI-compatible endpoint answers to one prompt (``Probe``): the first position's top-k log-probs,
the greedy tokens and text, and what it reports of its own cache (``Answer``), read from either route's JSON
(``read_answer``), every missing part named."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvscope.engine.audit.logs.usage import answer_usage
from kvscope.engine.errors import KVScopeError

Token = int | str  # a token id where the server gives it, else its text


class EndpointError(KVScopeError):
    """An endpoint that cannot be measured on: it is unreachable, serves another model, or gives no log-probabilities."""


@dataclass(frozen=True)
class Probe:
    """One prompt to answer: the route, the body (without the model, which the client adds) and its lane."""

    route: str
    body: dict
    lane: str | None = None  # the session: requests of one lane are sent one after another


@dataclass(frozen=True)
class Answer:
    """An endpoint's answer to one probe: the first generated position's top-k log-probs, the greedy tokens and text,
    and what the server reports of its own cache."""

    top: dict[Token, float]
    generated: tuple[Token, ...]
    text: str
    prompt_tokens: int | None
    cached_tokens: int | None  # ``usage.answer_usage``: usage's cached tokens, or llama-server's timings.cache_n; None: not reported

    @property
    def top1(self) -> Token:
        return max(self.top, key=self.top.__getitem__)

    def ranked(self, count: int) -> list[Token]:
        return sorted(self.top, key=lambda token: -self.top[token])[:count]


# ------------------------------------------------------------------------------------------------ reading answers
def _token(entry: Mapping[str, Any]) -> Token:
    if isinstance(entry.get("id"), int):
        return entry["id"]
    return _token_text(entry.get("token", ""))


def _token_text(text: str) -> Token:
    """vLLM's ``return_tokens_as_token_ids`` writes ``token_id:123``."""
    return int(text[9:]) if text.startswith("token_id:") and text[9:].isdigit() else text


def read_answer(data: Mapping[str, Any], where: str) -> Answer:
    """An answer from a completions or chat completions response (either log-prob shape); EndpointError without
    log-probabilities."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise EndpointError(f"{where} answered without choices: {json.dumps(data)[:300]}") from None
    logprobs = choice.get("logprobs") or {}
    text = choice.get("text")
    if text is None:
        text = (choice.get("message") or {}).get("content") or ""
    if logprobs.get("content"):  # the chat shape (OpenAI chat, llama-server, vLLM and SGLang chat)
        content = logprobs["content"]
        generated = tuple(_token(entry) for entry in content)
        top = {_token(entry): float(entry["logprob"]) for entry in content[0].get("top_logprobs") or []}
    elif logprobs.get("top_logprobs"):  # the legacy completions shape (OpenAI, vLLM, SGLang)
        generated = tuple(_token_text(token) for token in logprobs.get("tokens") or [])
        top = {_token_text(token): float(value) for token, value in (logprobs["top_logprobs"][0] or {}).items()}
    else:
        top, generated = {}, ()
    if not top:
        raise EndpointError(
            f"{where} returned no log-probabilities, so it cannot measure a repair's next-token distribution "
            "(vLLM: raise --max-logprobs; a hosted API: pick a model that returns logprobs)"
        )
    usage = answer_usage(data)  # as the logs' usage is read: usage's cached tokens, else llama-server's timings
    cached = usage.cached
    if data.get("prompt_logprobs") is not None:
        cached = None  # vLLM reads no cache for a request that asks for prompt log-probs: its 0 is not the server's reuse
    return Answer(top, generated, text, usage.prompt, cached)
