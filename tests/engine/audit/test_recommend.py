"""The recommendation's bars: the user's thresholds, widened to the noise floor the exact reference shows."""

from engine.audit.audit import Bars, recommend
from engine.audit.repairs import Fidelity, RepairResult


def _result(name: str, computed: int, kl: float, agreement: float, top1: bool = True) -> RepairResult:
    return RepairResult(name, True, 100 - computed, computed, float(computed), Fidelity(kl, top1, 1.0, agreement, 0))


def test_the_cheapest_repair_within_the_bars_wins_and_a_cheaper_one_outside_loses():
    results = {
        "recompute": _result("recompute", 90, 0.0, 1.0),
        "in_place": _result("in_place", 5, 0.5, 1.0),  # cheapest, but KL past the 0.05 bar
        "coarsen": _result("coarsen", 20, 0.01, 0.95),  # within
        "erratum": _result("erratum", 10, 0.001, 0.5),  # KL fine, agreement below 0.9
        "hoist": _result("hoist", 8, 0.001, 1.0, top1=False),  # top token differs
    }
    chosen = recommend(results, threshold=0.05, min_agreement=0.9)
    assert chosen.repair == "coarsen" and "computes 20 of 100 tokens (20.0%)" in chosen.reason
    assert "≤ 0.05" in chosen.reason and "(≥ 90%)" in chosen.reason and "recompute would compute 90 (70 more)" in chosen.reason


def test_a_noisy_reference_widens_the_bars_and_says_so():
    """In bfloat16 the prefix-cached recompute agrees with the clean prefill on 66% of its greedy tokens: a repair at
    that floor passes, and the text states the floor instead of claiming the 90% the reference itself misses."""
    results = {"recompute": _result("recompute", 90, 0.002, 0.66), "in_place": _result("in_place", 5, 0.004, 0.70)}
    bars = Bars.of(results, threshold=0.001, min_agreement=0.9)
    assert bars.kl == 0.002 and bars.min_agreement == 0.66
    chosen = recommend(results, threshold=0.001, min_agreement=0.9)
    assert chosen.repair == "recompute"  # KL 0.004 is past even the widened bar 0.002
    assert "noise floor (recompute vs the clean prefill): KL 0.002, 66% agreeing" in chosen.reason
    assert "≥ 66% agreeing instead of 90%" in chosen.reason and "(≥ 90%)" not in chosen.reason
    results["in_place"] = _result("in_place", 5, 0.0015, 0.70)
    assert recommend(results, threshold=0.001, min_agreement=0.9).repair == "in_place"


def test_bars_are_the_users_own_where_the_reference_holds_them():
    results = {"recompute": _result("recompute", 90, 1e-7, 1.0), "in_place": _result("in_place", 5, 0.2, 1.0)}
    bars = Bars.of(results, threshold=0.1, min_agreement=0.9)
    assert (bars.kl, bars.min_agreement) == (0.1, 0.9)
    chosen = recommend(results, threshold=0.1, min_agreement=0.9)
    assert chosen.repair == "recompute" and "judged against it" not in chosen.reason and "in_place KL 0.2" in chosen.reason
