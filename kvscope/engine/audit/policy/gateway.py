"""The policy applied to a proxy's request body (the LiteLLM hook, deploy/litellm/kvscope_hook.py, calls
``Gateway.rewrite_body``): the body read as the audit reads a chat request (``reading.record_requests``: its messages, its
session key), rewritten by ``rewrite.rewrite_request``, and the changed messages' text written back.

It never fails a request: a body it cannot read (no messages, a content part that is not text, anything the reader
refuses), a message whose content is not plain text where the rewrite changes it, or any error inside it, returns the
body exactly as given, with the reason. Only the ``content`` of the messages the rewrite changed is replaced, in a copy;
every other key of the body and of its messages is kept as it came.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.engine.audit.logs.formats import RecordError
from kvscope.engine.audit.logs.reading import record_requests
from kvscope.engine.audit.policy.document import Policy, PolicyError, load_policy
from kvscope.engine.audit.policy.rewrite import DEFAULT_SESSIONS, SessionState, rewrite_request

CONFIG = """\
# A LiteLLM proxy in front of a vLLM server, with KVScope's repair policy applied to every chat request
# (docs/deploy.md). Run from the folder holding this file and kvscope_hook.py, kvscope importable, the policy named:
#   KVSCOPE_POLICY=policy.json PYTHONPATH=../.. litellm --config config.yaml --host 127.0.0.1 --port 4000
model_list:
  - model_name: served
    litellm_params:
      model: hosted_vllm/{served}  # the model vLLM serves (its --served-model-name)
      api_base: {api_base}  # vLLM's OpenAI-compatible server

litellm_settings:
  callbacks: kvscope_hook.proxy_handler_instance  # kvscope_hook.py beside this file
"""
POLICY_ENV = "KVSCOPE_POLICY"  # the policy file a gateway loads at start
SESSIONS_ENV = "KVSCOPE_POLICY_SESSIONS"  # how many sessions' first values it keeps (default ``DEFAULT_SESSIONS``)


def hook_config(served: str = "Qwen/Qwen2.5-0.5B-Instruct", api_base: str = "http://127.0.0.1:8000/v1") -> str:
    """The LiteLLM proxy's config.yaml naming the hook (deploy/litellm/config.yaml holds the default; a test keeps it
    equal), in front of ``served`` at ``api_base``."""
    return CONFIG.format(served=served, api_base=api_base)


@dataclass(frozen=True)
class Outcome:
    """What the gateway did to one body: the body to send, and what was done or why nothing was."""

    body: Any
    rewritten: bool
    reason: str


@dataclass
class Gateway:
    """A loaded policy and its sessions' state."""

    policy: Policy
    state: SessionState = field(default_factory=SessionState)

    @classmethod
    def from_file(cls, path: str | Path, sessions: int = DEFAULT_SESSIONS) -> Gateway:
        """The gateway of the policy file at ``path``, refused at start (``PolicyError``) where it is malformed."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise PolicyError(f"{POLICY_ENV}: cannot read the policy {str(path)!r}: {error.strerror}") from None
        return cls(load_policy(text), SessionState(sessions))

    @classmethod
    def from_env(cls) -> Gateway:
        """The gateway of the policy ``KVSCOPE_POLICY`` names (``KVSCOPE_POLICY_SESSIONS``: sessions kept)."""
        path = os.environ.get(POLICY_ENV)
        if not path:
            raise PolicyError(f"{POLICY_ENV}: not set; name the policy file `kvscope audit LOG --policy-out FILE` wrote")
        sessions = os.environ.get(SESSIONS_ENV, str(DEFAULT_SESSIONS))
        if not sessions.isdigit():
            raise PolicyError(f"{SESSIONS_ENV}: {sessions!r} is not a count of sessions")
        return cls.from_file(path, int(sessions))

    def rewrite_body(self, body: Any) -> Outcome:
        """``body`` (a chat request as the proxy holds it) rewritten by the policy, or as given with the reason."""
        try:
            return self._rewrite(body)
        except Exception as error:  # noqa: BLE001 - the gateway never fails a request because of KVScope
            return Outcome(body, False, f"passed unchanged: error inside the rewrite: {type(error).__name__}: {error}")

    def _rewrite(self, body: Any) -> Outcome:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return Outcome(body, False, "passed unchanged: not a chat request (no messages list)")
        try:
            read = record_requests(body, "openai_chat", 1, 1)
        except RecordError as error:
            return Outcome(body, False, f"passed unchanged: {error.key or 'the request'} {error.reason}")
        if read.skipped or len(read.requests) != 1:
            why = f"{read.skipped[0].key}: {read.skipped[0].reason}" if read.skipped else f"it reads as {len(read.requests)} requests"
            return Outcome(body, False, f"passed unchanged: {why}")
        request = read.requests[0]
        rewritten = rewrite_request(request, self.state, self.policy)
        changed = [k for k, (old, new) in enumerate(zip(request.contents, rewritten.contents)) if old != new]
        if not changed:
            return Outcome(body, False, "unchanged: no field of the policy to repair")
        messages = list(body["messages"])
        if len(messages) != len(request.contents):
            return Outcome(body, False, f"passed unchanged: {len(messages)} messages read as {len(request.contents)}")
        for number in changed:
            message = messages[number]
            if not isinstance(message, dict) or message.get("content") != request.contents[number]:
                return Outcome(body, False, f"passed unchanged: message {number + 1}'s content is not plain text")
            messages[number] = {**message, "content": rewritten.contents[number]}
        return Outcome({**body, "messages": messages}, True, f"rewritten: messages {', '.join(str(k + 1) for k in changed)}")
