"""The notes sweep: its variant generator, and the JSON a --quick run writes (tiny random-weight model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.studies import notes_sweep as sweep
from kvscope.engine.comparison.models import PAPER_MODELS
from kvscope.engine.edit.runs import run_scenario
from kvscope.engine.models import load_model
from kvscope.engine.scenario import render


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-qwen2")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("notes_sweep")
    data = sweep.main(["--model", "tiny-qwen2", "--quick", "--min-gap", "1e-6", "--out", str(out)])
    return data, out


# --------------------------------------------------------------------------------------------
# Variant generator
# --------------------------------------------------------------------------------------------
def test_grid_is_every_domain_times_every_variant():
    grid = list(sweep.variants())
    assert len(grid) == len(sweep.DOMAINS) * len(sweep.VARIANTS) == 3 * 22
    assert len({(domain, name) for domain, name, _ in grid}) == len(grid)
    quick = list(sweep.variants(sweep.QUICK_DOMAINS, sweep.QUICK_VARIANTS))
    assert [(d, n) for d, n, _ in quick] == [
        ("machine", "base"),
        ("machine", "record_after=0"),
        ("machine", "values=bool"),
        ("machine", "fmt=table"),
    ]
    # one factor at a time: every single-factor variant changes exactly one factor of the base design
    for name, design in sweep.VARIANTS.items():
        if name == "base":
            assert design.changes() == {}
        elif not name.startswith("best"):
            assert len(design.changes()) == 1, name


def test_every_variant_parses_and_renders_with_exact_field_spans(tiny):
    for domain, name, design in sweep.variants():
        scenario = sweep.scenario(domain, design)
        field = scenario.field()
        assert set(scenario.answers) == set(scenario.expect.values())
        assert scenario.expect[field.old] != scenario.expect[field.new], (domain, name)
        prompt = render(scenario, tiny.tokenizer)
        span = prompt.field_spans[field.name]
        assert tiny.tokenizer.decode(prompt.context_ids[span.start : span.end]).strip() == field.old
        if not design.rules_first:
            assert span.start < len(prompt.context_ids) // 2, (domain, name)


def test_base_design_is_the_bundled_demo_shape():
    text = sweep.scenario_text("machine")
    scenario = sweep.scenario("machine")
    assert scenario.field().name == "safety_mode" and (scenario.field().old, scenario.field().new) == ("locked", "ready")
    assert scenario.expect == {"locked": "deny", "ready": "approve"}
    lines = scenario.context.splitlines()
    assert lines[:2] == ["MACHINE", "safety_mode: {safety_mode}"]
    assert lines.count("safety_mode: ready -> approve") == 2 and lines.count("safety_mode: locked -> deny") == 2
    assert "Production targets never override safety_mode." in lines
    assert scenario.question == "Reply with exactly one of: Decision: approve / Decision: deny."
    assert text.startswith('name = "machine / base"')


def test_factors_change_what_they_say():
    ctx = lambda **kw: sweep.scenario("boarding", sweep.Design(**kw)).context  # noqa: E731
    assert ctx(record_after=0).splitlines()[:4] == ["PASSENGER", "visa_status: {visa_status}", "", "RULES"]
    assert ctx(filler=3).count("\n") == ctx().count("\n") + 3
    assert "Examples:" not in ctx(examples=0) and ctx(examples=8).count("-> allow") == 4
    assert "passenger #101, visa_status: valid -> allow" in ctx(example_items=True)
    assert ctx(rules_first=True).startswith("RULES") and ctx(rules_first=True).index("{visa_status}") > ctx(rules_first=True).index(
        "Examples:"
    )
    assert ctx(current="arrow").endswith("This passenger ->")
    assert "Frequent flyer" not in ctx(distractor=False)
    assert "Otherwise, refuse boarding" in ctx(deny_rule="otherwise") and "is expired" not in ctx(deny_rule="otherwise")
    assert "| valid | allow |" in ctx(fmt="table")
    boolean = sweep.scenario("boarding", sweep.Design(values="bool")).field()
    assert (boolean.name, boolean.old, boolean.new) == ("visa_valid", "false", "true")
    same_name = sweep.scenario("boarding", sweep.VARIANTS["pair=false/true"])
    assert (same_name.field().name, same_name.field().old, same_name.field().new) == ("visa_status", "false", "true")
    assert same_name.name == "boarding / pair=false/true" and "Allow boarding only if visa_status is true." in same_name.context
    assert len(list(sweep.variants(("machine",), tuple(sweep.PAIR_VARIANTS)))) == len(sweep.PAIRS) == 11
    code = sweep.scenario("boarding", sweep.Design(values="code"))
    assert (code.field().old, code.field().new) == ("S1", "S2") and "visa_code S1 means visa_status is expired" in code.context
    # the JSON format is JSON once the field is filled and the template's escaped braces undone
    filled = ctx(fmt="json").replace("{visa_status}", "expired").replace("{{", "{").replace("}}", "}")
    document = json.loads(filled)
    assert document["record"]["visa_status"] == "expired" and len(document["examples"]) == 4
    assert list(json.loads(ctx(fmt="json", rules_first=True).replace("{visa_status}", "x").replace("{{", "{").replace("}}", "}"))) == [
        "rules",
        "examples",
        "record",
    ]
    with pytest.raises(ValueError, match="unknown format"):
        sweep.scenario_text("boarding", sweep.Design(fmt="xml"))


def test_plain_rendering_hides_the_chat_template_and_restores_it(tiny):
    scenario = sweep.scenario("machine")
    template = tiny.tokenizer.chat_template
    with sweep.rendering(tiny, "plain"):
        plain = render(scenario, tiny.tokenizer)
    assert tiny.tokenizer.chat_template == template
    chat = render(scenario, tiny.tokenizer)
    assert tiny.tokenizer.decode(plain.decode_ids).endswith("\nAnswer:")
    assert len(plain.context_ids) < len(chat.context_ids)


# --------------------------------------------------------------------------------------------
# A --quick run on a tiny model: the JSON schema and its numbers
# --------------------------------------------------------------------------------------------
ROW_KEYS = {
    "domain",
    "variant",
    "design",
    "field",
    "old",
    "new",
    "context_tokens",
    "field_tokens",
    "stale_label",
    "stale_margin",
    "oracle_label",
    "oracle_margin",
    "delta_margin",
    "flips",
    "field_only_applicable",
    "field_only_label",
    "field_only_margin",
    "field_only_recovery",
    "notes_share",
    "note",
    "qualifies",
    "ms",
}


def test_quick_run_writes_the_result_document(quick_run):
    data, out = quick_run
    path = out / "notes_sweep-tiny-qwen2-float32.json"
    assert json.loads(path.read_text()) == data
    assert (out / "notes_sweep-tiny-qwen2-float32.png").stat().st_size > 1000 or (out / "notes_sweep-tiny-qwen2-float32.html").exists()
    assert data["benchmark"] == "notes_sweep" and data["quick"] is True
    assert data["model"] == "tiny-qwen2" and data["dtype"] == "float32" and data["device"] == "cpu"
    assert data["torch"] and data["transformers"] and data["torch_threads"] >= 1 and data["wall_s"] > 0
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    assert data["cpu"]["avx512_bf16"] is ("avx512_bf16" in flags)
    assert data["criteria"] == {"flip_min_abs_delta_margin": 1.0, "field_only_recovery_max": 0.4, "min_gap": 1e-6}
    assert data["paper_field_only_recovery"] == {paper.model: paper.field_only_recovery for paper in PAPER_MODELS}  # one home
    assert list(data["domains"]) == ["machine"]
    assert [row["variant"] for row in data["variants"]] == list(sweep.QUICK_VARIANTS)
    assert [line["variant"] for line in data["summary"]] == list(sweep.QUICK_VARIANTS)


def test_quick_run_rows_are_consistent_numbers(quick_run, tiny):
    data, _ = quick_run
    for row in data["variants"]:
        assert set(row) == ROW_KEYS
        design = sweep.VARIANTS[row["variant"]]
        scenario = sweep.scenario(row["domain"], design)
        prompt = render(scenario, tiny.tokenizer)
        assert row["context_tokens"] == len(prompt.context_ids)
        assert row["field_tokens"] == len(prompt.field_spans[row["field"]])
        assert (row["old"], row["new"]) == (scenario.field().old, scenario.field().new)
        # the stale margin is an ordinary clean prefill's margin on the same model
        assert row["stale_margin"] == pytest.approx(run_scenario(tiny, scenario).decision.margin, abs=2e-3)
        assert row["delta_margin"] == pytest.approx(row["oracle_margin"] - row["stale_margin"], abs=2e-4)
        assert row["flips"] == (row["stale_label"] != row["oracle_label"] and abs(row["delta_margin"]) >= 1.0)
        if row["field_only_applicable"]:
            gap = row["oracle_margin"] - row["stale_margin"]
            expected = (row["field_only_margin"] - row["stale_margin"]) / gap
            assert row["field_only_recovery"] == pytest.approx(expected, rel=1e-2, abs=5e-3)
            assert row["notes_share"] == pytest.approx(1 - row["field_only_recovery"], abs=1e-4)
            assert row["field_only_label"] in scenario.answers
        else:
            assert row["field_only_recovery"] is None and row["notes_share"] is None and "token" in row["note"]
        assert row["qualifies"] is (
            row["flips"]
            and row["field_only_label"] == row["stale_label"]
            and row["field_only_recovery"] is not None
            and row["field_only_recovery"] <= 0.4
        )
    base = data["summary"][0]
    assert base["variant"] == "base" and base["mean_change_vs_base"] is None and base["domains"] == 1
    for line, row in zip(data["summary"], data["variants"]):
        assert line["mean_notes_share"] == row["notes_share"]
        assert line["mean_delta_margin"] == row["delta_margin"] and line["mean_context_tokens"] == row["context_tokens"]
        if line["variant"] != "base" and row["notes_share"] is not None and data["variants"][0]["notes_share"] is not None:
            assert line["mean_change_vs_base"] == pytest.approx(row["notes_share"] - data["variants"][0]["notes_share"], abs=2e-4)
        assert not math.isnan(line["mean_delta_margin"])
