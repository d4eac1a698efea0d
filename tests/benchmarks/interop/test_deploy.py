"""The deploy benchmark (benchmarks/interop/deploy.py): its stored result's shape and the consistency of its numbers,
its figure, the replay's reply feeding, and the LiteLLM proxy that scripts/litellm_proxy.sh starts, with KVScope's hook,
in front of a stand-in upstream that echoes the messages it received (run where the proxy is installed)."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from benchmarks.interop.deploy import LOGS, PROXY_SCRIPT, RESULTS, VARIANTS, Proxy, fed_back, logged_sessions
from kvscope.engine.audit.policy.document import VERSION, FieldPolicy, Policy
from kvscope.engine.audit.policy.gateway import Gateway
from kvscope.viz.benchmarks import deploy_figure

STORED = sorted(RESULTS.glob("deploy-*.json"))
PROXY_ENV = Path(os.environ.get("KVSCOPE_CACHE_DIR", Path.home() / ".cache" / "kvscope")) / "litellm-proxy"


def test_a_result_is_stored_for_both_offline_models() -> None:
    assert {RESULTS / "deploy-embedded-cpu.json", RESULTS / "deploy-qwen-1.5b-cpu.json"} <= set(STORED)


@pytest.mark.parametrize("path", STORED, ids=[path.stem for path in STORED])
def test_stored_result_is_consistent(path: Path) -> None:
    data = json.loads(path.read_text())
    assert "none" in data["variants"]
    assert set(data["variants"]) | set(data["not_run"]) == set(VARIANTS)  # every variant measured, or named with why
    per_rep = sum(data["sessions"].values())
    assert data["sessions"] == {name: len(records) for name, records in logged_sessions().items()}
    for name, result in data["variants"].items():
        runs = data["runs"][name]
        rows = [row for run in runs for row in run]
        assert len(runs) == result["repetitions"] == data["reps"]
        assert result["requests"] == len(rows) == per_rep * data["reps"]
        assert 0 <= result["hit_rate_metrics"] <= 1 and 0 <= result["hit_rate_usage"] <= 1
        assert result["metrics_hits"] == sum(row["metrics_hits"] for row in rows)
        assert result["metrics_queries"] == sum(row["metrics_queries"] for row in rows)
        assert result["hit_rate_metrics"] == pytest.approx(result["metrics_hits"] / result["metrics_queries"], abs=1e-4)
        assert all(0 <= row["metrics_hits"] <= row["metrics_queries"] for row in rows)
        # vLLM's /metrics hits are the answers' cached counts, request by request, and the queries their prompts
        assert [row["cached_tokens"] for row in rows] == [row["metrics_hits"] for row in rows]
        assert [row["prompt_tokens"] for row in rows] == [row["metrics_queries"] for row in rows]
        assert 0 <= result["same_text"] <= result["same_first_tokens"] <= result["requests"]
        assert result["same_text"] == sum(row["text"] == row["clean_text"] for row in rows)
        assert result["same_first_tokens"] == sum(row["same_first_tokens"] for row in rows)
        assert all(0 <= row["shared_tokens"] <= data["max_tokens"] + 1 for row in rows)
        for key in ("ttft_p50_s", "ttft_p90_s"):
            assert result[key]["min"] <= result[key]["median"] <= result[key]["max"]
        assert result["ttft_p50_s"]["median"] <= result["ttft_p90_s"]["median"] + 1e-9
    assert data["variants"]["none"]["ttft_p50_ratio_to_none"] == pytest.approx(1.0)
    for name, policy in data["policies"].items():
        assert policy["version"] == VERSION and name in data["variants"]
        assert all(entry["repair"] == name for entry in policy["fields"]) if name != "policy" else True
        for entry in policy["fields"] if name == "policy" else ():  # the audit's policy: only repairs measured within the bars
            within = {measured["repair"] for measured in entry["measured"] if measured["within_bars"]}
            assert entry["repair"] is None or entry["repair"] in within


@pytest.mark.parametrize("path", STORED, ids=[path.stem for path in STORED])
def test_figure_draws_every_variant(path: Path) -> None:
    data = json.loads(path.read_text())
    figure = deploy_figure(data)
    scattered = {trace.name for trace in figure.data if trace.type == "scatter"}
    bars = [trace for trace in figure.data if trace.type == "bar"]
    assert scattered == set(data["variants"]) and len(bars) == len(data["variants"])
    for trace in figure.data:
        if trace.type == "scatter":
            result = data["variants"][trace.name]
            assert list(trace.y) == pytest.approx(
                [result["same_first_tokens"] / result["requests"], result["same_text"] / result["requests"]]
            )


def test_fed_back_replaces_replies_but_not_answered_tool_calls() -> None:
    records = logged_sessions()["support_agent"]
    last = records[-1]["messages"]
    assistants = [place for place, message in enumerate(last) if message["role"] == "assistant"]
    replies = [f"reply {k}" for k in range(len(assistants))]
    out = fed_back(last, replies)
    assert len(out) == len(last) and [m["role"] for m in out] == [m["role"] for m in last]
    for k, place in enumerate(assistants):
        tool_answered = last[place + 1]["role"] == "tool"
        assert out[place]["content"] == (last[place]["content"] if tool_answered else replies[k])
    assert [m for m in out if m["role"] != "assistant"] == [m for m in last if m["role"] != "assistant"]
    assert LOGS["support_agent"].is_file()


def _hoist_policy() -> Policy:
    """The coding agent's clock line hoisted, forced."""
    entry = FieldPolicy("session_started", "system", 0, "Session started: {session_started}", "", "hoist", "forced", None, forced=True)
    return Policy(VERSION, "embedded", "", 0.0, 0.0, (entry,), "")


class _Echo(BaseHTTPRequestHandler):
    """A stand-in OpenAI-compatible upstream: each chat answer's content is the JSON of the messages it received."""

    def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = json.dumps(body["messages"])
        answer = {"id": "chatcmpl-echo", "object": "chat.completion", "created": 0, "model": body["model"],
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}  # fmt: skip
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.skipif(not (PROXY_ENV / "VERSION").is_file(), reason="the LiteLLM proxy is not installed: bash scripts/litellm_proxy.sh")
def test_proxy_applies_the_hook(tmp_path: Path) -> None:
    """The proxy the script starts sends the upstream the messages the gateway's own rewrite makes (a forced hoist of
    the coding agent's clock line), and passes a request the policy does not match unchanged."""
    pattern = "Session started: {session_started}"
    policy = Policy(
        VERSION,
        "embedded",
        "",
        0.0,
        0.0,
        (FieldPolicy("session_started", "system", 0, pattern, "", "hoist", "forced", None, forced=True),),
        "",
    )
    (tmp_path / "policy.json").write_text(policy.text())
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    record = logged_sessions()["coding_agent"][1]
    body = {"model": "echo", "messages": record["messages"], "max_tokens": 1, "metadata": {"session_id": "s"}}
    other = {"model": "echo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}
    expected = Gateway.from_file(tmp_path / "policy.json").rewrite_body(json.loads(json.dumps(body)))
    assert expected.rewritten  # the hoist moves the clock line
    try:
        with Proxy(f"http://127.0.0.1:{upstream.server_port}", "echo", tmp_path / "policy.json", tmp_path / "proxy") as proxy:
            with httpx.Client(trust_env=False, timeout=120.0, headers=proxy.headers) as client:
                sent = [client.post(f"{proxy.base_url}/v1/chat/completions", json=b).json() for b in (body, other)]
    finally:
        upstream.shutdown()
    received = [json.loads(answer["choices"][0]["message"]["content"]) for answer in sent]
    assert [m["content"] for m in received[0]] == [m["content"] for m in expected.body["messages"]]
    assert received[0][0]["content"] != record["messages"][0]["content"]
    assert [m["content"] for m in received[1]] == ["Hello"]
    assert PROXY_SCRIPT.is_file()


@pytest.mark.skipif(not (PROXY_ENV / "VERSION").is_file(), reason="the LiteLLM proxy is not installed: bash scripts/litellm_proxy.sh")
def test_proxy_refuses_a_malformed_policy(tmp_path: Path) -> None:
    """A policy with one wrong field stops the proxy at start, and the error names that field and the reason."""
    policy = json.loads(_hoist_policy().text())
    policy["fields"][0]["message"] = "first"
    (tmp_path / "policy.json").write_text(json.dumps(policy))
    with pytest.raises(RuntimeError, match="exited"):
        with Proxy("http://127.0.0.1:9", "echo", tmp_path / "policy.json", tmp_path / "proxy"):
            pass
    assert "PolicyError: fields.0.message: Input should be a valid integer" in (tmp_path / "proxy" / "proxy.log").read_text()
