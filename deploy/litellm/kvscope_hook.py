"""KVScope's repair policy at a LiteLLM proxy (docs/deploy.md): config.yaml beside this file names
``kvscope_hook.proxy_handler_instance`` under ``litellm_settings: callbacks:``, and ``KVSCOPE_POLICY`` names the policy
``kvscope audit LOG --policy-out FILE`` wrote. A malformed policy stops the proxy at start, with the field and the reason.

Before each chat request goes to the server, ``async_pre_call_hook`` rewrites ``data["messages"]`` by the policy
(``kvscope.engine.audit.policy.gateway``). A request it cannot read, or an error inside it, passes unchanged, and the
reason is logged (logger ``kvscope.gateway``): the proxy never drops or alters a request because of KVScope otherwise.
Only this file imports litellm; kvscope must be importable in the proxy's environment (installed, or on PYTHONPATH).
"""

from __future__ import annotations

import logging
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from kvscope.engine.audit.policy.gateway import Gateway

log = logging.getLogger("kvscope.gateway")
CHAT_CALLS = ("completion", "acompletion")  # the call types whose data holds chat messages


class KVScopeHook(CustomLogger):
    """A LiteLLM callback that applies a KVScope policy to every chat request before it is sent."""

    def __init__(self, gateway: Gateway):
        super().__init__()
        self.gateway = gateway

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: str) -> dict:
        """``data`` with its messages rewritten by the policy, or as it came (the reason logged)."""
        if call_type not in CHAT_CALLS:
            return data
        outcome = self.gateway.rewrite_body(data)
        if outcome.rewritten:
            log.debug("kvscope: %s", outcome.reason)
        elif outcome.reason.startswith("passed unchanged"):
            log.warning("kvscope: %s", outcome.reason)
        return outcome.body


proxy_handler_instance = KVScopeHook(Gateway.from_env())
