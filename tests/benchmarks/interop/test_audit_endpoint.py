"""The audit measured both ways on the same weights (the embedded model in torch, float32, and its GGUF on a built
llama-server): the top-1 and greedy verdicts agree wherever torch's top-2 gap exceeds twice the measured quantization
noise, and the endpoint's KL estimate lies within its stated bound of the exact KL of the server's own two full
distributions. Skipped where llama-server is not built."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from benchmarks.interop.audit_endpoint import compare_log
from benchmarks.serving.serving_servers import SERVER_BINARY, LlamaServer, embedded_gguf
from kvscope.engine.audit.endpoint.client import EndpointClient, EndpointSettings
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.models import load_model

needs_llama_server = pytest.mark.skipif(
    not SERVER_BINARY.is_file(), reason="llama-server is not built: bash scripts/build_llama_server.sh (~10 min)"
)
SYSTEM = "You are the help desk of a bike shop.\nSession started: 2026-05-12 {time}\nAnswer in one short sentence, with the opening hours."


def _request(session: str, time: str, *turns: str) -> str:
    messages = [{"role": "system", "content": SYSTEM.format(time=time)}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(turns)]
    return json.dumps({"session": session, "messages": messages})


# the clock changes alone (request 2), then with a longer conversation (request 3): two change signatures
DESK = [
    _request("a", "09:41", "When do you open?"),
    _request("a", "09:42", "When do you open?"),
    _request("a", "09:43", "When do you open?", "We open at nine.", "And on Sundays?"),
]


@needs_llama_server
def test_torch_and_llama_server_give_the_same_verdicts_beyond_the_noise_and_the_kl_within_its_bound():
    lm = load_model("embedded", dtype="float32")
    log = read_log("\n".join(DESK))
    server_log = Path(tempfile.gettempdir()) / "kvscope-test-audit-endpoint.log"
    with LlamaServer(SERVER_BINARY, embedded_gguf(), 2 * 1024, 2, server_log, "qwen", slots=2) as server:
        client = EndpointClient(EndpointSettings(server.base_url, "qwen", top_k=20, concurrency=1, timeout_s=600.0))
        result = compare_log(lm, client, log, sample=1, tokens=4, grain="hour")
    print(json.dumps({key: result[key] for key in ("noise", "rounding", "verdicts", "kl", "torch_s", "endpoint_s")}))
    assert result["measured_turns"] == 2 and result["compared"] == 6  # erratum, hoist and coarsen on both turns
    noise = result["noise"]["max_abs_logprob_difference"]
    assert 0 < noise < 1.0  # a quantized model, near the dequantized one
    for verdict in ("top1_agree", "unchanged"):
        counts = result["verdicts"][verdict]
        assert counts["agree_where_decidable"] == counts["decidable"], (verdict, result["rows"])
    assert result["verdicts"]["top1_agree"]["decidable"] >= 3  # the test decides something
    prefixes = result["verdicts"]["common_prefix_within_decided_tokens"]
    assert prefixes["agree"] == prefixes["of"] == 6 and prefixes["decided_tokens"] >= 3, result["rows"]  # the greedy tokens both fix
    assert result["kl"]["within_bound"] == result["kl"]["of"] == 6, result["rows"]
    assert all(row["endpoint_kl"] <= row["server_exact_kl"] + result["rounding"] for row in result["rows"])
