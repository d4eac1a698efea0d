"""A whole log rewritten by a policy, offline (``kvscope rewrite``): every request in the log's order through
``rewrite.rewrite_request`` with one session state, written as JSONL that ``kvscope audit LOG --rewritten FILE`` reads
and pairs with the original (the same requests, in the same order, each with its session key)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvscope.engine.audit.logs.requests import Request
from kvscope.engine.audit.policy.document import Policy
from kvscope.engine.audit.policy.rewrite import DEFAULT_SESSIONS, SessionState, rewrite_request


def rewrite_log(requests: Sequence[Request], policy: Policy, sessions: int = DEFAULT_SESSIONS) -> list[Request]:
    """Every request of a log (in its order) as the policy sends it, one session state across them."""
    state = SessionState(sessions)
    return [rewrite_request(request, state, policy) for request in requests]


def request_record(request: Request) -> dict:
    """One request as an OpenAI chat (or completions) record: its messages as chat templates read them, its tools, its
    model and its session key (``session_id``)."""
    record: dict = {"model": request.model} if request.model else {}
    if request.messages is None:
        record["prompt"] = request.prompt
    else:
        record["messages"] = [message.template_dict() for message in request.messages]
    if request.tools:
        record["tools"] = request.tool_definitions()
    if request.session is not None:
        record["session_id"] = request.session
    return record


def log_text(requests: Sequence[Request]) -> str:
    """The requests as JSONL, one record a line."""
    return "".join(json.dumps(request_record(request), ensure_ascii=False) + "\n" for request in requests)
