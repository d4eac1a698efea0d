"""The pre-check (Open in Notes) says a change moves the answer against the same bar as the Notes tab's edit: the
recovery gap in the model's dtype (``recovery_gap``: the settings' bar plus the dtype's noise floor)."""

import torch

from kvscope.engine.audit.measure.notes_scenario import Continuation, NotesScenario
from kvscope.engine.cache.decision import RECOVERY_MIN_GAP, Decision, recovery_gap


def _precheck(old: float, new: float, gap: float) -> NotesScenario:
    def side(value: str, margin: float) -> Continuation:
        scores = {"CALL": margin - 1.0, "Yes": -1.0}
        return Continuation(value, "", Decision(scores, {}, margin, "CALL" if margin > 0 else "Yes", torch.zeros(1)))

    return NotesScenario("", "account_tier", ("CALL", "Yes"), "alternatives", None, 0.0, side("standard", old), side("plus", new), gap)


def test_a_change_within_bfloat16s_noise_does_not_move_and_one_beyond_it_does():
    # issue 64's account_tier change: +0.31 in bfloat16, +0.08 in float32; both say there is nothing to recover
    bf16, fp32 = recovery_gap("bfloat16"), recovery_gap("float32")
    assert fp32 == RECOVERY_MIN_GAP and bf16 > fp32
    assert not _precheck(0.3169, 0.6227, bf16).moves and not _precheck(0.087, 0.167, fp32).moves
    assert "less than 0.40" in _precheck(0.3169, 0.6227, bf16).words()
    assert _precheck(0.3, 0.3 + bf16 + 0.01, bf16).moves and _precheck(0.0, 0.3, fp32).moves
