"""The remedy menu's speed-ups say at what context lengths they were measured; a run says what its length predicts."""

import json

from kvscope.app.handlers.composer import Composition, remedy_menu, remedy_summary, run_compose
from kvscope.app.state import ModelRegistry
from kvscope.engine import STUDY_REMEDIES


def test_the_menu_names_the_context_lengths_of_its_speed_ups():
    registry = ModelRegistry("tiny-qwen2")  # nothing is loaded: the menu of "embedded" reads its stored study
    labels = dict((spec, label) for label, spec in remedy_menu(registry, "embedded", STUDY_REMEDIES))
    assert labels["prefix+seam:16"].endswith("×4.16 faster first token (median) on 451–1,711-token contexts (default)")
    assert labels["splice"].endswith("×5.76 faster first token (median) on 451–1,711-token contexts")
    assert "not measured" in labels["seam:1+aggregators"] and "token contexts" not in labels["seam:1+aggregators"]
    assert "on 451–1,711-token contexts. What each part means" in remedy_summary(registry, "embedded")


def test_a_run_sets_its_measured_speed_up_beside_the_menu_s(registry):
    view = run_compose(registry, Composition(["account_gate"], after="", remedy="seam:1"))
    tokens, speedup = view.summary["context_tokens"], view.summary["speedup"]
    assert f"this run measured ×{speedup:.2f} on {tokens:,} context tokens" in view.speed_markdown
    assert "no stored study of tiny\\-qwen2 measured it" in view.speed_markdown


def test_a_run_reads_what_the_stored_study_predicts_at_its_length(registry, tmp_path, monkeypatch):
    from kvscope.app.handlers import benchmarks as stored_results
    from kvscope.engine.compose.choice import choose_remedy

    row = {"agree_decisive": 4, "decisive": 4, "ties": 0, "agreement": 1.0, "mean_abs_margin_error": 0.01,
           "recomputed_fraction": 0.0, "speedup": {"min": 3.0, "median": 3.0, "max": 3.0}, "needs_reference": False}  # fmt: skip
    cases = [{"context_tokens": n, "remedies": {"seam:1": {"ttft_ms": {"full": 2.0 * n, "splice": 100.0}}}} for n in (600, 1200)]
    study = {"model": "tiny-qwen2:random", "summary": {"seam:1": row}, "choice": choose_remedy({"seam:1": row}).as_dict(), "cases": cases}
    (tmp_path / "compose_many-tiny-qwen2-cpu.json").write_text(json.dumps(study))
    monkeypatch.setattr(stored_results, "STUDY_RESULTS", tmp_path)
    view = run_compose(registry, Composition(["account_gate"], after="", remedy="seam:1"))
    tokens = view.summary["context_tokens"]  # full 2 ms a token against a splice of 100 ms: L / 50
    words = view.speed_markdown.replace("\\", "")  # as the page shows it (Markdown's escapes gone)
    assert "the menu's number was measured on 600–1,200-token contexts" in words
    assert f"predict ×{tokens / 50:.2f} for seam:1 at {tokens:,} context tokens" in words and "an extrapolation" in words
