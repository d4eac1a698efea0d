"""The launched app through gradio_client: named endpoints, errors, and concurrent sessions."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gradio_client import Client, handle_file

from kvscope.engine.compose.pictures import bundled_images
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.scenario import Scenario
from kvscope.engine.scenario.text import bundled_scenarios
from tests.app.conftest import SCENARIO, free_port

STRATEGY_SET = ["field_only", "erratum"]


def _edit(client: Client, text: str, field: str, value: str) -> dict:
    result = client.predict(text, field, value, STRATEGY_SET, 4, -1, api_name="/edit")
    return result[5]  # the JSON summary


def test_named_endpoints_exist(app_url):
    names = set(Client(app_url, verbose=False).view_api(return_format="dict", print_info=False)["named_endpoints"])
    assert {
        "/load_model",
        "/prepare",
        "/edit",
        "/knockout",
        "/probe",
        "/compose",
        "/keystone",
        "/agent",
        "/benchmarks",
        "/scenario",
        "/compose_image",
    } <= names


def test_prepare_states_the_current_decision(app_url, registry):
    message = Client(app_url, verbose=False).predict(SCENARIO, api_name="/prepare")
    stale = EditExperiment(registry.get(), Scenario.from_toml(SCENARIO)).stale.decision
    assert f"**{stale.label}**" in message and f"{stale.margin:+.2f}" in message
    assert "⚠️" in Client(app_url, verbose=False).predict("name = [broken", api_name="/prepare")


def test_edit_and_knockout_through_the_api(app_url, registry):
    client = Client(app_url, verbose=False)
    summary = _edit(client, SCENARIO, "order_status", "pending")
    direct = EditExperiment(registry.get(), Scenario.from_toml(SCENARIO)).report(STRATEGY_SET).as_dict()
    assert summary["strategies"]["erratum"]["margin"] == pytest.approx(direct["strategies"]["erratum"]["margin"], abs=1e-4)
    text, _, data = client.predict("4", 4, api_name="/knockout")
    assert data["knockout"]["positions"] == [4] and "Knocked out 1 position (" in text
    assert data["strategies"] == summary["strategies"]  # the session's whole result: the edit and its knockout


def test_bad_scenario_is_an_error_and_the_session_stays_usable(app_url):
    client = Client(app_url, verbose=False)
    with pytest.raises(Exception, match="TOML syntax error"):
        client.predict("name = [broken", "order_status", "pending", STRATEGY_SET, 4, -1, api_name="/edit")
    assert _edit(client, SCENARIO, "order_status", "pending")["new"] == "pending"


def test_compose_endpoint_reports_fidelity(app_url):
    metrics, _, _, data, speed, stale = Client(app_url, verbose=False).predict(["account_gate"], "", "", "", "seam:2", api_name="/compose")
    assert (
        data["seam"] == 2
        and data["remedy"]["name"] == "seam:2"
        and {"cosine", "kl", "top1_agree", "decision_agree", "ttft_ms", "speedup"} <= set(data)
    )
    assert "cosine" in metrics and "Computed for** skills account\\_gate" in metrics and data["selection"]["skills"] == ["account_gate"]
    assert f"×{data['speedup']:.2f} on {data['context_tokens']:,} context tokens" in speed and stale == ""


def test_picture_splice_on_a_text_model_is_refused_by_name(app_url):
    picture = handle_file(str(bundled_images()["shipping_label"]))
    with pytest.raises(Exception, match="has no vision tower"):
        Client(app_url, verbose=False).predict(picture, "", "", "", 0, api_name="/compose_image")


def test_concurrent_clients_get_their_own_results(app_url, registry):
    """Several clients edit different values at once; each gets the result of its own edit."""
    values = ["pending", "shipped", "pending", "shipped"]
    scenario = Scenario.from_toml(SCENARIO)
    expected = {v: EditExperiment(registry.get(), scenario, new=v).report(STRATEGY_SET).as_dict() for v in set(values)}

    def one(value: str) -> tuple[str, dict]:
        client = Client(app_url, verbose=False)
        summary = _edit(client, SCENARIO, "order_status", value)
        text, _, knocked = client.predict("", 2, api_name="/knockout")  # acts on this client's own edit
        return value, {"summary": summary, "knocked": knocked}

    with ThreadPoolExecutor(max_workers=len(values)) as pool:
        results = list(pool.map(one, values))
    for value, result in results:
        assert result["summary"]["new"] == value
        assert result["summary"]["oracle"]["margin"] == pytest.approx(expected[value]["oracle"]["margin"], abs=1e-4)
        assert result["knocked"]["knockout"]["positions"] and result["knocked"]["new"] == value  # this session's own edit


def test_export_after_an_edit_returns_json_and_html(app_url):
    client = Client(app_url, verbose=False)
    result = client.predict(SCENARIO, "order_status", "pending", STRATEGY_SET, 4, -1, api_name="/edit")
    assert result[5]["new"] == "pending"
    files = client.predict(result[5], None, None, None, None, None, None, api_name="/export_notes")
    assert sorted(Path(f).suffix for f in files) == [".html", ".ipynb", ".json", ".py"]  # the script and notebook rerun it
    script = Path(next(f for f in files if f.endswith(".py"))).read_text(encoding="utf-8")
    assert "SCENARIO_TOML = " in script and 'FIELD = "order_status"' in script and 'NEW = "pending"' in script


def test_a_permalink_through_the_api(app_url):
    query = Client(app_url, verbose=False).predict(
        SCENARIO, "refund_gate", "order_status", "pending", ["erratum"], 4, -1, "prefix", False, True, api_name="/permalink"
    )
    assert query[0].startswith("?toml=") and "field=order_status" in query[0] and "all=1" in query[0]


def _menu(update: dict) -> tuple[list[str], str]:
    """A dropdown update's choices and value, as the client receives them."""
    return [choice for choice, _ in update["choices"]], update["value"]


def test_picking_a_bundled_scenario_fills_the_editor_and_its_menus(app_url):
    """The Notes tab's scenario menu (``/scenario``): the file's text in the editor, its name beside it, its fields and
    the first field's values offered (the new value chosen), and the last result's views cleared."""
    text = bundled_scenarios()["refund_gate"].read_text(encoding="utf-8")
    scenario = Scenario.from_toml(text)
    first = scenario.field()
    editor, description, field, value, *cleared = Client(app_url, verbose=False).predict("refund_gate", api_name="/scenario")
    assert editor == text.rstrip() and f"**{scenario.name}**" in description  # the code box keeps no trailing newline
    assert _menu(field) == (list(scenario.fields), first.name) and _menu(value) == (list(first.values), first.new)
    assert cleared and all(view["value"] is None for view in cleared)


def test_an_uploaded_scenario_fills_the_editor_escaped_and_a_broken_one_says_where(app_url, tmp_path):
    """``/upload_scenario``: a person's TOML in the editor, its name escaped beside it, the bundled menu emptied; a file
    that does not parse still lands in the editor, with the parser's line and column beside it and the menus kept."""
    client, path = Client(app_url, verbose=False), tmp_path / "mine.toml"
    text = bundled_scenarios()["refund_gate"].read_text(encoding="utf-8").replace('name = "Refund gate"', 'name = "My <b>gate</b>"')
    path.write_text(text, encoding="utf-8")
    editor, description, field, value, pick, *_ = client.predict(handle_file(str(path)), api_name="/upload_scenario")
    assert editor == text.rstrip() and "&lt;b&gt;" in description and "<b>" not in description
    assert _menu(field)[0] == list(Scenario.from_toml(text).fields) and pick["value"] is None
    path.write_text("name = [broken", encoding="utf-8")
    editor, description, field, value, *_ = client.predict(handle_file(str(path)), api_name="/upload_scenario")
    assert editor == "name = [broken" and description.startswith("⚠️") and "TOML syntax error" in description
    assert "line 1, column 9" in description and "choices" not in field and "choices" not in value


def test_a_rewrite_on_a_server_that_does_not_answer_is_said_in_the_panel(app_url):
    """``/audit_rewrite_on_server`` with nothing listening at the URL: the panel names the URL and what to do, and the
    call ends without an error (information, not a failure)."""
    log = "\n".join(json.dumps({"messages": [{"role": "user", "content": f"Is order {n} shipped?"}]}) for n in (1, 2))
    url = f"http://127.0.0.1:{free_port()}"
    words, data = Client(app_url, verbose=False).predict(log, log, False, 2, url, "", api_name="/audit_rewrite_on_server")
    assert f"Nothing answers at `{url}`" in words and "correct the URL in the box above" in words and data is None
