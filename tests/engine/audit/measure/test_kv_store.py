"""The audit's model pass does only the work it needs (kvscope.engine.audit.measure.kv_store): on a hand-made 3-request log, the tokens
the model's forwards run equal the distinct work counted here from the token ids, greedy tokens are generated once per
distinct prompt, the results equal the old path's (every state prefilled from scratch with plain Notebook calls), and
attention runs through SDPA (no eager attention: nothing reads attentions)."""

import json

import pytest
import torch

from kvscope.engine.audit.logs.reading import parse_log
from kvscope.engine.audit.measure.kv_store import ComputedStates, Reference
from kvscope.engine.audit.measure.repairs import fidelity
from kvscope.engine.audit.measure.settings import measure_settings
from kvscope.engine.audit.measure.turn import audit_requests
from kvscope.engine.cache import adapter
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.models.tiny import tiny_model

SYSTEM = "You are the help desk of Northwind.\nSession started: {time}\nAccount tier: gold\nBe brief and exact."
TOKENS = 3
REPAIRS = ["recompute", "field_only", "erratum"]


def _chat(time, *turns):
    return json.dumps(
        {"messages": [{"role": "system", "content": SYSTEM.format(time=time)}, *[{"role": r, "content": c} for r, c in turns]]}
    )


LOG = "\n".join(
    [
        _chat("2026-05-12 09:41", ("user", "Where is my parcel?")),
        _chat("2026-05-12 09:42", ("user", "Where is my parcel?")),  # the clock changed
        _chat("2026-05-12 09:42", ("user", "Where is my parcel?"), ("assistant", "On its way."), ("user", "When?")),  # growth
    ]
)


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


def _prefix(a, b):
    count = 0
    while count < min(len(a), len(b)) and a[count] == b[count]:
        count += 1
    return count


class _Counted:
    """Tokens run by the model's forwards outside greedy decoding, forwards inside it, and greedy runs (patched for
    one audit)."""

    def __init__(self, lm, monkeypatch):
        self.tokens, self.decode_forwards, self.greedy, self._decoding = 0, 0, 0, False
        forward, greedy = lm.model.forward, Notebook.greedy

        def counted(*args, **kwargs):
            ids = kwargs.get("input_ids")
            if self._decoding:
                self.decode_forwards += 1
            else:
                self.tokens += int(ids.shape[1]) if ids is not None else int(kwargs["inputs_embeds"].shape[1])
            return forward(*args, **kwargs)

        def counted_greedy(*args, **kwargs):
            self.greedy, self._decoding = self.greedy + 1, True
            try:
                return greedy(*args, **kwargs)
            finally:
                self._decoding = False

        monkeypatch.setattr(lm.model, "forward", counted)
        monkeypatch.setattr(Notebook, "greedy", counted_greedy)


def _steps(generated) -> int:
    """Decode forwards behind ``generated``: the last greedy token is appended, not run (unless a stop id ended it)."""
    return len(generated) - (len(generated) == TOKENS)


def test_the_forwards_run_the_distinct_work_and_greedy_runs_once_per_distinct_prompt(lm, monkeypatch):
    counted = _Counted(lm, monkeypatch)
    report = audit_requests(lm, parse_log(LOG), measure=measure_settings(repairs=REPAIRS, tokens=TOKENS))
    r1, r2, r3 = (rendered.ids for rendered in report.rendered)
    first, second = report.turns[1].repairs, report.turns[2].repairs
    erratum = first["erratum"].prompt_ids
    assert not second["field_only"].applicable and not second["erratum"].applicable  # growth only: nothing to repair
    # r1 cold; each newer request from the older one's shared prefix (recompute reads the same state: nothing more);
    # field_only: its field's tokens and the rest over the edited cache; the erratum prompt from r1's shared prefix
    prompts = len(r1) + (len(r2) - _prefix(r1, r2)) + (len(r3) - _prefix(r2, r3)) + (len(erratum) - _prefix(r1, erratum))
    prompts += first["field_only"].computed_tokens
    assert first["field_only"].computed_tokens == len(r2) - first["field_only"].reused_tokens
    readings = [first["recompute"], first["field_only"], first["erratum"], second["recompute"]]
    assert counted.tokens == prompts
    assert counted.greedy == 4  # r2 (recompute is its reading), field_only's own cache, the erratum prompt, r3
    # a repair's greedy tokens check the clean reading's as a draft: at most a forward a token, fewer where they agree
    assert counted.decode_forwards <= sum(_steps(result.generated) for result in readings)
    # the old path computed every request from scratch per turn, and the reference apart from recompute
    assert counted.tokens < 2 * (len(r1) + len(r2) + len(r3))


def _old_read(prefix: Notebook, rest, tokens: int) -> Reference:
    """The path before the store: ``rest`` run after ``prefix``, then its own greedy tokens."""
    context = prefix.append(list(rest[:-1]), "request") if len(rest) > 1 else prefix
    state, logits = context.step([rest[-1]], "request")
    _, generated = state.greedy(logits, tokens, prefix.lm.stop_ids)
    return Reference(torch.log_softmax(logits.float(), -1), tuple(generated), 0.0, state)


def test_the_results_equal_the_old_paths_computed_from_scratch(lm):
    report = audit_requests(lm, parse_log(LOG), measure=measure_settings(repairs=REPAIRS, tokens=TOKENS))
    old, new = report.rendered[0].ids, report.rendered[1].ids
    turn = report.turns[1]
    clean = _old_read(Notebook.empty(lm), new, TOKENS)  # the clean prefill, from scratch
    cached = Notebook.prefill(lm, list(old), "request").materialized()
    keep = min(_prefix(old, new), len(new) - 1)
    recompute = _old_read(cached.prefix(keep), new[keep:], TOKENS)
    (change,) = turn.fields
    edited = cached.prefix(len(old) - 1).replace(range(change.old_start, change.old_end), list(new[change.start : change.end]))
    field_only = _old_read(edited, new[len(old) - 1 :], TOKENS)
    erratum_ids = turn.repairs["erratum"].prompt_ids
    shared = min(_prefix(old, erratum_ids), len(erratum_ids) - 1)
    erratum = _old_read(Notebook.prefill(lm, list(old[:shared]), "request").materialized(), erratum_ids[shared:], TOKENS)
    for name, state in (("recompute", recompute), ("field_only", field_only), ("erratum", erratum)):
        want, got = fidelity(state.logprobs, state.generated, clean), turn.repairs[name].fidelity
        assert got.kl == pytest.approx(want.kl, abs=1e-5), name
        assert (got.top1_agree, got.top5_overlap, got.generation_agreement) == (
            want.top1_agree,
            want.top5_overlap,
            want.generation_agreement,
        )
        assert turn.repairs[name].generated == state.generated, name
    assert turn.repairs["recompute"].fidelity.kl == 0.0  # the reference is recompute's own state


def test_a_repair_reading_a_prompt_with_other_reuse_runs_its_forward_for_its_own_time_and_keeps_the_greedy_tokens(lm, monkeypatch):
    ids = tuple(lm.tokenizer("one two three four five six seven", add_special_tokens=False).input_ids)
    store = ComputedStates(lm, TOKENS)
    cold = store.read_prompt(ids)
    counted = _Counted(lm, monkeypatch)
    assert store.read_prompt(ids) is cold and counted.tokens == 0  # the same prompt, the same reuse: that reading
    again = store.read(cold.notebook.prefix(3), ids[3:], ids)
    assert counted.tokens == len(ids) - 3 and counted.greedy == 0 and again.reused_tokens == 3
    assert again.generated == cold.generated and torch.allclose(again.logprobs, cold.logprobs, atol=1e-5)
    assert again.ttft_ms > 0


def test_the_store_drops_the_least_recently_used_states_past_its_byte_budget(lm):
    words = ["alpha beta gamma", "delta epsilon zeta", "eta theta iota"]
    prompts = [tuple(lm.tokenizer(text, add_special_tokens=False).input_ids) for text in words]
    one = ComputedStates(lm, TOKENS).state(prompts[0]).memory_bytes()
    store = ComputedStates(lm, TOKENS, budget_bytes=2 * one + one // 2)  # room for two states of this size
    for ids in prompts:
        store.state(ids)
    assert list(store._stored) == prompts[1:]


def test_the_audit_runs_no_eager_attention(lm, monkeypatch):
    def refused(module):
        raise AssertionError("eager attention ran, though nothing reads attentions")

    monkeypatch.setattr(adapter, "_eager_for", refused)
    report = audit_requests(lm, parse_log(LOG), measure=measure_settings(repairs=REPAIRS, tokens=TOKENS))
    assert report.turns[1].repairs["recompute"].applicable and lm.model.config._kvscope_use_sdpa
