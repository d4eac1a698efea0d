"""The Your prompt tab's handlers on tiny-qwen2, with request logs written here and the bundled interleaved one: the
token pass per session against an independent count, groups covering every turn, fields found, repairs measured on the
sample, a recommendation per turn, the prompt marked (escaped), Open in Notes, exports, the public profile's bounds on
the measured turns, malformed records skipped by name, and bad input refused with the engine's message while the
session keeps its last audit."""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path

import pytest

from kvscope.app.handlers.audit_kept import audit_fidelity_view, audit_notes_scenario, export_audit
from kvscope.app.handlers.audit_log import NOTHING_TO_AUDIT, bundled_log_text, given_log, size_words, upload_markdown
from kvscope.app.handlers.audit_settings import AuditInputs, EngineInputs
from kvscope.app.handlers.common import AppError
from kvscope.app.handlers.notes import EditInputs, run_edit, run_knockout
from kvscope.app.handlers.rewrite import RewriteInputs, run_rewrite
from kvscope.app.handlers.your_prompt import prompt_candidates, run_audit, run_audit_value
from kvscope.app.hosting import local_profile, public_profile
from kvscope.app.state import ExportFolder, ModelRegistry, SessionStore
from kvscope.app.tabs.your_prompt import with_coarsen
from kvscope.engine.audit.changes.causes import CAUSES
from kvscope.engine.audit.changes.fields import diff_requests
from kvscope.engine.audit.logs.reading import parse_log, read_log
from kvscope.engine.audit.logs.render import render_request
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.measure.turn import repaired_template
from kvscope.engine.audit.paged_blocks import BLOCK_TOKENS
from kvscope.engine.scenario import Scenario, bundled_logs
from kvscope.viz.audit import MAX_TABLE_ROWS
from kvscope.viz.common import markdown_literal
from tests.app.conftest import TINY

SYSTEM = "You are the help desk of a bike shop.\nSession started: 2026-05-12 09:{minute}\nCustomer tier: {tier}\nBe brief."


def _request(minute: str, tier: str, *turns: tuple[str, str]) -> str:
    messages = [{"role": "system", "content": SYSTEM.format(minute=minute, tier=tier)}]
    messages += [{"role": role, "content": content} for role, content in turns]
    return json.dumps({"model": "desk", "messages": messages})


ASK = ("user", "Is the <b>repair</b> of my wheel covered?")
ANSWER = ("assistant", "Yes, within the warranty.")
FOLLOW_UP = ("user", "And the brakes?")
LOG = "\n".join(
    [
        _request("41", "gold", ASK),
        _request("42", "gold", ASK),  # the minute changes
        _request("42", "gold", ASK, ANSWER, FOLLOW_UP),  # only growth
    ]
)
OPTIONS = {"inputs": AuditInputs(["field_only", "erratum", "hoist"], 3)}


@pytest.fixture
def audited(registry, sessions):
    view = run_audit(registry, sessions, LOG, session="a", **OPTIONS)
    return view, sessions


def test_a_log_gets_its_fields_every_repair_and_a_recommendation_per_turn(audited):
    view, sessions = audited
    data = view.summary
    assert [turn["request"] for turn in data["turns"]] == [1, 2, 3]
    second, third = data["turns"][1], data["turns"][2]
    assert [(f["name"], f["old"], f["new"]) for f in second["fields"]] == [("session_started", "2026-05-12 09:41", "2026-05-12 09:42")]
    assert third["fields"] == [] and third["appended_tokens"] > 0
    assert set(second["repairs"]) == {"recompute", "field_only", "erratum", "hoist"}
    assert second["repairs"]["recompute"]["kl"] < 1e-6 and second["repairs"]["recompute"]["generation_agreement"] == 1.0
    # at the default bars (KL ≤ 0.05, 90% of 3 tokens agreeing): erratum agrees on one greedy token of 3 and hoist
    # changes the top token, so the exact reference is recommended; field_only holds the bars beside it (KL ≈ 5e-4,
    # 3 of 3 agreeing) and computes fewer tokens
    repairs = second["repairs"]
    assert repairs["erratum"]["generation_agreement"] < 0.9 and not repairs["hoist"]["top1_agree"]
    assert repairs["field_only"]["kl"] < 0.05 and repairs["field_only"]["generation_agreement"] == 1.0
    assert second["recommendation"]["repair"] == third["recommendation"]["repair"] == "recompute"
    saved = repairs["recompute"]["computed_tokens"] - repairs["field_only"]["computed_tokens"]
    kv, faster = second["recommendation"]["kv_alternative"], repairs["field_only"]["ttft_ms"] < repairs["recompute"]["ttft_ms"]
    if faster:  # offered only where it is cheaper: fewer tokens and a shorter measured TTFT
        assert kv["repair"] == "field_only" and kv["saved_tokens"] == saved
    else:
        assert kv is None and "but measured slower here" in second["recommendation"]["reason"]
    assert "Recommended: " in view.recommendation_markdown and r"*session\_started* “2026\-05\-12 09:41”" in view.recommendation_markdown
    timeline = {trace.name for trace in view.timeline_figure.data}
    assert {"recompute (exact prefix)", "field_only", "erratum", "hoist", "16-token blocks (vLLM)"} <= timeline
    points = {trace.name: len(trace.x) for trace in view.fidelity_figure.data if trace.name}
    assert points["recompute"] == 2 and points["field_only"] == 1  # field_only does not apply to growth
    (labels,) = [trace for trace in view.fidelity_figure.data if trace.text]  # each place labelled once with its requests
    assert {request for label in labels.text for request in label.split("·")} == {"r2", "r3"}
    assert sessions.get("a", "audit").as_dict()["turns"] == data["turns"] and sessions.get("a", "audit_traffic") == data


def test_the_marked_prompt_escapes_user_text_and_marks_the_field_and_the_growth(audited):
    view, _ = audited
    html_text = view.prompt_html
    assert "<b>repair</b>" not in html_text and "&lt;b&gt;repair&lt;/b&gt;" in html_text
    assert "&lt;|im_start|&gt;" in html_text  # the chat template's tokens are shown as text
    assert html_text.count('data-kind="field"') == 1 and html_text.count('data-kind="growth"') == 1
    assert '<details class="kv-turn" data-request="2" open>' in html_text  # the last turn with a field is open
    assert "session_started: &#x27;2026-05-12 09:41&#x27; → &#x27;2026-05-12 09:42&#x27;" in html_text


def test_malformed_records_are_skipped_by_name_and_the_rest_audited(registry, sessions):
    view = run_audit(registry, sessions, LOG + '\n{not json\n{"messages": [{"role": "robot", "content": "hi"}]}', session="s", **OPTIONS)
    assert [(item["line"], item["key"]) for item in view.summary["skipped"]] == [(4, ""), (5, "message 1")]
    assert "lines that gave no request of their own: 2" in view.traffic_markdown and "line 4 is not JSON" in view.traffic_markdown
    assert [turn["request"] for turn in view.summary["turns"]] == [1, 2, 3]  # the rest, audited as without them
    unrelated = run_audit(registry, sessions, _request("41", "gold", ASK) + '\n{"prompt": "else entirely"}', session="s", **OPTIONS)
    assert [cause["name"] for cause in unrelated.summary["requests"][1]["causes"]] == ["new_prefix"]  # a cold prefill, said


def test_bad_logs_get_the_engines_message_and_leave_the_last_audit(audited, registry):
    _, sessions = audited
    kept = sessions.get("a", "audit")
    cases = {
        '{"prompt": 3}': "no request of the log could be read: 1 skipped, the first: line 1 has no 'messages'",
        '{"messages": [{"role": "robot", "content": "hi"}]}': "unknown role 'robot'",
        '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}': "is not text",
        "": "paste a request log",
    }
    for text, message in cases.items():
        with pytest.raises(AppError, match=message):
            run_audit(registry, sessions, text, session="a", **OPTIONS)
    with pytest.raises(AppError, match="unknown repair 'rebuild'"):
        run_audit(registry, sessions, LOG, session="a", inputs=AuditInputs(["rebuild"], 3))
    with pytest.raises(AppError, match="unknown grain"):
        run_audit(registry, sessions, LOG, session="a", inputs=AuditInputs(["field_only", "erratum", "hoist"], 3, grain="week"))
    with pytest.raises(AppError, match="between 0 and 1"):
        run_audit(registry, sessions, LOG, session="a", inputs=AuditInputs(["field_only", "erratum", "hoist"], 3, min_agreement=1.5))
    with pytest.raises(AppError, match="observed counts are compared with one of vllm, sglang, llama_cpp, got 'tgi'"):
        run_audit(registry, sessions, LOG, session="a", engines=EngineInputs(observed_engine="tgi"), **OPTIONS)
    assert sessions.get("a", "audit") is kept


def test_the_public_profile_bounds_the_measured_turns_tokens_per_request_and_n(registry):
    def public(**limits) -> ModelRegistry:
        bounded = ModelRegistry(TINY, profile=dataclasses.replace(public_profile(), **limits))
        bounded.add(TINY, registry.get())
        return bounded

    sessions = SessionStore()
    ten = "\n".join(_request(f"{40 + i}", "gold", ASK) for i in range(10))  # one change signature: 9 measurable turns
    view = run_audit(public(), sessions, ten, session="p", inputs=AuditInputs([], 1), sample=9)
    (group,) = [group for group in view.summary["groups"] if group["measurable"]]
    assert (group["measurable"], len(group["measured"]), view.summary["sample"], view.summary["sampled"]) == (9, 8, 8, True)
    bound = "this server (public profile) measures at most 8 turns of a log: --sample lowered from 9 to 8"
    assert view.summary["sample_bound"] == bound and markdown_literal(bound) in view.groups_markdown
    assert "**sampled**" in view.groups_markdown and len(view.summary["requests"]) == 10  # the token pass: every request
    kept = run_audit(public(), sessions, ten, session="p", inputs=AuditInputs([], 1), sample=2)
    assert kept.summary.get("sample_bound") is None and [len(g["measured"]) for g in kept.summary["groups"] if g["measurable"]] == [2]
    with pytest.raises(AppError, match="33 greedy tokens per state asked; this server \\(public profile\\) generates at most 32"):
        run_audit(public(), sessions, LOG, session="q", inputs=AuditInputs([], 33))
    with pytest.raises(AppError, match="longer than the context limit of 80"):
        run_audit(public(max_context_tokens=80), sessions, LOG, session="q", inputs=AuditInputs([], 1))
    assert sessions.get("q", "audit") is None
    local = local_profile()
    assert local.max_audit_requests is None and local.max_audit_tokens is None
    view = run_audit(registry, sessions, ten, session="l", inputs=AuditInputs([], 1), sample=9)  # local: every turn
    assert len(view.summary["turns"]) == 10 and view.summary.get("sample_bound") is None and not view.summary["sampled"]


def test_one_prompt_offers_candidates_and_audits_a_chosen_or_found_value(registry, sessions, tmp_path: Path):
    prompt = "Order A-48213 placed 2026-05-12 09:41 for <i>Ana</i>.\nStatus: shipped\nCan it still be cancelled?"
    view, choices = prompt_candidates(registry, prompt)
    assert choices[:2] == [("1 · id · A-48213", 1), ("2 · datetime · 2026-05-12 09:41", 2)]  # (label, value) pairs
    assert view.count('<mark class="candidate"') == len(choices) and "&lt;i&gt;Ana&lt;/i&gt;" in view and "<i>Ana" not in view
    chosen = run_audit_value(registry, sessions, prompt, session="v", candidate=choices[1][1], new_value="2026-05-12 09:42", **OPTIONS)
    (field,) = chosen.summary["turns"][1]["fields"]
    assert (field["old"], field["new"]) == ("2026-05-12 09:41", "2026-05-12 09:42")
    found = run_audit_value(
        registry, sessions, prompt, session="v", candidate=choices[1][1], find="shipped", new_value="pending", **OPTIONS
    )
    assert [(f["old"], f["new"]) for f in found.summary["turns"][1]["fields"]] == [("shipped", "pending")]  # find wins
    paths = export_audit(ExportFolder(2**22, 4, root=tmp_path), sessions, session="v")
    # the value sits in the one user message, each request's own conversation: no template replaces it
    assert sorted(Path(path).name for path in paths) == ["kvscope-audit-figures.html", "kvscope-audit.json"]
    with pytest.raises(RequestLogError, match=r"status changes in message 1 \(user\).*leading system / developer messages only"):
        repaired_template(sessions.get("v", "audit"))
    # one user message: no question left; the refusal names the message and what to do, before and on Open in Notes
    last = r"status changed in message 1 of request 2 \(the last, the user's\), which a scenario reads as its question"
    said = found.notes_markdown.replace("\\", "")  # as written, without Markdown's escapes
    assert re.search(last, said) and found.notes_menu == [(found.notes_menu[0][0], "2:status")]
    assert "cannot be opened" in found.notes_menu[0][0] and "put the value in a message before the question" in said
    with pytest.raises(AppError, match=last):
        audit_notes_scenario(sessions, session="v", labels="yes, no")
    kept = sessions.get("v", "audit")
    for choice, find, value, message in (
        (None, "", "x", "pick a candidate span"),
        (9, "", "x", "no candidate span 9"),
        (choices[0][1], "", "", "type the new value"),
        (None, "refunded", "x", "does not occur"),
        (choices[0][1], "", "A-48213", "differs from the selected text"),
    ):
        with pytest.raises(AppError, match=message):
            run_audit_value(registry, sessions, prompt, session="v", candidate=choice, find=find, new_value=value, **OPTIONS)
    assert sessions.get("v", "audit") is kept


def test_open_in_notes_builds_a_scenario_the_notes_edit_and_knockout_run_on(audited, registry):
    _, sessions = audited
    with pytest.raises(AppError, match="run an audit first"):
        audit_notes_scenario(sessions, session="nobody", labels="yes, no")
    with pytest.raises(AppError, match="two answer labels"):
        audit_notes_scenario(sessions, session="a", labels="yes")
    text, choices = audit_notes_scenario(sessions, session="a", labels="covered, not covered")
    scenario = Scenario.from_toml(text)
    assert choices.fields == ["session_started"] and choices.new == "2026-05-12 09:42"
    assert list(scenario.answers) == ["covered", "not covered"] and "<b>repair</b>" in scenario.question
    view = run_edit(
        registry,
        sessions,
        EditInputs(text, field="session_started", new="2026-05-12 09:42", strategies=["field_only", "erratum"]),
        session="a",
    )
    assert 'data-strategy="field_only"' in view.cards_html and view.notes_figure.data
    verdict, _, knocked = run_knockout(sessions, session="a", positions="", top_k=2)
    assert len(knocked["positions"]) == 2 and "Knocked out 2 positions" in verdict


def test_open_in_notes_reads_the_models_own_answers_and_says_first_whether_they_move(audited, registry):
    """The audit kept the scenario the model answers itself; the Notes edit on it reads the margins the tab stated."""
    view, sessions = audited
    (choice,) = sessions.get("a", "audit_notes")  # one changed field: its pre-check is the scenario Open in Notes opens
    notes = choice.scenario
    assert view.notes_menu == [(choice.label(), "2:session_started")] and view.notes_pick == "2:session_started"
    assert notes.source in ("divergence", "first-token alternatives") and len(set(notes.answers)) == 2
    assert markdown_literal(f"margin {notes.old.decision.margin:+.2f} → {notes.new.decision.margin:+.2f}") in view.notes_markdown
    if notes.source == "divergence":  # each value's own answer wins under it
        assert notes.old.decision.margin > 0 > notes.new.decision.margin
    text, choices = audit_notes_scenario(sessions, session="a", labels="")
    assert text == notes.toml and list(Scenario.from_toml(text).answers) == list(notes.answers)
    run_edit(registry, sessions, EditInputs(text, field=choices.fields[0], new=choices.new, strategies=["field_only"]), session="a")
    experiment = sessions.get("a", "edit")
    assert experiment.stale.decision.margin == pytest.approx(notes.old.decision.margin, abs=1e-3)
    assert experiment.oracle.decision.margin == pytest.approx(notes.new.decision.margin, abs=1e-3)
    if notes.source == "divergence":  # each answer is its own value's greedy continuation, up to where they part
        assert notes.old.text.startswith(notes.answers[0]) and notes.new.text.startswith(notes.answers[1])


def test_export_writes_the_json_figures_scenario_and_repaired_template(audited, tmp_path: Path):
    _, sessions = audited
    paths = [Path(p) for p in export_audit(ExportFolder(2**22, 4, root=tmp_path), sessions, session="a", x="ttft", y="agreement")]
    names = sorted(path.name for path in paths)
    assert names == ["kvscope-audit-figures.html", "kvscope-audit-scenario.toml", "kvscope-audit-template.json", "kvscope-audit.json"]
    files = {path.name: path.read_text(encoding="utf-8") for path in paths}
    assert json.loads(files["kvscope-audit.json"]) == sessions.get("a", "audit_traffic")
    assert "Requests per session" in files["kvscope-audit-figures.html"]  # the traffic's figures beside the repairs'
    assert tomllib.loads(files["kvscope-audit-scenario.toml"])["fields"]["session_started"]["new"] == "2026-05-12 09:42"
    template = json.loads(files["kvscope-audit-template.json"])
    assert "{session_started}" in template[0]["content"] and template[-1]["content"] == ASK[1]
    assert "plotly" in files["kvscope-audit-figures.html"] and "&lt;b&gt;repair" in files["kvscope-audit-figures.html"]
    with pytest.raises(AppError, match="run an audit first"):
        export_audit(ExportFolder(2**22, 4, root=tmp_path), sessions, session="nobody")


def test_axes_redraw_from_the_kept_audit(audited):
    _, sessions = audited
    figure = audit_fidelity_view(sessions, session="a", x="ttft", y="agreement")
    assert figure.layout.xaxis.title.text.startswith("TTFT speed-up") and figure.layout.yaxis.tickformat == ".0%"
    assert "run an audit first" in audit_fidelity_view(sessions, session="nobody", x="computed", y="kl").layout.annotations[0].text
    with pytest.raises(AppError, match="axes are"):
        audit_fidelity_view(sessions, session="a", x="cost", y="kl")


def test_bundled_logs_parse_render_and_change_the_fields_they_describe(registry):
    logs = bundled_logs()
    assert set(logs) == {"coding_agent", "support_agent", "rag", "interleaved_agents"}
    lm = registry.get()
    found = {}
    for name in ("coding_agent", "support_agent", "rag"):  # one session each: every request grows the one before
        rendered = [render_request(lm, request) for request in parse_log(bundled_log_text(name))]
        found[name] = [[f.name for f in diff_requests(old, new, BLOCK_TOKENS).fields] for old, new in zip(rendered, rendered[1:])]
    assert found["coding_agent"] == [["session_started"]] * 5  # the minute changes every request
    assert found["support_agent"] == [[], ["account_tier"], []]
    assert all(found["rag"])  # the retrieved passage changes every request
    assert len(parse_log(bundled_log_text("coding_agent"))) == 6
    with pytest.raises(AppError, match="unknown demo log"):
        bundled_log_text("../secrets")


def _common(a: list[int], b: list[int]) -> int:
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _expected_sessions(lm, text: str, block: int) -> list[dict]:
    """Per session, counted here from the parsed requests: requests, tokens, and each engine's reuse unbounded (SGLang:
    the longest common prefix with anything held before; vLLM: its whole blocks; llama.cpp: the prefix shared with what
    the session's slot holds), each before the request's last token. After a request a server holds its tokens and its
    reply's: the reply's text as the session's next request resends it, up to its end-of-turn token (the last token
    sampled, never computed)."""
    requests = read_log(text).requests
    ids = [list(render_request(lm, request).token_ids) for request in requests]
    end_of_turn = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    held = []
    for n, (request, own) in enumerate(zip(requests, ids)):
        following = next((ids[m] for m in range(n + 1, len(requests)) if requests[m].session == request.session), [])
        resent = following[: len(own)] == own and end_of_turn in following[len(own) :]
        held.append(following[: following.index(end_of_turn, len(own))] if resent else own)
    sessions: dict[str | None, dict] = {}
    last: dict[str | None, list[int]] = {}
    for n, (request, own) in enumerate(zip(requests, ids)):
        longest, usable = max((_common(own, earlier) for earlier in held[:n]), default=0), len(own) - 1
        reused = {
            "vllm": min(longest // block, usable // block) * block,
            "sglang": min(longest, usable),
            "llama_cpp": min(_common(own, last.get(request.session, [])), usable),
        }
        last[request.session] = held[n]
        entry = sessions.setdefault(request.session, {"session": request.session, "requests": 0, "tokens": 0, "reused_tokens": {}})
        entry["requests"] += 1
        entry["tokens"] += len(own)
        entry["reused_tokens"] = {engine: entry["reused_tokens"].get(engine, 0) + count for engine, count in reused.items()}
    return list(sessions.values())


def test_an_interleaved_log_is_reported_per_session_and_its_groups_cover_every_turn(registry, sessions):
    text = bundled_log_text("interleaved_agents")
    engines = EngineInputs(block=8)
    view = run_audit(registry, sessions, text, session="t", inputs=AuditInputs(["field_only"], 2), sample=1, engines=engines)
    data, requests = view.summary, read_log(text).requests
    assert data["sessions"] == _expected_sessions(registry.get(), text, 8) and len(data["sessions"]) == 2
    assert [row["session"] for row in data["requests"]] == [request.session for request in requests]
    assert data["engines"]["settings"]["block"] == 8 and [item["line"] for item in data["skipped"]] == [5]  # named, not silent
    groups = data["groups"]
    assert sorted(index for group in groups for index in group["requests"]) == [request.index for request in requests]  # each once
    signature = {row["request"]: row["signature"] for row in data["requests"]}
    assert all(signature[index] == group["signature"] for group in groups for index in group["requests"])
    assert all(set(group["measured"]) <= set(group["requests"]) and len(group["measured"]) <= 1 for group in groups)
    assert sum(group["token_share"] for group in groups) == pytest.approx(1, abs=1e-3)
    measured = sorted(index for group in groups for index in group["measured"])
    cold = [row["request"] for row in data["requests"] if row["matched_request"] is None]
    assert [turn["request"] for turn in data["turns"]] == sorted(cold + measured)  # what the recommendations and Notes read
    for session in ("forge-1", "harbor-7"):
        assert f"| {markdown_literal(session)} |" in view.traffic_markdown
    names = {cause["name"] for row in data["requests"] for cause in row["causes"]}
    assert {"new_prefix", "clock"} <= names and all(markdown_literal(CAUSES[name]) in view.traffic_markdown for name in names)
    assert all(markdown_literal(group["signature"]) in view.groups_markdown for group in groups)
    drawn = {(x, y) for trace in view.sessions_figure.data if trace.mode == "markers" for x, y in zip(trace.x, trace.y)}
    assert drawn == {(row["request"], row["session"]) for row in data["requests"]}
    with pytest.raises(AppError, match="block size is at least 1"):
        EngineInputs(block=-4).cache()
    # 0 or an empty box (a browser sends 0): not given, the log's counts decide, else the default
    assert EngineInputs(block=0).cache().block == EngineInputs(block=None).cache().block == 16
    assert not EngineInputs(block=0).block_given and not EngineInputs(block="").block_given and EngineInputs(block=32).block_given
    with pytest.raises(AppError, match="SGLang token budget cannot be negative"):
        EngineInputs(budget_tokens=-1).cache()


def test_the_audit_endpoints_through_the_api(app_url):
    from gradio_client import Client

    client = Client(app_url, verbose=False)
    names = set(client.view_api(return_format="dict", print_info=False)["named_endpoints"])
    assert {"/audit", "/audit_value", "/audit_candidates", "/audit_demo", "/audit_open_in_notes", "/export_audit", "/audit_axes"} <= names
    assert client.predict("support_agent", api_name="/audit_demo").startswith('{"model": "harbor-support"')
    settings = ["none", "computed", "kl", 3, 16, 0, 0, 0]  # grain, axes, --sample, the engines' block, budgets, --cache-reuse
    words, _, _, marked, data, notes, traffic, *_ = client.predict(LOG, ["field_only"], 2, 0.05, 0.9, *settings, api_name="/audit")
    assert data["turns"][1]["fields"][0]["name"] == "session_started" and "Recommended: " in words and "data-kind" in marked
    assert "**3 requests** in **1 session**" in traffic and data["sessions"][0]["requests"] == 3
    assert notes.startswith("**Open in Notes:**") and markdown_literal("next-token KL") in notes  # said before Open in Notes is offered
    said = client.predict("2:session_started", api_name="/audit_notes_field")  # the picked field's pre-check, nothing run
    assert said == notes
    text, *_ = client.predict("", "2:session_started", api_name="/audit_open_in_notes")  # the same session; the model's answers
    assert "[fields.session_started]" in text and '"yes"' not in text
    empty = client.predict("\n  \n", ["field_only"], 2, 0.05, 0.9, *settings, api_name="/audit")  # information, no error
    assert empty[6] == NOTHING_TO_AUDIT
    with pytest.raises(Exception, match="line 1 is not JSON"):
        client.predict("{broken", [], 2, 0.05, 0.9, *settings, api_name="/audit")


def test_hosts_can_override_the_audit_bounds():
    from kvscope.app.hosting import from_env

    profile = from_env(True, {"KVSCOPE_MAX_AUDIT_REQUESTS": "3", "KVSCOPE_MAX_AUDIT_TOKENS": "8"})
    assert (profile.max_audit_requests, profile.max_audit_tokens) == (3, 8)
    assert (public_profile().max_audit_requests, public_profile().max_audit_tokens) == (8, 32)


def test_a_rewrite_is_measured_against_the_log_and_a_mismatched_one_refused(registry):
    same, data = run_rewrite(registry, RewriteInputs(LOG, LOG, False, 2))
    assert all(row["kl"] == 0.0 and row["generation_agreement"] == 1.0 and row["same_text"] for row in data["rewrite"])
    assert [row["request"] for row in data["rewrite"]] == [1, 2, 3] and data["verdict"] in same
    with pytest.raises(AppError, match="3 requests.*2|2.*3 requests"):
        run_rewrite(registry, RewriteInputs(LOG, "\n".join(LOG.splitlines()[:2]), False, 2))
    with pytest.raises(AppError, match="rewritten log"):
        run_rewrite(registry, RewriteInputs(LOG, "  ", False, 2))


def test_coarsen_is_ticked_once_a_grain_is_picked_and_not_before():
    assert with_coarsen("none", ["erratum", "hoist"]) == ["erratum", "hoist"]
    assert with_coarsen("date", ["erratum"]) == ["erratum", "coarsen"]
    assert with_coarsen("date", ["coarsen"]) == ["coarsen"] and with_coarsen("hour", None) == ["coarsen"]


def test_an_uploaded_log_is_read_from_its_file_named_with_its_size_and_text_in_the_box_wins(registry, sessions, tmp_path: Path):
    upload = tmp_path / "bike_[desk].jsonl"
    upload.write_text(LOG, encoding="utf-8")
    said = upload_markdown(str(upload))
    assert said.startswith(f"Uploaded: **{markdown_literal(upload.name)}** · {len(LOG.encode()):,} bytes.") and "replace it" in said
    assert upload_markdown(None) == "" and upload_markdown("") == ""
    assert given_log("", str(upload)) == LOG and given_log(None, str(upload)) == LOG and given_log(" \n", str(upload)) == LOG
    assert given_log("pasted", str(upload)) == "pasted"  # text typed or pasted into the box is read instead
    assert given_log("pasted", None) == "pasted" and given_log("", None) == ""
    view = run_audit(registry, sessions, given_log("", str(upload)), session="u", **OPTIONS)  # the file's three requests
    assert view.summary["engines"]["requests"] == 3
    upload.unlink()
    with pytest.raises(AppError, match=r"bike_\[desk\].jsonl is no longer on the server.*upload it again"):
        given_log("", str(upload))


def test_file_sizes_read_as_bytes_kb_or_mb():
    assert [size_words(n) for n in (0, 845, 1023)] == ["0 bytes", "845 bytes", "1,023 bytes"]
    assert [size_words(n) for n in (1024, 47_416, 20 * 2**20 + 2**19)] == ["1.0 KB", "46.3 KB", "20.5 MB"]


def test_the_audit_hides_cancel_with_its_own_outputs_and_reads_the_upload(registry):
    """Cancel is hidden by the audit's own last outputs (a later .then step showed it seconds after the result), and only
    a failure has a step of its own; the audit, the one-prompt audit, its spans and the rewrites read the upload."""
    from kvscope.app.ui import build_app

    blocks = build_app(registry)
    by_id = {getattr(block, "elem_id", None): block for block in blocks.blocks.values()}
    cancel = by_id["cancel-audit"]
    fns = list(blocks.fns.values())
    (audit,) = [fn for fn in fns if fn.api_name == "audit"]
    assert audit.outputs[-1] is cancel
    (upload_fn,) = [fn for fn in fns if fn.api_name == "audit_upload"]
    uploaded = upload_fn.outputs[0]
    readers = {"audit", "audit_value", "audit_candidates", "audit_rewrite", "audit_rewrite_on_server"}
    assert all(uploaded in fn.inputs for fn in fns if fn.api_name in readers)
    after = [fn for fn in fns if cancel in fn.outputs and fn.trigger_after == audit._id]
    assert [fn.trigger_only_on_failure for fn in after] == [True]  # no step after a finished audit: its outputs hid Cancel


def test_the_figures_and_words_count_blocks_in_the_tabs_block_size(registry, sessions):
    """With the block size set to 128, the timeline's legend and the recommendation name 128-token blocks, beside block
    prefixes counted in 128 (not vLLM's default 16)."""
    view = run_audit(registry, sessions, LOG, session="b", engines=EngineInputs(block=128), **OPTIONS)
    (line,) = [trace for trace in view.timeline_figure.data if trace.name.endswith("blocks (vLLM)")]
    assert line.name == "128-token blocks (vLLM)"
    second = view.summary["turns"][1]
    assert second["block_prefix_tokens"] == second["common_prefix_tokens"] // 128 * 128
    words = view.recommendation_markdown
    assert f"{second['block_prefix_tokens']:,} in 128-token blocks" in words and "16-token" not in words
    one = run_audit(registry, sessions, LOG, session="b", **OPTIONS)  # the default block, said as such
    assert (
        "16-token blocks (vLLM)" in {trace.name for trace in one.timeline_figure.data}
        and "in 16-token blocks" in one.recommendation_markdown
    )


def test_a_rewrite_simulates_the_engines_the_tab_sets(registry):
    """The rewrite's reuse before and after is the engine's own with the tab's block size, not a default cache's."""
    from kvscope.engine import CacheSettings, ScanSettings, measure_rewrite

    given = RewriteInputs(LOG, LOG, False, 2)
    _, default = run_rewrite(registry, given)
    _, wide = run_rewrite(registry, given, engines=EngineInputs(block=128))
    log = read_log(LOG)
    truth = measure_rewrite(registry.get(), log, log, settings=ScanSettings(CacheSettings(128)), tokens=2)
    for mine, engine in zip(wide["rewrite"], truth.requests, strict=True):
        assert mine["reused_tokens_before"] == dict(engine.reused_before) and mine["reused_tokens_after"] == dict(engine.reused_after)
    assert [row["reused_tokens_before"]["vllm"] for row in wide["rewrite"]] != [
        row["reused_tokens_before"]["vllm"] for row in default["rewrite"]
    ]
    assert all(row["reused_tokens_before"]["vllm"] % 128 == 0 for row in wide["rewrite"])


def test_an_otel_logs_batch_read_with_its_spans_is_counted_as_what_it_is(registry, sessions):
    """The older OTel client's export: its logs batches give no request of their own (their records were read with the
    spans), and the traffic panel's count says so rather than calling them skipped records."""
    text = (Path(__file__).parents[2] / "demos/logs/exports/clients/otel-2.3b0.jsonl").read_text(encoding="utf-8")
    view = run_audit(registry, sessions, text, session="o", sample=0)
    said, count = view.traffic_markdown, view.summary["skipped_count"]
    listed = [line for line in said.splitlines() if line.startswith("- line ")]
    assert count > 0 and f"lines that gave no request of their own: {count}" in said and "skipped records" not in said
    assert len(listed) == min(count, MAX_TABLE_ROWS) and any("were read with their spans" in line for line in listed)


def test_the_tabs_default_engine_is_the_server_the_logs_answers_name(registry, sessions):
    """A llama-server replay (benchmarks/interop's chat_replay, its answers carrying ``timings``) audited with the tab's
    defaults is compared with llama.cpp at the server's own slot choice, and the panel says why."""
    stored = json.loads((Path(__file__).parents[2] / "benchmarks/interop/results/chat_replay-embedded-cpu.json").read_text())
    text = "".join(json.dumps(record) + "\n" for record in stored["servers"]["llama-default"]["log_token_ids"])
    view = run_audit(registry, sessions, text, session="auto", sample=0)
    observed = view.summary["observed"]
    assert observed["engine"] == "llama_cpp" and "timings" in observed["engine_evidence"]
    assert view.summary["engines"]["settings"]["prompt_cache"] is True
    assert "Compared with llama.cpp:" in view.traffic_markdown and "timings" in view.traffic_markdown
    named = run_audit(registry, sessions, text, session="named", sample=0, engines=EngineInputs(observed_engine="vllm"))
    assert named.summary["observed"]["engine"] == "vllm" and "named by" in named.summary["observed"]["engine_evidence"]
