"""End to end in Debian's chromium through Playwright: what a person clicks and sees. Screenshots go to
test-artifacts/."""

import json
import random
import re
import string
import tomllib
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

import pytest

from kvscope.app.permalink import decode_toml, encode_toml
from tests.app.browser_waits import TOAST, fill_kept, wait_for_app, wait_for_audit
from tests.app.conftest import SCENARIO
from tests.shared import CHROMIUM, CHROMIUM_ARGS

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (scripts/test.sh installs it)")
ARGS = CHROMIUM_ARGS


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, app_url):
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(app_url)
    wait_for_app(page, page.locator("#baseline").get_by_text("Now"))  # the page opens on Notes, its scenario prepared
    yield page
    context.close()


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _set_editor(page, text: str) -> None:
    """Type ``text`` into the scenario editor and leave it; for TOML with a name, wait until the panel beside it shows
    that name or a warning (the Field and New value menus change in the same event, as a person sees): an Edit clicked
    before that sends the previous scenario's field."""
    editor = page.locator("#scenario-editor .cm-content")
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.press("Delete")
    editor.fill(text)
    page.locator("#scenario-description").click()
    try:
        name = tomllib.loads(text).get("name")
    except tomllib.TOMLDecodeError:
        return
    if name:
        wait_for_app(page, page.locator("#scenario-description").get_by_text(re.compile(f"{re.escape(name)}|⚠️")))


def test_edit_a_field_updates_strategy_cards(page):
    page.get_by_role("tab", name="Notes").click()
    _set_editor(page, SCENARIO)
    page.locator("#run-edit").click()
    card = page.locator('#strategy-cards [data-strategy="erratum"]')
    wait_for_app(page, card)
    assert card.get_attribute("data-decision") in ("yes", "no")
    assert page.locator('#strategy-cards [data-strategy="oracle"]').count() == 1
    wait_for_app(page, page.locator("#notes-plot .js-plotly-plot"))
    _shot(page, "notes-edit")
    page.get_by_text("Knockout: hide tokens from the decision").click()
    page.locator("#knockout-positions").locator("textarea, input").first.fill("3, 4, 5")
    page.locator("#run-knockout").click()
    wait_for_app(page, page.locator("#knockout-result").get_by_text("Knocked out 3 positions"))
    _shot(page, "notes-knockout")
    page.locator("#export-notes").click()
    wait_for_app(page, page.locator("#notes-files").get_by_text("kvscope-notes-figures"))
    wait_for_app(page, page.locator("#notes-files").get_by_text(".ipynb"))
    listed = page.locator("#notes-files").inner_text().replace("\n", "")  # names show as stem + suffix
    assert all(name in listed for name in ("kvscope-notes.json", "kvscope-notes.py", "kvscope-notes.ipynb")), listed
    _shot(page, "notes-export")


def _plot_data(page, element_id: str) -> list[dict]:
    """The traces plotly drew in a gr.Plot, as plotly decoded them (x, y and z as plain lists)."""
    wait_for_app(page, page.locator(f"#{element_id} .js-plotly-plot"))
    return page.evaluate(
        """id => Array.from(document.querySelector(`#${id} .js-plotly-plot`)._fullData, t => ({
               name: t.name || null, type: t.type, x: Array.from(t.x || []), y: Array.from(t.y || []),
               z: Array.from(t.z || [], row => Array.from(row)) }))""",
        element_id,
    )


def test_default_notes_scenario_shows_notes_headline_frontier_and_map(page):
    page.get_by_role("tab", name="Notes").click()
    assert "PRESCRIPTION" in page.locator("#scenario-editor").inner_text()  # the default: the strongest notes demo
    page.locator("#run-edit").click()
    headline = page.locator("#notes-headline")
    wait_for_app(page, headline)
    assert headline.inner_text().startswith("Notes ")
    assert page.locator("#notes-text .kv-tok").count() > 50
    frontier = [trace for trace in _plot_data(page, "frontier-plot") if trace["type"] == "scatter" and trace["name"]]
    names = {trace["name"] for trace in frontier}
    assert {"field_only", "erratum", "field_topk (causal)", "field_topk (deviation)"} <= names
    assert all(len(trace["x"]) == len(trace["y"]) > 0 for trace in frontier)
    (heatmap, *_) = _plot_data(page, "notes-plot")
    narrow = len(heatmap["z"][0])
    assert len(heatmap["z"]) > 1 and narrow > 1 and any(value != 0 for row in heatmap["z"] for value in row)
    _shot(page, "notes-default")
    page.locator("#notes-all-positions input").check()
    page.wait_for_function(
        "n => document.querySelector('#notes-plot .js-plotly-plot')._fullData[0].z[0].length > n", arg=narrow, timeout=30_000
    )
    _shot(page, "notes-all-positions")


def test_malformed_scenario_shows_its_error(page):
    page.get_by_role("tab", name="Notes").click()
    _set_editor(page, "name = [broken")
    page.locator("#run-edit").click()
    wait_for_app(page, page.get_by_text("TOML syntax error").first)
    _shot(page, "notes-error")


def test_drag_a_skill_into_the_context_shows_fidelity(page):
    page.get_by_role("tab", name="Composer").click()
    source = page.locator('#composer .kv-chip[data-from="library"][data-id="user_memory"]')
    target = page.locator("#composer .kv-context")
    source.drag_to(target)
    wait_for_app(page, page.locator('#composer .kv-in[data-id="user_memory"]'))
    wait_for_app(page, page.locator("#compose-metrics").get_by_text("cosine"))
    wait_for_app(page, page.locator("#logits-plot .js-plotly-plot"))
    _shot(page, "composer-drag")


def test_a_first_visit_opens_on_the_notes_tab_with_the_model_card_one_click_away(page):
    assert page.get_by_role("tab", name="Notes").get_attribute("aria-selected") == "true"
    assert page.locator("#run-edit").is_visible() and not page.locator("#model-card").is_visible()
    page.get_by_role("tab", name="Model", exact=True).click()
    wait_for_app(page, page.locator("#model-card").get_by_text("Operations on this model"))


def test_model_tab_shows_memory_against_budgets(page):
    page.get_by_role("tab", name="Model", exact=True).click()
    memory = page.locator("#server-memory")
    wait_for_app(page, memory.get_by_text("Sessions"))
    text = memory.inner_text()
    assert "Profile local" in text and "process RSS" in text and "Limits any context length" in text
    _shot(page, "model-memory")


def test_model_card_shows_the_models_support_row(page):
    page.get_by_role("tab", name="Model", exact=True).click()
    card = page.locator("#model-card")
    wait_for_app(page, card.get_by_text("Operations on this model"))
    text = card.inner_text()
    assert "Family: Qwen2 / Qwen2.5" in text and "Cached per token and layer: key 2×16 + value 2×16" in text
    assert "max |error| vs the model's own forward (float32)" in text and "seam repair" in text
    _shot(page, "model-card")


def test_agent_loop_shows_cached_clean_state_and_identical_decisions(page):
    page.get_by_role("tab", name="Composer").click()
    wait_for_app(page, page.locator('#composer .kv-in[data-id="account_gate"]'))  # the composer's default context
    page.locator("#run-agent").click()
    names = [trace["name"] for trace in _plot_data(page, "loop-plot")]
    assert names[:3] == ["cached (errata)", "clean-state prefill", "identical-token re-prefill"]
    _shot(page, "agent-loop")


def test_the_remedy_menu_names_the_default_and_auto_calibrates_the_model(page, tmp_path, monkeypatch):
    from kvscope.engine.compose import calibration
    from kvscope.engine.compose.remedy import DEFAULT_REMEDY

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    plan = calibration.CalibrationPlan(
        skills=("account_gate",), sizes=(1,), placements=("start",), remedies=("splice", "seam:1"), keystone_scenario=None
    )
    monkeypatch.setattr(calibration, "CalibrationPlan", lambda: plan)
    page.get_by_role("tab", name="Composer").click()
    menu = page.locator("#remedy")
    assert (
        menu.locator("input").input_value().startswith(f"{DEFAULT_REMEDY.name} — ") and "(default)" in menu.locator("input").input_value()
    )
    assert "What each part means, and why this default: below the menu." in menu.inner_text()
    page.get_by_text("What the remedies mean, and why this default").click()  # the details, one click away
    details = page.locator("#remedy-info")
    wait_for_app(page, details.get_by_text("not measured for this model yet"))  # no stored study of the tiny model
    assert "auto: this model's own calibration" in details.inner_text()
    menu.locator("input").click()
    page.get_by_role("option", name=re.compile(r"^auto — ")).click()
    page.locator("#run-compose").click()
    wait_for_app(page, page.locator("#compose-metrics").get_by_text("cosine"))
    (stored,) = json.loads((tmp_path / "remedy-choices.json").read_text()).values()
    assert f"remedy {stored['remedy']} recomputed" in page.locator("#compose-metrics").inner_text()
    _shot(page, "composer-remedy-auto")


def test_the_remedy_menu_follows_the_loaded_model_to_its_own_stored_study(page, tmp_path, monkeypatch):
    from kvscope.app.handlers import benchmarks as stored_results
    from kvscope.engine.compose.choice import choose_remedy
    from kvscope.engine.compose.remedy import DEFAULT_REMEDY

    def row(agree, speedup):
        share = {"min": speedup, "median": speedup, "max": speedup}
        return {"agree_decisive": agree, "decisive": 20, "ties": 4, "agreement": agree / 20, "mean_abs_margin_error": 0.05,
                "recomputed_fraction": 0.0, "speedup": share, "needs_reference": False}  # fmt: skip

    summary = {"splice": row(20, 6.4), "prefix+ape:1,0.8": row(20, 5.2)}
    study = {"model": "tiny-llama:random", "summary": summary, "choice": choose_remedy(summary, {}).as_dict()}
    (tmp_path / "compose_many-tiny-llama-cpu.json").write_text(json.dumps(study))
    monkeypatch.setattr(stored_results, "STUDY_RESULTS", tmp_path)
    page.get_by_role("tab", name="Model", exact=True).click()
    model = page.locator("#model-spec input")
    model.fill("tiny-llama")
    model.press("Enter")
    page.locator("#load-model").click()
    wait_for_app(page, page.locator("#model-card").get_by_text("tiny-llama").first)
    page.get_by_role("tab", name="Composer").click()
    menu = page.locator("#remedy")
    wait_for_app(page, menu.get_by_text("Default for tiny-llama splice: keeps 20/20"))
    assert (
        menu.locator("input").input_value()
        == "splice — keeps 20/20 decisions of a full recompute, ×6.40 faster first token (median) (default)"
    )
    page.get_by_text("What the remedies mean, and why this default").click()
    assert "Default for tiny-llama splice: keeps 20/20 decisive decisions" in page.locator("#remedy-info").inner_text()
    _shot(page, "composer-remedy-per-model")
    page.get_by_role("tab", name="Model", exact=True).click()
    model.fill("tiny-qwen2")
    model.press("Enter")
    page.locator("#load-model").click()
    page.get_by_role("tab", name="Composer").click()
    wait_for_app(page, menu.get_by_text(f"Default for tiny-qwen2 {DEFAULT_REMEDY.name}: not measured"))


def test_composer_study_and_keystone_diagonal(page):
    page.get_by_role("tab", name="Composer").click()
    wait_for_app(page, page.locator('#composer .kv-in[data-id="account_gate"]'))
    page.get_by_text("Many skills at once").click()
    page.locator("#run-study").click()
    wait_for_app(page, page.locator("#study-summary").get_by_text("composed prompt"))
    names = [trace["name"] for trace in _plot_data(page, "study-plot")]
    assert {"splice", "seam:1", "prefix+seam:1"} <= set(names)
    _shot(page, "composer-study")
    page.locator("#keystone-demo").click()
    page.locator('#composer .kv-in[data-id="account_gate"]').wait_for(state="detached", timeout=10_000)
    page.locator("#run-keystone").click()
    traces = _plot_data(page, "loop-plot")
    assert [trace["name"] for trace in traces] == ["within ±0.15", "composed = recomputed", "strategies"]
    _shot(page, "composer-keystone")


def test_error_toasts_show_markup_as_text(page):
    page.get_by_role("tab", name="Notes").click()
    _set_editor(page, SCENARIO + '\n[expect]\n"shipped" = "<b>bold</b>"\n')
    page.locator("#run-edit").click()
    wait_for_app(page, page.get_by_text("<b>bold</b>").first)
    assert page.locator(".toast-body b, [data-testid='toast-body'] b").count() == 0
    assert page.locator("#scenario-description b").count() == 0, "the description's warning shows the markup as text"
    _shot(page, "toast-escaped")


def test_lenient_inputs_render_with_their_parents_frontends(page):
    """Subclassed Gradio inputs draw with CheckboxGroup's and Slider's own frontends (not an empty slot)."""
    page.get_by_role("tab", name="Notes").click()
    wait_for_app(page, page.locator("#top-k input[type=range]"))
    assert page.locator("#strategies input[type=checkbox]").count() > 3
    page.get_by_role("tab", name="Composer").click()
    page.get_by_text("Many skills at once").click()
    wait_for_app(page, page.locator("#study-remedies input[type=checkbox]").first)
    assert page.locator("#study-placements input[type=checkbox]").count() == 3


def test_weights_panel_compares_rome_and_the_erratum(page):
    page.get_by_role("tab", name="Probes").click()
    page.locator("#weights-methods").get_by_label("lora", exact=True).uncheck()
    page.locator("#run-weights").click()
    summary = page.locator("#weights-summary")
    wait_for_app(page, summary.get_by_text("other customers now get the new decision").first)
    text = summary.inner_text()
    assert "field_erratum" in text and "rome" in text and "Paper (Llama-3.1-8B)" in text
    wait_for_app(page, page.locator("#weights-plot .main-svg").first)
    _shot(page, "weights-panel")


def test_a_picture_spliced_behind_text_on_a_vision_model(page):
    """The default text model says what is missing; after loading tiny-qwen2_vl the picture splice runs."""
    page.get_by_role("tab", name="Composer").click()
    page.get_by_text("A picture's K/V spliced into a context").click()
    wait_for_app(page, page.locator("#image-picture img"))
    page.locator("#run-image").click()
    wait_for_app(page, page.get_by_text("has no vision tower").first)
    page.get_by_role("tab", name="Model", exact=True).click()
    model = page.locator("#model-spec input")
    model.fill("tiny-qwen2_vl")
    model.press("Enter")
    page.locator("#load-model").click()
    wait_for_app(page, page.locator("#model-card").get_by_text("Qwen2-VL").first)
    assert "images" in page.locator("#model-card").inner_text()
    page.get_by_role("tab", name="Composer").click()
    page.locator("#run-image").click()
    wait_for_app(page, page.locator("#image-metrics").get_by_text("rope positions"))
    assert "picture 14 tokens over 6 rope positions" in page.locator("#image-metrics").inner_text()
    assert {trace["name"] for trace in _plot_data(page, "image-logits-plot")} == {"spliced", "recomputed"}
    _shot(page, "composer-picture")


LEARN_STEPS = {  # step → what its result must say (inner text, numbers by pattern), the traces its figure draws, cards shown
    1: (
        r"tiny-qwen2: with expired the model answers \w+ \(margin [+-]\d+\.\d\d\); with valid it answers \w+ "
        r"\(margin [+-]\d+\.\d\d\): a clean prefill (changes|does not change) the decision",
        {"label (log Σ P)"},
        (),
    ),
    2: (
        r"recomputing the field alone recovers (only )?-?\d\.\d\d .*Paper: field-only recovery ≈ 0 at 7–9B",
        None,
        ("field_only", "full_downstream"),
    ),
    3: (
        r"the erratum alone recovers -?\d\.\d\d and field \+ erratum -?\d\.\d\d .*appending \d+ tokens to a \d+-token context"
        r".*Paper: field\+erratum P\(correct\) 1\.00",
        None,
        ("erratum", "field_erratum"),
    ),
    4: (
        r"Spliced vs recomputed: logit cosine \d\.\d{4}, KL -?\d\.\d{4}, decision (agrees|differs); time to first token "
        r"\d+ ms vs \d+ ms \(×[\d.]+\) for \d+ spliced of \d+ context tokens\..*Paper: logit cosine 0\.90–0\.999",
        {"spliced", "recomputed"},
        (),
    ),
}


@pytest.mark.parametrize("step", LEARN_STEPS, ids=["decisions", "field-only", "erratum", "splicing"])
def test_learn_step_shows_its_result_and_figure(page, step):
    """Each Learn button fills its own group: the sentence about what the loaded model did, and a drawn figure."""
    pattern, traces, cards = LEARN_STEPS[step]
    page.get_by_role("tab", name="Learn").click()
    page.locator(f"#learn-{step}").click()
    result = page.locator(f"#learn-{step}-result")
    wait_for_app(page, result.locator("p").first.or_(page.locator(TOAST)).first)
    assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()
    text = result.inner_text()
    assert re.search(pattern, text, re.S), text
    for name in cards:
        assert result.locator(f'[data-strategy="{name}"]').count() == 1, name
    plot = page.locator(f"#learn-{step}-plot .js-plotly-plot")
    wait_for_app(page, plot.locator(".main-svg").first)
    drawn = plot.evaluate("node => Array.from(node._fullData, t => ({name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || [])}))")
    assert drawn and all(len(trace["x"]) == len(trace["y"]) > 0 for trace in drawn), drawn
    if traces:
        assert traces <= {trace["name"] for trace in drawn}
    result.scroll_into_view_if_needed()
    _shot(page, f"learn-step-{step}")


# ---------------------------------------------------------------------------- permalinks
def _open(browser, app_url: str, query: str):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=app_url.rstrip("/"))
    page = context.new_page()
    page.goto(app_url + query)
    page.wait_for_selector("#run-edit", timeout=60_000)  # a link opens on the Notes tab it restores: nothing to click
    return context, page


def _notes_state(page) -> dict:
    """What the Notes tab shows selected: scenario, field, value, strategies, K and head."""
    checked = page.locator("#strategies input[type=checkbox]:checked")
    return {
        "scenario": page.locator("#scenario input").input_value(),
        "field": page.locator("#field input").input_value(),
        "value": page.locator("#new-value input").input_value(),
        "strategies": checked.evaluate_all("boxes => boxes.map(box => box.closest('label').textContent.trim())"),
        "k": page.locator("#top-k input[type=number]").input_value(),
        "head": page.locator("#head input[type=number]").input_value(),
    }


def _cards(page) -> list[str]:
    wait_for_app(page, page.locator('#strategy-cards [data-strategy="oracle"]'))
    return page.locator("#strategy-cards [data-strategy]").evaluate_all("cards => cards.map(card => card.dataset.strategy)")


def _query(url: str) -> dict:
    return dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))


def test_a_permalink_restores_the_notes_state_and_runs_the_edit(browser, app_url):
    query = "?" + urlencode(
        {
            "scenario": "boarding_visa",
            "field": "visa_status",
            "value": "valid",
            "strategies": "field_only,erratum",
            "k": "4",
            "head": "1",
            "remedy": "prefix+seam:1",
        }
    )
    context, page = _open(browser, app_url, query)
    assert page.get_by_role("tab", name="Notes").get_attribute("aria-selected") == "true"  # the tab the link restores
    cards = _cards(page)
    assert {"field_only", "erratum", "stale", "oracle"} <= set(cards) and "field_erratum" not in cards
    assert _notes_state(page) == {
        "scenario": "boarding_visa",
        "field": "visa_status",
        "value": "valid",
        "strategies": ["field_only", "erratum"],
        "k": "4",
        "head": "1",
    }
    assert "visa_status: {visa_status}" in page.locator("#scenario-editor").inner_text()
    assert page.locator("#permalink-status").inner_text().startswith("Restored from the link: bundled scenario boarding_visa")
    wait_for_app(page, page.locator("#baseline").get_by_text("visa_status"))  # the link's scenario was prepared
    wait_for_app(page, page.locator("#frontier-plot .js-plotly-plot"))  # the frontier follows the edit
    _shot(page, "permalink-bundled")
    page.locator("#copy-link").click()
    link = page.locator("#permalink textarea")
    page.wait_for_function("() => document.querySelector('#permalink textarea').value.startsWith('http')", timeout=30_000)
    copied = link.input_value()
    assert copied.startswith(app_url + "?") and _query(copied) == _query(query) | {"separately": "0", "all": "0"}
    assert page.evaluate("navigator.clipboard.readText()") == copied
    _shot(page, "permalink-copied")
    page.get_by_role("tab", name="Composer").click()
    assert re.fullmatch(r"prefix\+seam:1( — .*)?", page.locator("#remedy input").input_value())
    context.close()


def test_a_permalink_carries_an_edited_scenario_inline(browser, app_url):
    edited = SCENARIO.replace("Refund test", "Refund test (edited in the browser)")
    query = "?" + urlencode(
        {"toml": encode_toml(edited), "field": "order_status", "value": "pending", "strategies": "erratum,field_erratum"}
    )
    context, page = _open(browser, app_url, query)
    assert set(_cards(page)) == {"stale", "erratum", "field_erratum", "oracle"}
    state = _notes_state(page)
    assert (state["field"], state["value"], state["strategies"]) == ("order_status", "pending", ["erratum", "field_erratum"])
    assert state["scenario"] == ""  # no bundled scenario is selected: the editor holds the link's
    assert "Refund test (edited in the browser)" in page.locator("#scenario-editor").inner_text()
    assert "the scenario carried in the link" in page.locator("#permalink-status").inner_text()
    _shot(page, "permalink-inline")
    page.locator("#copy-link").click()
    page.wait_for_function("() => document.querySelector('#permalink textarea').value.includes('toml=')", timeout=30_000)
    assert decode_toml(_query(page.locator("#permalink textarea").input_value())["toml"]) == edited.strip()  # as the editor holds it
    noise = "".join(random.Random(1).choices(string.ascii_letters + string.digits, k=12_000))
    _set_editor(page, edited + f"# {noise}\n")
    page.locator("#copy-link").click()
    wait_for_app(page, page.locator("#permalink-status").get_by_text("a link carries at most 8,192"))
    assert page.locator("#permalink textarea").input_value() == ""
    _shot(page, "permalink-too-long")
    context.close()


def test_a_bad_permalink_says_why_and_leaves_the_page_usable(browser, app_url):
    context, page = _open(browser, app_url, "?scenario=boarding_visa&strategies=erratum,telepathy")
    status = page.locator("#permalink-status")
    wait_for_app(page, status.get_by_text("unknown strategy 'telepathy' in the link"))
    assert "PRESCRIPTION" in page.locator("#scenario-editor").inner_text()  # the defaults stay
    page.locator("#run-edit").click()
    assert "erratum" in _cards(page)
    _shot(page, "permalink-bad")
    context.close()


# ---------------------------------------------------------------------------- Your prompt: a request log audited
AUDIT_SYSTEM = "You are the help desk of a bike shop.\nSession started: 2026-05-12 09:{minute}\nCustomer tier: gold\nBe brief."
AUDIT_ASK = "Is the <b>repair</b> of my wheel covered?"


def _audit_request(minute: str, *turns: tuple[str, str]) -> str:
    messages = [{"role": "system", "content": AUDIT_SYSTEM.format(minute=minute)}, {"role": "user", "content": AUDIT_ASK}]
    return json.dumps({"messages": messages + [{"role": role, "content": text} for role, text in turns]})


# Written the way a new user would: their own system prompt with a per-minute timestamp, then one more turn.
AUDIT_LOG = "\n".join(
    [
        _audit_request("41"),
        _audit_request("42"),
        _audit_request("42", ("assistant", "Yes, within the warranty."), ("user", "And the brakes?")),
    ]
)


def _audit(page, text: str = AUDIT_LOG) -> None:
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-input textarea").fill(text)
    page.locator("#audit-tokens input[type=number]").fill("4")
    page.locator("#run-audit").click()


def test_a_new_user_audits_their_own_request_log(page):
    _audit(page)
    recommendation = page.locator("#audit-recommendation")
    wait_for_app(page, recommendation.get_by_text("Recommended:").first)
    text = recommendation.inner_text()
    assert "session_started “2026-05-12 09:41” → “2026-05-12 09:42”" in text, text
    request_2 = r"Request 2: a prefix cache reuses \d+ of \d+ tokens .*Recommended: \w+ — \w+ \(prompt-level, [^)]*\) computes"
    assert re.search(request_2, text, re.S), text
    assert re.search(r"Request 3: .*fields changed: none \(only new turns appended\).*Recommended: recompute", text, re.S), text
    timeline = {trace["name"]: trace for trace in _plot_data(page, "audit-timeline")}
    assert {"recompute (exact prefix)", "field_only", "erratum", "field_erratum", "hoist", "16-token blocks (vLLM)"} <= set(timeline)
    assert [round(x) for x in timeline["recompute (exact prefix)"]["x"]] == [2, 3] and all(
        0 <= y <= 1 for y in timeline["recompute (exact prefix)"]["y"]
    )
    fidelity = {trace["name"]: trace for trace in _plot_data(page, "audit-fidelity") if trace["name"]}
    assert {"recompute", "field_only", "erratum", "field_erratum", "hoist"} <= set(fidelity)
    assert len(fidelity["recompute"]["x"]) == 2 and len(fidelity["field_only"]["x"]) == 1  # field_only: the turn with a field
    field = page.locator('#audit-prompt mark[data-kind="field"]')
    assert field.count() == 1 and field.inner_text() == "2026-05-12 09:42"
    assert "session_started: '2026-05-12 09:41' → '2026-05-12 09:42'" == field.get_attribute("title")
    assert page.locator("#audit-prompt .kv-prompt b").count() == 0 and "<b>repair</b>" in page.locator("#audit-prompt").inner_text()
    _shot(page, "audit-log")
    page.locator("#audit-y").get_by_label("greedy agreement").check()
    page.wait_for_function(
        "() => document.querySelector('#audit-fidelity .js-plotly-plot').layout.yaxis.tickformat === '.0%'", timeout=30_000
    )
    page.locator("#export-audit").click()
    wait_for_app(page, page.locator("#audit-files").get_by_text("kvscope-audit-scenario"))
    assert page.locator("#audit-files").get_by_text("kvscope-audit-template").count() == 1
    page.locator("#audit-input textarea").fill(AUDIT_LOG + "\n{not json")
    page.locator("#run-audit").click()
    wait_for_app(page, page.get_by_text("line 4 is not JSON").first)  # skipped by name: the three requests are audited
    wait_for_audit(page)
    assert "session_started" in recommendation.inner_text()
    _shot(page, "audit-bad-line")


def test_open_in_notes_runs_the_edit_and_the_notes_map_on_the_users_prompt(page):
    _audit(page)
    wait_for_app(page, page.locator("#audit-recommendation").get_by_text("Recommended:").first)
    page.locator("#audit-labels textarea, #audit-labels input").first.fill("covered, not covered")
    page.locator("#audit-open-notes").click()
    wait_for_app(page, page.locator('#strategy-cards [data-strategy="oracle"]'))
    assert page.get_by_role("tab", name="Notes").get_attribute("aria-selected") == "true"
    editor = page.locator("#scenario-editor").inner_text()
    assert "{session_started}" in editor and '"covered" = ["covered"]' in editor
    assert page.locator("#strategy-cards").get_by_text("session_started").count() >= 1
    assert page.locator('#strategy-cards [data-strategy="field_only"]').get_attribute("data-decision") in ("covered", "not covered")
    assert "session_started = 2026-05-12 09:41" in page.locator("#baseline").inner_text()
    (heatmap, *_) = _plot_data(page, "notes-plot")
    assert len(heatmap["z"]) > 1 and any(value != 0 for row in heatmap["z"] for value in row)
    _shot(page, "audit-open-in-notes")
    page.get_by_text("Knockout: hide tokens from the decision").click()
    page.locator("#run-knockout").click()
    wait_for_app(page, page.locator("#knockout-result").get_by_text("Knocked out"))


def test_one_prompt_offers_volatile_spans_and_audits_a_new_value(page):
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-input textarea").fill(
        "Order A-48213 placed 2026-05-12 09:41 for <i>Ana</i>.\nStatus: shipped\nCan it be cancelled?"
    )
    page.get_by_text("One prompt: change a value").click()
    page.locator("#audit-find-spans").click()
    marks = page.locator('#audit-candidates mark[data-kind="candidate"]')
    wait_for_app(page, marks.first)
    assert marks.count() >= 3 and page.locator("#audit-candidates i").count() == 0
    fill_kept(page.locator("#audit-find textarea, #audit-find input").first, "shipped")  # in the accordion opened above
    fill_kept(page.locator("#audit-new-value textarea, #audit-new-value input").first, "pending")
    page.locator("#audit-tokens input[type=number]").fill("4")
    page.locator("#run-audit-value").click()
    wait_for_app(page, page.locator("#audit-recommendation").get_by_text("Recommended:").first)
    assert "“shipped” → “pending”" in page.locator("#audit-recommendation").inner_text()
    page.locator("#audit-candidates").scroll_into_view_if_needed()
    _shot(page, "audit-one-prompt")
