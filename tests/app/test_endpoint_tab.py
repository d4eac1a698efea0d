"""The Your prompt tab's "Measure on a server", on tiny-qwen2 against a fake OpenAI-compatible server answering with
the same model's torch log-probs: the same rows and verdict as the in-process measurement, the endpoint named (escaped),
and the public profile refusing it before any request reaches the URL."""

from __future__ import annotations

import json
import socket

import pytest

from kvscope.app.handlers.audit_settings import EngineInputs
from kvscope.app.handlers.common import AppError, AppNotice
from kvscope.app.handlers.rewrite import RewriteInputs, run_rewrite, run_rewrite_on_server
from kvscope.app.hosting import public_profile
from kvscope.app.state import ModelRegistry
from tests.app.conftest import TINY
from tests.fake_endpoint import FakeServer, serving

SYSTEM = "You are the help desk of a bike shop.\nSession started: 2026-05-12 09:{minute}\nBe brief."


def _request(minute: str, question: str) -> str:
    return json.dumps({"messages": [{"role": "system", "content": SYSTEM.format(minute=minute)}, {"role": "user", "content": question}]})


LOG = "\n".join([_request("41", "Is my wheel covered?"), _request("42", "Is my wheel covered?")])
HOISTED = "\n".join(
    json.dumps({"messages": [{"role": "system", "content": "You are the help desk of a bike shop.\nBe brief."},
                             {"role": "user", "content": f"Is my wheel covered?\n\nSession started: 2026-05-12 09:{minute}"}]})
    for minute in ("41", "42")
)  # fmt: skip
REWRITE = RewriteInputs(LOG, HOISTED, tokens=3)


def test_a_rewrite_measured_on_a_server_gives_the_in_process_rows_and_names_the_endpoint(registry):
    fake = FakeServer(registry.get(), model="desk<b>")
    with serving(fake) as url:
        words, data = run_rewrite_on_server(registry, REWRITE, url=url, model="desk<b>")
    _, local = run_rewrite(registry, REWRITE)
    assert len(fake.completions) == 4  # two originals, two rewrites, each once
    assert data["verdict"] == local["verdict"] and data["endpoint"]["model"] == "desk<b>" and data["endpoint"]["top_k"] == 20
    for mine, theirs in zip(data["rewrite"], local["rewrite"]):
        for key in ("top1_agree", "generation_agreement", "generated_common_prefix", "same_text", "original_text", "rewritten_text"):
            assert mine[key] == theirs[key], key
        assert mine["kl"] <= theirs["kl"] + 1e-5 <= mine["kl"] + mine["kl_bound"] + 2e-5
    assert "desk&lt;b&gt;" in words and "desk<b>" not in words and data["verdict"] in words
    with pytest.raises(AppError, match="base URL"):
        run_rewrite_on_server(registry, REWRITE, url="  ")


def test_the_public_profile_makes_no_request_to_a_url_a_visitor_typed(registry):
    public = ModelRegistry(TINY, profile=public_profile())
    fake = FakeServer(registry.get())
    with serving(fake) as url:
        with pytest.raises(AppError, match="makes no request to a URL a visitor typed"):
            run_rewrite_on_server(public, REWRITE, url=url)
    assert fake.headers == [] and fake.completions == []  # not even the model list was asked for


def test_a_server_that_does_not_answer_is_reported_at_once_as_information_naming_the_url(registry):
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(AppNotice, match=rf"nothing answers at http://127.0.0.1:{port}") as raised:
        run_rewrite_on_server(registry, REWRITE, url=f"http://127.0.0.1:{port}")
    assert raised.value.warning  # a warning toast: something for the person to do, not an error badge
    said = raised.value.markdown()  # the panel: the URL as typed (no escapes a link would show), what to do in the app
    assert f"`http://127.0.0.1:{port}`" in said and "\\" not in said and "--endpoint" not in str(raised.value) + said
    assert "correct the URL in the box above" in said


def test_a_rewrite_on_a_server_simulates_the_engines_the_tab_sets(registry):
    """The server's rows count each engine's reuse with the tab's block size, as the in-process rewrite does."""
    engines = EngineInputs(block=128)
    with serving(FakeServer(registry.get())) as url:
        _, data = run_rewrite_on_server(registry, REWRITE, url=url, engines=engines)
        _, default = run_rewrite_on_server(registry, REWRITE, url=url)
    _, local = run_rewrite(registry, REWRITE, engines=engines)
    for key in ("reused_tokens_before", "reused_tokens_after"):
        assert [row[key] for row in data["rewrite"]] == [row[key] for row in local["rewrite"]], key
    assert [row["reused_tokens_before"]["vllm"] for row in data["rewrite"]] != [
        row["reused_tokens_before"]["vllm"] for row in default["rewrite"]
    ]
