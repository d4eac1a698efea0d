"""The reply a log records beside a request, and the tokens of it a server keeps in its prefix cache (each engine's
rule, with its source: docs/audit.md, "Replies").

The last sampled token is never fed back through the model, so its K/V is never computed: a reply that ended on the
end-of-turn token (EOS) leaves every token of its text cached, one cut at ``max_tokens`` its text less its last token.
``Reply.finish`` tells the two apart (``FINISHES``); a reply whose finish the log does not say is taken as ended on EOS.
A reply is read from every shape a log records it in (OpenAI chat, completions and Responses, Anthropic messages,
llama-server's ``/completion``, a bare assistant message or text), the token ids a server returned used as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# How a generation ended, normalised from each API's words.
FINISHES = {
    "eos": "ended on the model's end-of-turn token (stop, end_turn, tool_calls, tool_use, eos)",
    "length": "cut at max_tokens (length, max_tokens, limit, max_output_tokens)",
    "unknown": "the log does not say how it ended: taken as ended on the end-of-turn token",
}
_EOS = {"stop", "eos", "end_turn", "tool_calls", "tool_use", "function_call", "stop_sequence", "word", "completed", "end"}
_LENGTH = {"length", "max_tokens", "limit", "max_output_tokens", "max_completion_tokens", "incomplete"}
# Where the reply came from: logged beside the request, or read off the next turn of its session, which resends it.
REPLY_ORIGINS = {
    "token_ids": "the token ids the server returned",
    "text": "the reply text the log records",
    "next_turn": "the next turn of its session, which resends it (the log records no reply)",
}


@dataclass(frozen=True)
class Reply:
    """A generation as logged: its text (content), its tool calls (OpenAI-shaped dicts), the token ids the server
    returned (None: not returned), and how it ended (``FINISHES``)."""

    text: str = ""
    tool_calls: tuple[dict, ...] = ()
    token_ids: tuple[int, ...] | None = None
    finish: str = "unknown"
    source: str = "text"  # REPLY_ORIGINS

    def as_message(self) -> dict:
        """The reply as the assistant message a chat client sends back on the next turn."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        return message


def finish_of(value: Any) -> str:
    """An API's finish or stop reason as one of ``FINISHES``."""
    word = str(value).strip().lower() if isinstance(value, str) else ""
    if word in _LENGTH:
        return "length"
    if word in _EOS:
        return "eos"
    return "unknown"


def reply_of(response: Any) -> Reply | None:
    """The first generation of a logged response in any shape this module reads (None: none is there)."""
    if isinstance(response, str):
        try:
            response = json.loads(response)
        except json.JSONDecodeError:
            return Reply(text=response) if response else None
    if not isinstance(response, dict):
        return None
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return _choice(choices[0])
    if response.get("type") == "message" and isinstance(response.get("content"), list):
        return _anthropic(response)
    if isinstance(response.get("output"), list):
        return _responses(response)
    if "content" in response and ("stop_type" in response or "tokens_predicted" in response):
        return _llama_server(response)
    if response.get("role") == "assistant":
        return _message(response, None, None)
    return None


def _choice(choice: dict) -> Reply | None:
    ids = _ids(choice.get("token_ids"))
    finish = finish_of(choice.get("finish_reason"))
    if isinstance(choice.get("message"), dict):
        return _message(choice["message"], finish, ids)
    if isinstance(choice.get("text"), str):  # completions
        return Reply(choice["text"], (), ids, finish, "token_ids" if ids is not None else "text")
    return None


def _message(message: dict, finish: str | None, ids: tuple[int, ...] | None) -> Reply | None:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    calls = tuple(call for call in message.get("tool_calls") or () if isinstance(call, dict))
    if not isinstance(content, str):
        content = ""
    if not content and not calls and ids is None:
        return None
    return Reply(content, calls, ids, finish or finish_of(message.get("finish_reason")), "token_ids" if ids is not None else "text")


def _anthropic(response: dict) -> Reply | None:
    texts, calls = [], []
    for block in response["content"]:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text":
            texts.append(str(block.get("text", "")))
        elif block.get("type") == "tool_use":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append({"id": block.get("id"), "type": "function", "function": {"name": block.get("name"), "arguments": arguments}})
    if not texts and not calls:
        return None
    return Reply("".join(texts), tuple(calls), None, finish_of(response.get("stop_reason")))


def _responses(response: dict) -> Reply | None:
    texts, calls = [], []
    for item in response["output"]:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            texts += [str(part.get("text", "")) for part in item.get("content") or () if isinstance(part, dict)]
        elif item.get("type") == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}
            calls.append({"id": item.get("call_id"), "type": "function", "function": function})
    if not texts and not calls:
        return None
    details = response.get("incomplete_details") if isinstance(response.get("incomplete_details"), dict) else {}
    return Reply("".join(texts), tuple(calls), None, finish_of(details.get("reason") or response.get("status")))


def _llama_server(response: dict) -> Reply | None:
    ids = _ids(response.get("tokens")) or None
    finish = finish_of(response.get("stop_type"))
    content = response.get("content")
    return Reply(content if isinstance(content, str) else "", (), ids, finish, "token_ids" if ids is not None else "text")


def _ids(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        return tuple(value)
    return None


def computed_tokens(generated: list[int], finish: str, ends_on_eos: bool) -> list[int]:
    """The generated tokens whose K/V a server computed (so caches): all but the last sampled token. ``generated``:
    the reply's tokens; ``ends_on_eos``: they include the end-of-turn token (a server's own ids do, text does not).
    A reply taken from its text ended on EOS (or ``unknown``) keeps every text token; one cut at max_tokens keeps
    all but its last."""
    if ends_on_eos or finish == "length":
        return generated[:-1]
    return generated
