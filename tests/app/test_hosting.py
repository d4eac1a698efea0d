"""Safe to host: each defect found by the hostile review, reproduced and checked fixed (issue 12)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import plotly.graph_objects as go
import pytest
from gradio_client import Client

from benchmarks.common import free_port, wait_until_serving
from kvscope.app.handlers.common import AppError, scenario_choices
from kvscope.app.handlers.composer import Composition, run_agent_loop, run_compose
from kvscope.app.handlers.model import load_model_card, memory_markdown, offered_models
from kvscope.app.handlers.notes import EditInputs, run_edit
from kvscope.app.hosting import HostingError, from_env, local_profile, public_profile
from kvscope.app.page import plot_figure, user_error
from kvscope.app.state import ExportFolder, ModelRegistry, SessionStore
from kvscope.engine.cache.budget import WorkBudget, bounded
from kvscope.engine.cache.footprint import tensor_bytes
from kvscope.engine.cache.lru import BudgetedLRU
from tests.app.conftest import SCENARIO, TINY

ROOT = Path(__file__).parents[2]
LONG_CONTEXT = SCENARIO.replace("SESSION\n", "SESSION\n" + "order notes: the parcel left the warehouse on time.\n" * 40)


def _registry(profile=None) -> tuple[ModelRegistry, SessionStore]:
    registry = ModelRegistry(TINY, profile=profile or local_profile())
    sessions = SessionStore.for_profile(registry.profile)
    registry.on_drop(sessions.forget_model)
    return registry, sessions


# ---------------------------------------------------------------------------- 1. model copies
def test_switching_models_frees_the_evicted_copy_and_the_sessions_that_used_it():
    registry, sessions = _registry()
    run_edit(registry, sessions, EditInputs(SCENARIO, field="order_status", new="pending", strategies=["erratum"]), session="a")
    default = weakref.ref(registry.get())
    registry.get("tiny-llama")
    registry.get("tiny-gpt2")  # capacity 2: the default model (least recently used) goes
    gc.collect()
    assert default() is None, "no session, baseline or reference keeps the evicted model alive"
    assert sessions.get("a", "edit") is None and registry.loaded() == ["tiny-llama", "tiny-gpt2"]


def test_public_profile_pins_the_default_model():
    registry, sessions = _registry(public_profile())
    default = registry.get()
    run_edit(registry, sessions, EditInputs(SCENARIO, field="order_status", new="pending", strategies=["erratum"]), session="a")
    registry.get("tiny-llama")
    registry.get("tiny-gpt2")
    assert registry.get() is default and registry.loaded()[-1] == TINY and "tiny-llama" not in registry.loaded()
    assert sessions.get("a", "edit") is not None, "sessions on the pinned model survive other visitors' switches"


# ---------------------------------------------------------------------------- 2. session memory
def test_session_store_counts_every_tensor_an_edit_keeps(registry):
    sessions = SessionStore(budget_bytes=2**30, ttl_s=600)
    run_edit(
        registry, sessions, EditInputs(SCENARIO, field="order_status", new="pending", strategies=["field_only", "erratum"]), session="a"
    )
    experiment = sessions.get("a", "edit")
    stats = sessions.stats()
    assert stats["bytes"] == tensor_bytes([experiment, sessions.get("a", "effects")])
    assert stats["bytes"] > 2 * experiment.stale.notebook.memory_bytes(), "more than the stale K/V the old store counted"
    tight = SessionStore(budget_bytes=stats["bytes"] + 1, ttl_s=600)
    for session in ("a", "b"):
        run_edit(
            registry,
            tight,
            EditInputs(SCENARIO, field="order_status", new="pending", strategies=["field_only", "erratum"]),
            session=session,
        )
    assert tight.get("a", "edit") is None and tight.get("b", "edit") is not None and tight.stats()["bytes"] <= stats["bytes"] + 1


def test_idle_sessions_expire():
    now = [0.0]
    store = SessionStore(budget_bytes=2**20, ttl_s=60, clock=lambda: now[0])
    store.put("old", "k", 1)
    now[0] = 30.0
    store.put("new", "k", 2)
    now[0] = 75.0
    assert store.get("old", "k") is None and store.get("new", "k") == 2
    assert store.stats()["sessions"] == 1


def test_baselines_are_bounded_by_bytes_not_count():
    cache = BudgetedLRU(100, weigh=lambda value: value)
    for key, size in (("a", 60), ("b", 30), ("c", 50)):
        cache[key] = size
    assert list(cache) == ["b", "c"]  # 60 + 30 + 50 > 100: the least recently used goes first
    assert cache.nbytes <= 100 and "a" not in cache


def test_budgets_scale_with_memory_and_show_in_the_model_tab(registry, sessions):
    small, large = public_profile(memory_bytes=8 * 2**30), public_profile(memory_bytes=64 * 2**30)
    assert large.session_budget_bytes == pytest.approx(8 * small.session_budget_bytes, rel=1e-6)
    text = memory_markdown(registry, sessions)
    assert "Sessions" in text and "baselines" in text and "RSS" in text and "Limits" in text


# ---------------------------------------------------------------------------- 3. bounded work
def test_over_long_context_is_refused_in_seconds_and_keeps_nothing():
    registry, sessions = _registry(from_env(True, {"KVSCOPE_MAX_CONTEXT_TOKENS": "200"}))
    with (
        bounded(registry.profile.work_budget),
        pytest.raises(AppError, match=r"tokens of context; this server \(public profile\) allows at most 200"),
    ):
        run_edit(registry, sessions, EditInputs(LONG_CONTEXT, field="order_status", new="pending", strategies=["erratum"]), session="a")
    assert registry.memory()["baselines"] == 0 and sessions.get("a", "edit") is None
    with pytest.raises(AppError, match="characters; this server .* accepts at most 12,000"):
        run_edit(
            registry,
            sessions,
            EditInputs(SCENARIO + "#" * 50_000, field="order_status", new="pending", strategies=["erratum"]),
            session="a",
        )


def test_model_time_budget_stops_an_edit_cleanly(registry, sessions):
    with bounded(WorkBudget(seconds=0.0, profile="this server (public profile)")), pytest.raises(AppError, match="at most 0 s"):
        run_edit(
            registry,
            sessions,
            EditInputs(SCENARIO + "\n# budget\n", field="order_status", new="pending", strategies=["erratum"]),
            session="t",
        )
    assert sessions.get("t", "edit") is None
    view = run_edit(registry, sessions, EditInputs(SCENARIO, field="order_status", new="pending", strategies=["erratum"]), session="t")
    assert view.summary["new"] == "pending", "the server is usable after a stopped request"


def test_duplicated_strategies_run_once_and_turns_are_capped(registry, sessions):
    view = run_edit(
        registry,
        sessions,
        EditInputs(SCENARIO, field="order_status", new="pending", strategies=["erratum"] * 20, separately=True),
        session="d",
    )
    assert list(view.summary["strategies"]) == ["erratum"]
    public = ModelRegistry(TINY, profile=public_profile())
    public.add(TINY, registry.get())
    with pytest.raises(AppError, match="9 agent turns asked; this server .* runs at most 8"):
        run_agent_loop(public, Composition(["account_gate"], remedy="seam:1"), turns=9, toggle=False)


# ---------------------------------------------------------------------------- 4. composer text
def test_composer_text_naming_skills_is_literal(registry):
    view = run_compose(registry, Composition(["account_gate"], before="see {skill:account_gate} and {skill:not_placed}", remedy="seam:1"))
    plain = run_compose(registry, Composition(["account_gate"], before="see", remedy="seam:1"))
    with pytest.raises(AppError, match="the remedy must be a spec"):
        run_compose(registry, Composition(["account_gate"], before="see", remedy=1))
    assert view.summary["skill_tokens"] == plain.summary["skill_tokens"], "the skill is placed once"
    assert view.summary["context_tokens"] < 2 * plain.summary["context_tokens"]


# ---------------------------------------------------------------------------- 5. paths
@pytest.mark.parametrize("spec", ["~", "/etc", "/no/such/dir", "../..", "/root/.cache"])
def test_public_profile_refuses_local_paths_without_naming_server_paths(spec):
    registry, _ = _registry(public_profile())
    with pytest.raises(AppError) as refused:
        load_model_card(registry, spec)
    message = str(refused.value)
    assert message.startswith(f"model {spec!r} is not offered by this server (public profile); choose one of: embedded")
    assert str(Path.home()) not in message.replace(f"{spec!r}", "")


def test_local_paths_are_named_as_given_never_resolved(tmp_path, registry):
    with pytest.raises(AppError) as refused:
        load_model_card(registry, "~")
    assert "'~' has no config.json" in str(refused.value) and str(Path.home()) not in str(refused.value)
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(AppError) as refused:
        load_model_card(registry, str(tmp_path / "weights.bin"))
    assert "is a file" in str(refused.value)


def test_offered_models_hold_no_paths_on_a_public_server():
    registry, _ = _registry(public_profile(extra_models=("org/model",)))
    offered = offered_models(registry)
    assert all("/" not in spec or spec == "org/model" for spec in offered) and "org/model" in offered
    card, info = load_model_card(registry, TINY)
    assert info["hosting"]["name"] == "public" and info["hosting"]["max_context_tokens"] == 1024
    assert os.environ.get("KVSCOPE_CACHE_DIR", "~/.cache/kvscope") not in card and str(Path.home()) not in card


# ---------------------------------------------------------------------------- 6. escaping
def test_toasts_and_descriptions_escape_user_markup():
    toast = user_error(AppError("field '<img src=x onerror=alert(1)>' is unknown"))
    assert "<img" not in toast.message and "&lt;img" in toast.message
    hostile = SCENARIO.replace(
        'description = "Order status decides the refund."', 'description = "[click](http://evil.example) <b>bold</b>"'
    )
    description = scenario_choices(hostile).description
    assert "](" not in description and "<b>" not in description and r"\[click\]" in description


# ---------------------------------------------------------------------------- 7. specific errors
def test_specific_errors_for_bad_tiny_names_plots_and_empty_edits(registry, sessions):
    with pytest.raises(AppError, match="unknown tiny architecture 'nope'; choose one of: llama"):
        load_model_card(registry, "tiny-nope")

    class Broken:
        type, plot = "plotly", "{not json"

    with pytest.raises(AppError, match="plot 2 of this export is not a valid plotly figure"):
        plot_figure(Broken(), 1)
    with pytest.raises(AppError, match="the scenario editor is empty"):
        run_edit(registry, sessions, EditInputs(None, field=None, new=None, strategies=[], top_k=None), session="e")
    with pytest.raises(AppError, match="K must be a whole number, got 'many'"):
        run_edit(registry, sessions, EditInputs(SCENARIO, field=None, new=None, strategies=[], top_k="many"), session="e")


# ---------------------------------------------------------------------------- 8. exports
def test_exports_are_capped_and_pruned(tmp_path):
    folder = ExportFolder(max_bytes=64 * 1024, keep=2, root=tmp_path)
    with pytest.raises(HostingError, match=r"this export would be .* MB; the server writes at most"):
        folder.write({"blob": "x" * 100_000}, [], "big")
    assert folder.folders() == []
    for index in range(4):
        folder.write({"index": index}, [go.Figure()], "small")
    kept = folder.folders()
    assert len(kept) == 2 and '"index": 3' in (kept[-1] / "small.json").read_text()


# ---------------------------------------------------------------------------- python app.py --public
@pytest.fixture(scope="module")
def public_url():
    port = free_port()
    environment = {**os.environ, "KVSCOPE_MAX_CONTEXT_TOKENS": "200", "GRADIO_ANALYTICS_ENABLED": "False"}
    server = subprocess.Popen(
        [sys.executable, "app.py", "--public", "--model", TINY, "--port", str(port)],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    wait_until_serving(url, 90)
    yield url
    server.terminate()
    server.wait(20)


def test_public_server_refuses_paths_and_long_contexts(public_url):
    client = Client(public_url, verbose=False)
    with pytest.raises(Exception) as refused:
        client.predict("~", None, api_name="/load_model")
    assert "is not offered by this server (public profile)" in str(refused.value) and str(Path.home()) not in str(refused.value)
    with pytest.raises(Exception, match="allows at most 200"):
        client.predict(LONG_CONTEXT, "order_status", "pending", ["erratum"], 4, -1, api_name="/edit")
    with pytest.raises(Exception, match="the scenario editor is empty"):  # every input missing: a specific refusal
        client.predict(None, None, None, None, None, None, api_name="/edit")
    summary = client.predict(SCENARIO, "order_status", "pending", ["erratum"], 4, -1, api_name="/edit")[5]
    assert summary["new"] == "pending"
    memory = client.predict(api_name="/server_memory")
    assert "public" in memory and "context ≤ 200 tokens" in memory


def test_a_generator_handler_runs_every_step_within_the_budget_whichever_thread_runs_it(tmp_path):
    import gradio as gr

    from kvscope.app.page import Page
    from kvscope.engine.cache.budget import MAX_FORWARD_TOKENS, forward_token_limit

    profile = public_profile()
    page = Page(ModelRegistry(TINY, profile=profile), SessionStore(), ExportFolder(1 << 20, 2, tmp_path), gr.State(), gr.State())

    @page.action
    def shown_while_working():
        yield forward_token_limit()  # the token pass, shown
        yield forward_token_limit()  # the model pass's result
        raise AppError("the log has no request")

    steps = shown_while_working()
    with ThreadPoolExecutor(1) as first, ThreadPoolExecutor(1) as second:  # gradio may run each step on another thread
        said = [first.submit(next, steps).result(), second.submit(next, steps).result()]
        with pytest.raises(gr.Error, match="the log has no request"):
            first.submit(next, steps).result()
    assert said == [profile.forward_tokens, profile.forward_tokens] and profile.forward_tokens < MAX_FORWARD_TOKENS
    assert forward_token_limit() == MAX_FORWARD_TOKENS  # no budget outlives a step
