"""The token pass's memory follows what its simulated caches hold, not the log: under a KV budget (and llama.cpp's
slot per session), a log four times longer costs its rows of numbers more, not bytes for every token read (the pass
that kept every rendered request held about 40 bytes a token). The bounded stores (recent rendered requests, the
encoder's line cache, the batch rendered at once) are made small, so that both logs outgrow them."""

import gc
import json
import tracemalloc

from benchmarks.studies.audit_scale import synthetic_log
from kvscope.engine.audit.logs import render
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.models.tiny import tiny_tokenizer
from tests.engine.audit.measure.test_traffic import QWEN_TEMPLATE

BUDGET = CacheSettings(budget_tokens=4_096, budget_blocks=256, prompt_cache=False)


def _peak(tokenizer, requests: int) -> tuple[int, int]:
    """The token pass's peak traced bytes on the generated log of ``requests`` (the log read before tracing), and
    its prompt tokens."""
    log = read_log("\n".join(json.dumps(record) for record in synthetic_log(requests, 4)))
    gc.collect()
    tracemalloc.start()
    try:
        scan = scan_log(tokenizer, log, ScanSettings(BUDGET))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, sum(row.tokens for row in scan.requests)


def test_memory_per_request_does_not_grow_with_the_log(monkeypatch):
    monkeypatch.setattr(render, "RECENT_RENDERED", 16)  # the bounded stores made small against either log
    monkeypatch.setattr(render, "LINE_CACHE_TOKENS", 20_000)
    monkeypatch.setattr(render, "RENDER_BATCH", 8)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    (small, small_tokens), (large, large_tokens) = _peak(tokenizer, 40), _peak(tokenizer, 160)
    per_request = (large - small) / 120
    per_token = (large - small) / (large_tokens - small_tokens)
    print(f"{per_request:,.0f} bytes a request, {per_token:.2f} a prompt token, peak {small:,} -> {large:,}")
    # below one int32 token id (4 bytes) per token read: no request's tokens are kept (about 1.6 here, the bounded
    # stores filling; the pass that kept every rendered request grew by about 40)
    assert per_token < 4.0


def test_a_message_every_turn_resends_is_held_once():
    """A session's every turn resends its earlier messages: the log holds each distinct message as one object, so
    reading grows with the new messages, not with the turns times the history (56 MB for 10,000 generated requests
    read before, 39 MB so)."""
    log = read_log("\n".join(json.dumps(record) for record in synthetic_log(60, 3)))
    messages = [message for request in log.requests for message in request.messages]
    distinct = {message: message for message in messages}
    assert len(messages) > 4 * len(distinct)  # the histories resent
    assert all(message is distinct[message] for message in messages)  # one object per distinct message
    assert len({id(message) for message in messages}) == len(distinct)
