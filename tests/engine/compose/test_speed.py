"""A stored study's speed-ups against the context length: power laws fitted to its points, read at another length."""

import json
from pathlib import Path

import pytest

from kvscope.engine.compose.calibration import model_remedies
from kvscope.engine.compose.speed import PowerLaw, speedup_fits

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "studies" / "results"


def _case(tokens: int, full: float, splice: float) -> dict:
    return {"context_tokens": tokens, "remedies": {"splice": {"ttft_ms": {"full": full, "splice": splice}}}}


def test_a_power_law_is_recovered_exactly_from_its_own_points():
    law = PowerLaw.fit([100, 400, 1600], [3 * n**1.5 for n in (100, 400, 1600)])
    assert law.exponent == pytest.approx(1.5, abs=1e-9) and law.scale == pytest.approx(3.0, rel=1e-9)


def test_the_fit_predicts_the_ratio_of_both_sides_at_another_length():
    # full recompute O(L) at 2 ms a token, splice constant 50 ms: at L tokens the speed-up is L / 25
    cases = [_case(n, 2.0 * n, 50.0) for n in (500, 1000, 2000)]
    (fit,) = speedup_fits(cases).values()
    assert fit.at(250) == pytest.approx(10.0, rel=1e-9) and fit.at(4000) == pytest.approx(160.0, rel=1e-9)
    assert (fit.shortest, fit.longest, fit.points) == (500, 2000, 3) and fit.plausible
    assert fit.measured_words() == "500–2,000-token contexts"
    words = fit.words(250)
    assert "predict ×10.00 for splice at 250 context tokens" in words and "L^1.00" in words and "extrapolation" in words
    assert "extrapolation" not in fit.words(1000)


def test_points_that_do_not_grow_as_prefills_do_predict_nothing():
    (fit,) = speedup_fits([_case(n, 1000.0 / n, 50.0) for n in (500, 1000)]).values()  # full time shrinking with L: noise
    assert not fit.plausible and "predict nothing at 300 tokens" in fit.words(300)
    assert speedup_fits([_case(500, 900.0, 50.0), _case(500, 1000.0, 60.0)]) == {}  # one length: no fit


def test_the_embedded_models_menu_says_where_its_speed_ups_were_measured_and_what_a_short_context_predicts():
    model = json.loads((RESULTS / "compose_many-embedded-cpu.json").read_text())["model"]
    menu = model_remedies(model, RESULTS)
    assert menu.default == "prefix+seam:16" and menu.source == "compose_many-embedded-cpu"
    assert menu.measured_at("prefix+seam:16") == "451–1,711-token contexts"
    # the study's median ×4.16 holds over its 451–1,711 tokens; at 410 tokens its points predict about half of that
    predicted = menu.speed["prefix+seam:16"].at(410)
    assert 1.5 < predicted < menu.choice.point("prefix+seam:16").speedup
    assert f"×{predicted:.2f} for prefix+seam:16 at 410 context tokens" in menu.predicted("prefix+seam:16", 410)
