"""The gateway never fails a request: 10,000 mutated chat bodies (seeded) go through ``Gateway.rewrite_body`` and
through the LiteLLM hook itself (where litellm is installed); none raises, none is mutated in place, one the policy does
not match comes back as the very object given, and a rewritten one differs only in the ``content`` of the messages
the rewrite changed, exactly as ``rewrite_request`` rewrites the request read from it. A malformed policy stops the
hook at start, naming the field."""

import asyncio
import copy
import importlib.util
import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from kvscope.engine.audit.logs.reading import record_requests
from kvscope.engine.audit.policy.document import VERSION, Fidelity, FieldPolicy, Policy, PolicyError
from kvscope.engine.audit.policy.gateway import Gateway, hook_config
from kvscope.engine.audit.policy.rewrite import SessionState, rewrite_request

ROOT = Path(__file__).resolve().parents[4]
HOOK = ROOT / "deploy" / "litellm" / "kvscope_hook.py"
MUTATED = 10_000
SYSTEM = "You are Forge, a coding agent.\nTime now: 2026-05-12 09:{minute:02d}\nWorking directory: /home/dev/ledgerline"
JUNK = [
    None,
    0,
    1.5,
    True,
    "",
    "text",
    [],
    {},
    [1, 2],
    {"type": "image_url", "image_url": {"url": "x"}},
    "Time now: \x00\u202e",
    "\ud7ff" * 3,
]


def _policy(repair: str) -> Policy:
    fidelity = Fidelity(0.01, 1.0, True, 2, 0.05, 0.9)
    entry = FieldPolicy("clock", "system", 0, "Time now: {clock}", "x", repair, "measured", "hour" if repair == "coarsen" else None,
                        fidelity=fidelity)  # fmt: skip
    return Policy(VERSION, "tiny", "float32", 0.05, 0.9, (entry,))


def _body(rng: random.Random) -> dict:
    """A coding agent's chat request: the clock line, a few turns, a session key."""
    messages = [{"role": "system", "content": SYSTEM.format(minute=rng.randrange(60))}]
    for turn in range(rng.randrange(1, 6)):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": f"turn {turn}: {rng.random():.3f}"})
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": "go on"})
    return {"model": "served", "messages": messages, "user": f"s{rng.randrange(50)}", "metadata": {"tags": ["x"]}, "temperature": 0}


def _mutated(rng: random.Random) -> object:
    """A body with one to three random mutations: keys dropped or replaced by junk, messages reordered, lines garbled,
    content parts, tool calls, other session keys, or not a body at all."""
    body = _body(rng)
    for _ in range(rng.randrange(4)):
        messages = body.get("messages") if isinstance(body, dict) else None
        choice = rng.randrange(12)
        if choice == 0:
            return rng.choice(JUNK)
        if choice == 1 and isinstance(body, dict):
            body[rng.choice(["messages", "user", "model", "metadata", "tools", "session_id"])] = rng.choice(JUNK)
        elif isinstance(messages, list) and messages:
            k = rng.randrange(len(messages))
            if choice == 2:
                messages[k] = rng.choice(JUNK)
            elif choice == 3 and isinstance(messages[k], dict):
                messages[k][rng.choice(["role", "content", "name", "tool_calls", "tool_call_id"])] = rng.choice(JUNK)
            elif choice == 4 and isinstance(messages[k], dict):
                messages[k]["content"] = [{"type": "text", "text": str(messages[k].get("content"))}]
            elif choice == 5:
                rng.shuffle(messages)
            elif choice == 6 and isinstance(messages[0], dict) and isinstance(messages[0].get("content"), str):
                text = messages[0]["content"]
                cut = rng.randrange(len(text) + 1)
                messages[0]["content"] = text[:cut] + rng.choice(["", "\n", "Time now: ", "{clock}", "é\u0301", "\r\n"]) + text[cut:]
            elif choice == 7:
                messages.insert(
                    k, {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}
                )
            elif choice == 8:
                messages.append({"role": "tool", "content": "Time now: 2026-05-12 10:00", "tool_call_id": "c"})
            elif choice == 9:
                del messages[k:]
            elif choice == 10 and isinstance(messages[k], dict):
                messages[k]["content"] = str(messages[k].get("content")) * rng.randrange(1, 50)
            else:
                body["session_id"] = rng.choice([1, True, {"a": 1}, "s1", ""])
    return body


def _check(outcome_body: object, body: object, before: object, request_state: SessionState, policy: Policy, rewritten: bool) -> None:
    """Nothing mutated in place; unchanged is the same object; a rewrite changes the content of messages only, as
    ``rewrite_request`` does."""
    assert body == before
    if not rewritten:
        assert outcome_body is body
        return
    assert isinstance(outcome_body, dict) and set(outcome_body) == set(body)
    assert all(outcome_body[key] == body[key] for key in body if key != "messages")
    old, new = body["messages"], outcome_body["messages"]
    assert len(old) == len(new) and any(a != b for a, b in zip(old, new))
    for a, b in zip(old, new):
        assert {k: v for k, v in a.items() if k != "content"} == {k: v for k, v in b.items() if k != "content"}
        assert a["content"] == b["content"] or isinstance(a["content"], str)
    expected = rewrite_request(record_requests(body, "openai_chat", 1, 1).requests[0], request_state, policy)
    assert record_requests(outcome_body, "openai_chat", 1, 1).requests[0].contents == expected.contents


@pytest.mark.parametrize("repair", ["hoist", "erratum", "coarsen"])
def test_ten_thousand_mutated_requests_pass_the_gateway_unharmed(repair):
    rng, policy = random.Random(66), _policy(repair)
    gateway, mirror = Gateway(policy), SessionState()  # the mirror replays the same sessions for the expected rewrite
    counts = {True: 0, False: 0}
    for _ in range(MUTATED):
        body = _mutated(rng)
        before = copy.deepcopy(body)
        outcome = gateway.rewrite_body(body)
        if not outcome.rewritten and isinstance(body, dict) and isinstance(body.get("messages"), list):
            read = record_requests(body, "openai_chat", 1, 1) if _readable(body) else None
            if read is not None and read.requests and not read.skipped:
                rewrite_request(read.requests[0], mirror, policy)  # keep the mirror's sessions in step
        _check(outcome.body, body, before, mirror, policy, outcome.rewritten)
        counts[outcome.rewritten] += 1
    assert counts[True] > 2_000 and counts[False] > 2_000, counts  # both paths exercised, thousands each


def _readable(body: dict) -> bool:
    try:
        record_requests(body, "openai_chat", 1, 1)
    except Exception:  # noqa: BLE001 - the reader refuses what the gateway passed unchanged
        return False
    return True


def test_an_error_inside_the_rewrite_passes_the_body_unchanged_with_the_reason(monkeypatch):
    gateway = Gateway(_policy("hoist"))
    body = _body(random.Random(1))
    monkeypatch.setattr("kvscope.engine.audit.policy.gateway.rewrite_request", lambda *a: 1 / 0)
    outcome = gateway.rewrite_body(body)
    assert outcome.body is body and not outcome.rewritten
    assert outcome.reason == "passed unchanged: error inside the rewrite: ZeroDivisionError: division by zero"
    parts = {
        "messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, {"role": "user", "content": "hi"}]
    }
    assert Gateway(_policy("hoist")).rewrite_body(parts).reason.startswith("passed unchanged: message 1, part 1")


def _hook(monkeypatch, tmp_path, policy_text: str):
    """deploy/litellm/kvscope_hook.py loaded as LiteLLM loads it (from its file), with KVSCOPE_POLICY set."""
    pytest.importorskip("litellm")
    path = tmp_path / "policy.json"
    path.write_text(policy_text)
    monkeypatch.setenv("KVSCOPE_POLICY", str(path))
    spec = importlib.util.spec_from_file_location("kvscope_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.proxy_handler_instance


def test_the_litellm_hook_passes_ten_thousand_mutated_requests_unharmed(monkeypatch, tmp_path):
    policy = _policy("erratum")
    hook = _hook(monkeypatch, tmp_path, policy.text())
    rng, expected = random.Random(67), Gateway(policy)

    async def run() -> int:
        rewritten = 0
        for _ in range(MUTATED):
            body = _mutated(rng)
            before = copy.deepcopy(body)
            want = expected.rewrite_body(copy.deepcopy(body))
            got = await hook.async_pre_call_hook(None, None, body, "completion")
            assert body == before and (got is body if not want.rewritten else got == want.body)
            rewritten += want.rewritten
        return rewritten

    assert asyncio.run(run()) > 2_000
    embedding = {"input": ["Time now: x"]}
    assert asyncio.run(hook.async_pre_call_hook(None, None, embedding, "embedding")) is embedding


def test_a_malformed_policy_stops_the_hook_at_start_naming_the_field(monkeypatch, tmp_path):
    data = json.loads(_policy("hoist").text())
    data["fields"][0]["repair"] = "field_only"
    with pytest.raises(PolicyError, match=r"fields\.0 \(clock\): repair 'field_only' is KV-level"):
        _hook(monkeypatch, tmp_path, json.dumps(data))
    monkeypatch.delenv("KVSCOPE_POLICY")
    with pytest.raises(PolicyError, match="KVSCOPE_POLICY: not set"):
        Gateway.from_env()


def test_the_deployed_config_is_the_one_the_app_offers():
    assert (ROOT / "deploy" / "litellm" / "config.yaml").read_text(encoding="utf-8") == hook_config()
    assert "callbacks: kvscope_hook.proxy_handler_instance" in hook_config() and HOOK.exists()


PROXY_PYTHON = Path(os.environ.get("KVSCOPE_CACHE_DIR", Path.home() / ".cache" / "kvscope")) / "litellm-proxy" / "bin" / "python"


@pytest.mark.skipif(importlib.util.find_spec("litellm") is not None, reason="litellm is importable here: the two tests above ran")
@pytest.mark.skipif(not PROXY_PYTHON.is_file(), reason="the LiteLLM proxy is not installed: bash scripts/litellm_proxy.sh")
def test_the_hook_tests_pass_in_the_proxy_environment():
    """Where litellm lives only in the proxy's own environment (scripts/litellm_proxy.sh, as scripts/test.sh installs
    it), the two tests through the real hook run there, on this repository's kvscope."""
    done = subprocess.run(
        [str(PROXY_PYTHON), "-m", "pytest", "-q", "--noconftest", "-o", "addopts=", "-p", "no:cacheprovider", __file__,
         "-k", "litellm_hook or stops_the_hook"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
