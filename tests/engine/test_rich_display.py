"""Jupyter's rich display of what a researcher holds: an edit report (headline and a card per strategy), a
composition's fidelity, a support-matrix row. The HTML carries the numbers and escapes every user-derived string."""

import html
from dataclasses import replace

import pytest

from kvscope.engine.cache import display
from kvscope.engine.checks.support import SupportRow, Verdict
from kvscope.engine.compose.fidelity import compare
from kvscope.engine.compose.remedy import Remedy
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.scenario import Scenario, bundled_scenarios
from tests.shared import SAME_LENGTH_SCENARIO


@pytest.fixture(scope="module")
def report(lm):
    """Values of one token each, so that every strategy applies."""
    return EditExperiment(lm, Scenario.from_toml(SAME_LENGTH_SCENARIO)).report(["field_only", "erratum", "field_erratum"])


def test_an_edit_report_shows_its_headline_and_a_card_per_strategy(report):
    page = report._repr_html_()
    assert html.escape(report.notes.headline()) in page
    for name, result in {"stale": report.stale, "oracle": report.oracle, **report.strategies}.items():
        assert f"<b>{name}</b>" in page and f"{result.decision.margin:+.4f}" in page
        assert f">{result.tokens_recomputed}<" in page
    field_only = report.strategies["field_only"].recovery
    assert display.number(field_only.value, 3) in page and "tokens recomputed" in page and "recovery" in page
    assert field_only.value is not None or html.escape(field_only.reason) in page  # a recovery too small to measure says why
    assert f"{report.context_tokens} context tokens" in page
    odd = replace(report, new="<b>true</b>", scenario="<script>x</script>")._repr_html_()
    assert "&lt;b&gt;true&lt;/b&gt;" in odd and "<script>" not in odd and "&lt;script&gt;" in odd


def test_a_not_applicable_strategy_shows_its_reason(report):
    field_only = report.strategies["field_only"]
    refused = replace(field_only, applicable=False, decision=None, recovery=None, reason="field <b> changes length")
    page = replace(report, strategies={"field_only": refused})._repr_html_()
    assert "not applicable: field &lt;b&gt; changes length" in page


def test_a_fidelity_shows_agreement_decisions_and_both_times_to_first_token(lm, store):
    fidelity = compare(lm, Scenario.load(bundled_scenarios()["keystone_safety"]), store, remedy=Remedy(seam=1))
    page = fidelity._repr_html_()
    for key in ("cosine", "kl"):
        assert f"{fidelity.agreement[key]:.6f}" in page
    assert "top-1" in page and "TTFT" in page and f"{fidelity.ttft_ms['splice']:.1f}" in page and f"{fidelity.ttft_ms['full']:.1f}" in page
    assert f"{fidelity.spliced.margin:+.4f}" in page and f"{fidelity.recomputed.margin:+.4f}" in page
    assert "seam:1" in page and "safety_gate" in page and f">{fidelity.recomputed_tokens}<" in page
    agreement = {True: "agree", False: "disagree", None: "tie"}[fidelity.decision_agree]
    assert agreement in page
    odd = replace(fidelity, scenario="<b>composed</b>", skills=["<i>skill</i>"])._repr_html_()
    assert "&lt;b&gt;composed&lt;/b&gt;" in odd and "&lt;i&gt;skill&lt;/i&gt;" in odd and "<i>" not in odd


def test_a_support_row_shows_each_operations_verdict():
    row = SupportRow(
        model="tiny-<b>",
        family="Family <b>",
        model_type="llama",
        dtype="float32",
        verdicts=(
            Verdict("read", True, 8e-07),
            Verdict("patch", True, 0.0),
            Verdict("move keys", False, reason="no rotary <b>embedding</b>"),
            Verdict("images", False, applicable=False),
        ),
        ms=12.0,
    )
    page = row._repr_html_()
    assert "✓ 8e-07" in page and "✓ 0" in page and "refused" in page and "–" in page
    assert "no rotary &lt;b&gt;embedding&lt;/b&gt;" in page and "tiny-&lt;b&gt;" in page and "Family &lt;b&gt;" in page
    assert "<b>embedding" not in page
    for operation in ("read", "patch", "move keys", "images"):
        assert f">{operation}<" in page
