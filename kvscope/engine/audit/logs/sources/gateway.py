"""A gateway's record of one call: the ``request`` it forwarded with the ``response`` beside it (and a
``timestamp``), as proxies and home-grown middleware log them. The usage is read from the response: OpenAI's
``usage.prompt_tokens_details.cached_tokens``, Anthropic's ``usage.cache_read_input_tokens`` /
``cache_creation_input_tokens``, OpenRouter's ``native_tokens_cached``. The reply is the response's first
generation (``replies.reply_of``).
"""

from __future__ import annotations

from kvscope.engine.audit.logs.formats import RecordError, session_key
from kvscope.engine.audit.logs.replies import reply_of
from kvscope.engine.audit.logs.sources.common import SourceRead, epoch_seconds, parsed_json, read_request, requests_of
from kvscope.engine.audit.logs.usage import observed_usage, response_usage

_REQUEST_KEYS = ("messages", "prompt", "input", "conversations")


def is_record(record: dict) -> bool:
    """A request with its response (or its time) beside it."""
    return "request" in record and ("response" in record or "timestamp" in record) and not any(k in record for k in _REQUEST_KEYS)


def read_gateway(record: dict) -> SourceRead:
    if "request" not in record:
        raise RecordError("request", "missing: a gateway record holds the request it forwarded")
    items = read_request(record["request"], "request")
    response = parsed_json(record.get("response"), "response")
    usage, shape = response_usage(response)
    asked = next((item["model"] for item in items if item.get("model")), None)
    served = response.get("model") if isinstance(response, dict) else None
    return SourceRead(
        requests_of(
            items,
            "gateway",
            session=session_key(record),
            timestamp=epoch_seconds(record.get("timestamp"), "timestamp"),
            model=asked or served,
            usage=observed_usage(usage, shape, {"openrouter": "response", "llama_server": "response.timings"}.get(shape, "response.usage")),
            reply=reply_of(response),
            answer=response,
        )
    )
