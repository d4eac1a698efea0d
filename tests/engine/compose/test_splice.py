"""Composition: splice vs prefill ground truth, skill files, the store, keystone, memory."""

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from kvscope.engine import timing
from kvscope.engine.cache.notebook import Notebook, NotebookError
from kvscope.engine.compose import fidelity as fidelity_module
from kvscope.engine.compose.fidelity import compare
from kvscope.engine.compose.keystone import keystone
from kvscope.engine.compose.memory import memory_placement
from kvscope.engine.compose.placing import adhoc_scenario, with_skills
from kvscope.engine.compose.remedy import Remedy, split_remedies
from kvscope.engine.compose.skills import (
    SkillFileError,
    SkillStore,
    compile_skill,
    load_block,
    save_block,
)
from kvscope.engine.compose.splice import splice_prompt, top_of
from kvscope.engine.errors import KVScopeError
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.scenario import (
    Scenario,
    ScenarioError,
    Skill,
    bundled_scenarios,
    bundled_skills,
    render,
)

SHORT = ["account_gate", "user_memory"]  # short enough for tiny models' 4k positions


def test_bundled_skill_library_is_complete():
    skills = {skill_id: Skill.load(path) for skill_id, path in bundled_skills().items()}
    assert len(skills) >= 6
    assert any(skill.fields for skill in skills.values())


def test_full_seam_splice_equals_prefill_in_both_orders(lm, store):
    for order in (SHORT, SHORT[::-1]):
        fidelity = compare(lm, adhoc_scenario(order), store, remedy=Remedy(seam=10_000))
        assert fidelity.agreement["cosine"] == pytest.approx(1.0, abs=1e-6)
        assert fidelity.agreement["kl"] == pytest.approx(0.0, abs=1e-6)
        assert float(fidelity.deviation.max()) < 1e-4


def test_first_skill_at_its_original_position_is_exact_without_seam(lm, store):
    scenario = adhoc_scenario(SHORT[:1])
    prompt = render(scenario, lm.tokenizer)
    spliced = splice_prompt(lm, scenario, prompt, store, Remedy()).notebook
    reference = Notebook.from_prompt(lm, prompt)
    assert torch.allclose(spliced.read_prompt(prompt).next_token_logits, reference.read_prompt(prompt).next_token_logits, atol=1e-5)


def test_spliced_second_skill_keys_equal_keys_prefilled_at_the_target(lm, store):
    """Re-rotated keys equal keys of the same canonical prefill shifted to the target position."""
    scenario = adhoc_scenario(SHORT)
    prompt = render(scenario, lm.tokenizer)
    spliced = splice_prompt(lm, scenario, prompt, store, Remedy()).notebook
    second = scenario.skills[SHORT[1]]
    block = compile_skill(lm, second)
    target = prompt.skill_spans[SHORT[1]].start
    canonical = Notebook.prefill(
        lm, list(prompt.context_ids[: block.start_position]) + block.token_ids.tolist(), start_position=target - block.start_position
    )
    expected = canonical.block(positions=range(target, target + len(block)))
    got = spliced.block(positions=range(target, target + len(block)))
    for mine, theirs in zip(got.keys + got.values, expected.keys + expected.values):
        error = float((mine - theirs).abs().max()) / float(theirs.abs().max())
        assert error < 1e-5, error


def test_seam_repair_never_hurts_much_and_whole_selections_equal_prefill(lm, store):
    """seam:4 recomputes each skill's first 4 tokens against the real prefix. The first skill sits where it was
    compiled (exact), so the second skill's seam tokens come out as a full prefill computes them, its later tokens
    stay exactly as spliced, and the next token moves no further from the full recompute than the plain splice's."""
    scenario = adhoc_scenario(SHORT)
    plain, seam, whole = (compare(lm, scenario, store, remedy=Remedy(seam=tokens)) for tokens in (0, 4, 10_000))
    assert whole.agreement["cosine"] == pytest.approx(1.0, abs=1e-6) and plain.agreement["cosine"] < 1.0
    second = render(scenario, lm.tokenizer).skill_spans[SHORT[1]]
    seam_tokens, after = slice(second.start, second.start + 4), slice(second.start + 4, second.end)
    assert seam.recomputed_tokens == 4 * len(SHORT) and plain.recomputed_tokens == 0
    assert float(seam.deviation[:, seam_tokens].max()) < 1e-4 and float(plain.deviation[:, seam_tokens].amax(0).min()) > 0.1
    assert torch.allclose(seam.deviation[:, after], plain.deviation[:, after], atol=1e-6)
    assert seam.agreement["cosine"] >= plain.agreement["cosine"] - 1e-3 and seam.agreement["kl"] <= plain.agreement["kl"] + 1e-3
    for select in ("blend", "query", "deviation", "causal"):
        whole = compare(lm, scenario, store, remedy=Remedy(select=select, fraction=1.0))
        assert whole.recomputed_tokens == whole.skill_tokens and whole.agreement["cosine"] == pytest.approx(1.0, abs=1e-6)
        assert float(whole.deviation.max()) < 1e-4


def test_speedup_is_the_ratio_of_the_two_sides_timed_in_the_same_call(lm, store, monkeypatch):
    """With the clock stubbed, each full recompute costs 30 ms and each splice 12 ms: the ratio is exactly 2.5, and the
    warm-up round and the skills' compilation are not in it."""
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def costing(function, seconds):
        def run(*args, **kwargs):
            clock[0] += seconds
            return function(*args, **kwargs)

        return run

    monkeypatch.setattr(fidelity_module.Notebook, "from_prompt", staticmethod(costing(fidelity_module.Notebook.from_prompt, 0.030)))
    monkeypatch.setattr(fidelity_module, "splice_prompt", costing(fidelity_module.splice_prompt, 0.012))
    fidelity = compare(lm, adhoc_scenario(["account_gate"]), SkillStore(), remedy=Remedy(seam=1), reps=3, warmup=1)
    assert fidelity.ttft["full"].median == pytest.approx(30.0) and fidelity.ttft["splice"].median == pytest.approx(12.0)
    assert fidelity.ttft["full"].reps == fidelity.ttft["splice"].reps == 3
    assert fidelity.speedup == pytest.approx(2.5) and fidelity.as_dict()["speedup"] == 2.5
    assert not fidelity.reference_reused


def test_side_by_side_alternates_after_the_warm_up():
    calls = []
    results, spreads = timing.side_by_side({"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}, reps=2, warmup=1)
    assert calls == ["a", "b"] * 3 and results == {"a": 1, "b": 2} and spreads["a"].reps == spreads["b"].reps == 2


def test_recomputed_side_is_reused_for_the_same_prompt_only(lm, store):
    references = {}
    first = compare(lm, adhoc_scenario(["account_gate"]), store, remedy=Remedy(), references=references)
    again = compare(lm, adhoc_scenario(["account_gate"]), store, remedy=Remedy(seam=4), references=references)
    fresh = compare(lm, adhoc_scenario(["account_gate"]), store, remedy=Remedy(seam=4))
    other = compare(lm, adhoc_scenario(["tone_guide"]), store, remedy=Remedy(), references=references)
    assert not first.reference_reused and again.reference_reused and not other.reference_reused and len(references) == 2
    assert again.ttft_ms["full"] == first.ttft_ms["full"] and again.recomputed is first.recomputed
    assert again.agreement["cosine"] == pytest.approx(fresh.agreement["cosine"], abs=1e-6)
    assert again.spliced.margin == pytest.approx(fresh.spliced.margin, abs=1e-5)


def test_stored_skill_round_trip_is_bit_exact(lm, tmp_path):
    block = compile_skill(lm, Skill.load(bundled_skills()["account_gate"]))
    path = save_block(block, tmp_path / "gate.safetensors", "account_gate")
    loaded = load_block(path, lm)
    assert torch.equal(loaded.token_ids, block.token_ids) and loaded.segments == block.segments
    assert all(torch.equal(a, b) for a, b in zip(loaded.keys + loaded.values, block.keys + block.values))


def test_stored_skill_refusals(lm, tmp_path):
    block = compile_skill(lm, Skill.load(bundled_skills()["account_gate"]))
    path = save_block(block, tmp_path / "gate.safetensors", "account_gate")
    with pytest.raises(SkillFileError, match="compiled by tiny-qwen2"):
        load_block(path, tiny_model("qwen2", seed=1))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip a byte inside the last tensor
    tampered = tmp_path / "tampered.safetensors"
    tampered.write_bytes(bytes(data))
    with pytest.raises(SkillFileError, match="do not match their recorded sha256"):
        load_block(tampered, lm)
    meta = json.loads(__import__("safetensors").safe_open(str(path), framework="pt").metadata()["kvscope"])
    wrong = {f"{kind}.{i}": torch.zeros(2, 3, 16) for kind in ("keys", "values") for i in range(3)}
    from kvscope.engine.compose.skills import _tensor_digest

    meta["sha256"] = _tensor_digest(wrong)
    save_file(wrong, str(tmp_path / "shape.safetensors"), metadata={"kvscope": json.dumps(meta)})
    with pytest.raises(SkillFileError, match="has shape"):
        load_block(tmp_path / "shape.safetensors", lm)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(SkillFileError, match="not a KVScope skill file"):
        load_block(tmp_path / "junk.safetensors", lm)


def test_store_compiles_once_uses_disk_and_respects_budget(lm, tmp_path):
    gate, memory = (Skill.load(bundled_skills()[s]) for s in SHORT)
    store = SkillStore(tmp_path)
    first = store.get(lm, gate)
    assert store.get(lm, gate) is first and store.compiled == 1
    assert len(list(tmp_path.glob("account_gate-*.safetensors"))) == 1
    fresh = SkillStore(tmp_path)
    assert torch.equal(fresh.get(lm, gate).keys[0], first.keys[0]) and fresh.compiled == 0
    tight = SkillStore(budget_bytes=first.memory_bytes())
    tight.get(lm, gate)
    tight.get(lm, memory)
    assert tight.memory_bytes() <= max(first.memory_bytes(), compile_skill(lm, memory).memory_bytes())
    assert store.get(lm, gate, {"account_tier": "premium"}) is not first


def test_gpt2_splice_is_refused(store):
    with pytest.raises(NotebookError, match="no rotary"):
        compare(tiny_model("gpt2"), adhoc_scenario(SHORT[:1]), store)


def test_composition_errors():
    with pytest.raises(ScenarioError, match="unknown skill 'nope'"):
        adhoc_scenario(["nope"])
    with pytest.raises(ScenarioError, match="start, after_fields, end"):
        with_skills(Scenario.load(bundled_scenarios()["refund_gate"]), SHORT, "middle")
    with pytest.raises(ScenarioError, match="unknown skill"):
        Scenario.from_toml('name="x"\ncontext="{skill:missing}"\nquestion="q"\n[answers]\na="a"\nb="b"\n')


def test_keystone_recomputed_side_matches_plain_edit(lm, store):
    report = keystone(lm, adhoc_scenario(SHORT[:1]), store, remedy=Remedy(seam=1), strategies=("erratum", "full_downstream"))
    data = report.as_dict()
    assert data["strategies"]["full_downstream"]["recomputed"]["margin"] == pytest.approx(data["oracle_margin"], abs=1e-4)
    erratum = data["strategies"]["erratum"]  # the skill sits at its source position: composed equals recomputed
    assert erratum["composed"]["margin"] == pytest.approx(erratum["recomputed"]["margin"], abs=1e-3) and erratum["same_label"]
    with pytest.raises(ScenarioError, match="not inside any skill"):
        keystone(lm, Scenario.load(bundled_scenarios()["refund_gate"]), store)


def test_memory_placement_reports_both_layouts(lm, store):
    result = memory_placement(lm, Scenario.load(bundled_scenarios()["memory_contact"]), store).as_dict()
    start, end = result["placements"]["start"], result["placements"]["end"]
    assert end["edit"]["full_downstream"]["tokens_recomputed"] < start["edit"]["full_downstream"]["tokens_recomputed"]
    assert start["edit"]["full_downstream"]["margin"] == pytest.approx(start["oracle_margin"], abs=1e-4)
    assert 0 < end["transplant"]["cosine"] <= 1.0 + 1e-6


def test_composer_text_is_literal_even_when_it_names_a_skill():
    from kvscope.engine.compose.placing import compose_scenario
    from kvscope.engine.models.tiny import tiny_model
    from kvscope.engine.scenario import render

    tokenizer = tiny_model("qwen2").tokenizer
    plain = render(compose_scenario(["account_gate"]), tokenizer)
    named = compose_scenario(["account_gate"], before="see {skill:account_gate} and {skill:tone_guide}", between="{x}")
    assert list(named.skills) == ["account_gate"]
    prompt = render(named, tokenizer)
    text = tokenizer.decode(prompt.context_ids)
    assert "see {skill:account_gate} and {skill:tone_guide}" in text
    assert text.count(tokenizer.decode(plain.context_ids[-20:])) == 1, "the skill's text is placed once"
    assert len(prompt.context_ids) < 2 * len(plain.context_ids)


def test_remedy_specs_round_trip_and_refuse_nonsense():
    for text in ("splice", "seam:1", "prefix+seam:4", "seam:1+aggregators", "seam:1+blend:0.3", "prefix+deviation:0.15", "causal:0.3"):
        assert Remedy.parse(Remedy.parse(text).name) == Remedy.parse(text)
    assert Remedy.parse("prefix+seam:2") == Remedy(seam=2, prefix=True) and Remedy.parse("causal:0.3").needs_reference
    assert not Remedy.parse("blend:0.3").needs_reference and Remedy.parse("blend:0.3").require_deployable("the keystone")
    for bad, match in (
        ("seam:x", "'seam:x' not understood"),
        ("mix:0.2", "'mix:0.2' not understood"),
        ("seam:-1", "seam must be ≥ 0"),
        ("blend", "'blend' not understood.*blend:0.3"),
        ("deviation:0", r"fraction within \(0, 1\]"),
        ("deviation:1.5", r"fraction within \(0, 1\]"),
    ):
        with pytest.raises(ScenarioError, match=match):
            Remedy.parse(bad)
    with pytest.raises(ScenarioError, match="only applies to the ranked"):
        Remedy(select="aggregators", fraction=0.2)
    with pytest.raises(ScenarioError, match="the keystone needs a deployable one"):
        Remedy.parse("deviation:0.2").require_deployable("the keystone")
    with pytest.raises(ScenarioError, match="'auto' is this model's calibrated choice"):
        Remedy.parse("auto")
    assert Remedy.parse("prefix+seam:1+query:0.05") == Remedy(seam=1, prefix=True, select="query", fraction=0.05)
    assert not Remedy.parse("query:0.05").needs_reference
    assert Remedy.parse("prefix+seam:1+tail:8+query:0.05").name == "prefix+seam:1+tail:8+query:0.05"
    with pytest.raises(ScenarioError, match="tail must be ≥ 0"):
        Remedy.parse("tail:-2")
    assert Remedy.parse("prefix+seam:1+blend:0.3+cover:0.5").name == "prefix+seam:1+blend:0.3+cover:0.5"
    for bad in ("cover:0.5", "deviation:0.3+cover:0.5", "blend:0.3+cover:1.5"):
        with pytest.raises(ScenarioError, match="needs blend:F or query:F"):
            Remedy.parse(bad)


def test_an_adaptive_budget_stops_once_the_share_of_the_ranking_is_covered():
    scores = {10: 5.0, 11: 3.0, 12: 1.0, 13: 1.0}  # total 10
    assert top_of(scores, 4) == {10, 11, 12, 13} and top_of(scores, 2) == {10, 11}
    assert top_of(scores, 4, cover=0.5) == {10} and top_of(scores, 4, cover=0.51) == {10, 11}
    assert top_of(scores, 1, cover=0.9) == {10}  # the fraction still caps it


def test_blend_with_cover_recomputes_at_most_its_fraction_and_fewer_when_the_deviation_is_concentrated(lm, store):
    scenario = adhoc_scenario(SHORT)
    capped = compare(lm, scenario, store, remedy=Remedy.parse("seam:1+blend:0.5"))
    covered = compare(lm, scenario, store, remedy=Remedy.parse("seam:1+blend:0.5+cover:0.3"))
    assert 2 <= covered.recomputed_tokens < capped.recomputed_tokens


def test_tail_recomputes_each_skills_last_tokens_and_a_whole_tail_equals_prefill(lm, store):
    scenario = adhoc_scenario(SHORT)
    prompt = render(scenario, lm.tokenizer)
    built = splice_prompt(lm, scenario, prompt, store, Remedy(seam=1, tail=3))
    notebook = built.notebook.latest()
    spans = prompt.skill_spans.values()
    expected = {span.start for span in spans} | {p for span in spans for p in range(span.end - 3, span.end)}
    assert built.recomputed_tokens == len(expected) == 4 * len(SHORT)
    assert set(notebook.positions[~notebook.visible].tolist()) == expected
    whole = compare(lm, scenario, store, remedy=Remedy(seam=1, tail=10_000))
    assert whole.recomputed_tokens == whole.skill_tokens and whole.agreement["cosine"] == pytest.approx(1.0, abs=1e-6)


def test_query_selection_recomputes_the_skill_tokens_the_question_attends_to_most(lm, store):
    """The ranking, computed here from the question's attention over the plain splice: the chosen positions are the
    top of it, and recomputing them is what the remedy's notebook holds."""
    scenario = adhoc_scenario(SHORT)
    prompt = render(scenario, lm.tokenizer)
    plain = splice_prompt(lm, scenario, prompt, store, Remedy(seam=1)).notebook
    attention = plain.read_prompt(prompt, capture_attention=True).attention
    computed = plain.latest()
    mass = attention[..., : len(computed.positions)].sum(dim=(0, 1, 2))
    seams = {span.start for span in prompt.skill_spans.values()}
    candidates = {p for span in prompt.skill_spans.values() for p in range(span.start, span.end)} - seams
    by_position = {int(p): float(m) for p, m, shown in zip(computed.positions, mass, computed.visible) if shown and int(p) in candidates}
    count = round(0.1 * len(candidates))
    expected = sorted(by_position, key=lambda p: -by_position[p])[:count]
    built = splice_prompt(lm, scenario, prompt, store, Remedy(seam=1, select="query", fraction=0.1))
    notebook = built.notebook.latest()
    assert built.recomputed_tokens == count + len(seams)
    assert set(notebook.positions[~notebook.visible].tolist()) == seams | set(expected)  # the entries recomputed over
    assert abs(built.notebook.read_prompt(prompt).margin - plain.read_prompt(prompt).margin) > 1e-6


def test_prefix_compile_makes_a_skill_after_the_system_prompt_exact(lm, store):
    """Compiled after the target's own system prompt, a skill that opens the context equals a full prefill."""
    base = Scenario.load(bundled_scenarios()["refund_gate"])
    assert base.system
    scenario = with_skills(base, SHORT[:1], "start")
    plain = compare(lm, scenario, store, remedy=Remedy())
    prefixed = compare(lm, scenario, store, remedy=Remedy(prefix=True))
    assert prefixed.agreement["cosine"] == pytest.approx(1.0, abs=1e-6) and float(prefixed.deviation.max()) < 1e-4
    assert plain.agreement["cosine"] < 1.0 - 1e-6 and prefixed.recomputed_tokens == 0


def test_aggregator_selection_recomputes_exactly_the_skills_punctuation(lm, store):
    from kvscope.engine.scenario import is_aggregator

    scenario = adhoc_scenario(SHORT)
    prompt = render(scenario, lm.tokenizer)
    built = splice_prompt(lm, scenario, prompt, store, Remedy.parse("seam:2+aggregators"))
    skill_positions = [p for span in prompt.skill_spans.values() for p in range(span.start + 2, span.end)]
    expected = sum(is_aggregator(lm.tokenizer.decode([prompt.context_ids[p]])) for p in skill_positions) + 2 * len(SHORT)
    assert built.recomputed_tokens == expected and 0 < built.recomputed_tokens < 0.6 * built.skill_tokens
    assert built.skill_tokens == sum(len(span) for span in prompt.skill_spans.values())


def test_ranked_selection_needs_the_reference_and_keeps_its_budget(lm, store):
    scenario = adhoc_scenario(SHORT)
    prompt = render(scenario, lm.tokenizer)
    with pytest.raises(NotebookError, match="pass it as reference"):
        splice_prompt(lm, scenario, prompt, store, Remedy(select="deviation", fraction=0.2))
    reference = Notebook.from_prompt(lm, prompt).materialized()
    built = splice_prompt(lm, scenario, prompt, store, Remedy(select="causal", fraction=0.2), reference=reference)
    assert built.recomputed_tokens == round(0.2 * built.skill_tokens)


def test_layer_prefill_stops_with_the_keys_and_values_of_a_full_prefill(lm):
    ids = render(adhoc_scenario(SHORT), lm.tokenizer).context_ids
    full = Notebook.prefill(lm, ids)
    for layer in (0, 1):
        keys, values = Notebook.prefill_layer(lm, ids, layer)
        assert torch.allclose(keys, full.keys[layer], atol=1e-5) and torch.allclose(values, full.values[layer], atol=1e-5)
    with pytest.raises(KVScopeError, match="outside the model's"):
        Notebook.prefill_layer(lm, ids, 99)


def test_blend_recomputes_the_moved_skill_before_the_one_already_in_place(lm, store):
    """The first skill sits where it was compiled (no deviation at the check layer): CacheBlend's ranking,
    with a budget the size of the second skill, recomputes exactly the second one, without any reference."""
    scenario = adhoc_scenario(SHORT)
    prompt = render(scenario, lm.tokenizer)
    second = prompt.skill_spans[SHORT[1]]
    fraction = len(second) / sum(len(span) for span in prompt.skill_spans.values())
    built = splice_prompt(lm, scenario, prompt, store, Remedy(select="blend", fraction=fraction))
    assert built.recomputed_tokens == len(second)
    reference = Notebook.from_prompt(lm, prompt)
    assert built.notebook.read_prompt(prompt).next_token_logits.allclose(reference.read_prompt(prompt).next_token_logits, atol=1e-4)


def test_skills_placed_after_the_fields_sit_between_fields_and_rules():
    base = Scenario.load(bundled_scenarios()["refund_gate"])
    context = with_skills(base, SHORT, "after_fields").context
    assert (
        context.index("{refund_eligible}")
        < context.index("{skill:account_gate}")
        < context.index("{skill:user_memory}")
        < context.index("POLICY")
    )
    with pytest.raises(ScenarioError, match="no paragraph break"):
        with_skills(
            Scenario.from_toml('name="x"\ncontext="a {f}"\nquestion="q"\n[fields.f]\nold="1"\nnew="2"\n[answers]\na="a"\nb="b"\n'),
            SHORT,
            "after_fields",
        )
    with pytest.raises(ScenarioError, match="no field in its context"):
        with_skills(adhoc_scenario([]), SHORT, "after_fields")


def test_decision_match_counts_agreement_only_when_decisive():
    from kvscope.engine.cache.decision import DECISIVE_MARGIN, DecisionMatch

    def decision(margin):
        return type("D", (), {"margin": margin, "label": "a" if margin > 0 else "b"})()

    tie = DecisionMatch.of(decision(0.3), decision(-0.1))
    assert not tie.decisive and tie.agree is None and not tie.same_label and tie.margin_error == pytest.approx(0.4)
    assert DecisionMatch.of(decision(0.3), decision(-DECISIVE_MARGIN)).agree is False
    assert DecisionMatch.of(decision(-2.0), decision(-0.5)).agree is True


def test_keystone_on_a_moved_skill_reports_recovery_gaps(lm, store):
    scenario = Scenario.load(bundled_scenarios()["keystone_safety"])
    report = keystone(lm, scenario, store, remedy=Remedy.parse("prefix+seam:1+blend:0.3"), strategies=("field_only", "erratum"))
    data = report.as_dict()
    assert data["remedy"] == "prefix+seam:1+blend:0.3" and data["delta_margin"] == pytest.approx(report.delta_margin, abs=1e-4)
    gaps = report.recovery_gaps()
    assert set(gaps) >= {"field_only", "erratum"}
    defined = [abs(g) for g in gaps.values() if g is not None]
    assert data["max_recovery_gap"] == (pytest.approx(max(defined), abs=1e-4) if defined else None)
    with pytest.raises(ScenarioError, match="deployable"):
        keystone(lm, scenario, store, remedy=Remedy.parse("causal:0.2"))


def test_a_scenario_that_places_skills_stands_alone_in_the_composer():
    from kvscope.engine.compose.placing import compose_scenario

    keystone_demo = Scenario.load(bundled_scenarios()["keystone_safety"])
    alone = compose_scenario([], base=keystone_demo)
    assert list(alone.skills) == ["safety_gate"] and alone.context == keystone_demo.context and "safety_mode" in alone.fields
    with pytest.raises(ScenarioError, match="already placed by scenario"):
        compose_scenario(["safety_gate"], base=keystone_demo)
    with pytest.raises(ScenarioError, match="or choose a scenario that places skills"):
        compose_scenario([], base=Scenario.load(bundled_scenarios()["refund_gate"]))


def test_ape_specs_round_trip_split_as_lists_and_refuse_bad_settings():
    for text in ("ape:0.9,0.9", "prefix+ape:0.5,1.2", "prefix+seam:1+ape:0.9,0.9", "prefix+seam:1+blend:0.15+ape:1,1"):
        assert Remedy.parse(Remedy.parse(text).name) == Remedy.parse(text) and Remedy.parse(text).name == text
    ape = Remedy.parse("prefix+seam:1+ape:0.9,0.8")
    assert (ape.ape.temperature, ape.ape.scale) == (0.9, 0.8) and not ape.needs_reference and ape.require_deployable("the keystone")
    assert ape.as_dict()["ape"] == {"temperature": 0.9, "scale": 0.8}
    assert split_remedies("splice, prefix+seam:1+ape:0.9,0.9,ape:1,1.2,blend:0.3") == [
        "splice",
        "prefix+seam:1+ape:0.9,0.9",
        "ape:1,1.2",
        "blend:0.3",
    ]
    for bad, match in (
        ("ape:0,0.9", "'ape:0,0.9': APE's temperature T must be a finite number > 0"),
        ("ape:0.9,-1", "'ape:0.9,-1': APE's scale S must be a finite number > 0"),
        ("ape:inf,1", "temperature T must be a finite number"),
        ("ape:0.9", "'ape:0.9': ape needs a temperature and a scale"),
        ("ape", "ape needs a temperature and a scale"),
        ("ape:0.9,0.9,1", "ape needs a temperature and a scale"),
        ("ape:x,0.9", "'ape:x,0.9': ape's temperature and scale must be numbers"),
    ):
        with pytest.raises(ScenarioError, match=match):
            Remedy.parse(bad)


def test_ape_at_one_equals_the_plain_remedy_and_reads_every_later_token_through_the_rescale(lm, store):
    scenario = adhoc_scenario(SHORT)
    prompt = render(scenario, lm.tokenizer)
    plain = splice_prompt(lm, scenario, prompt, store, Remedy.parse("prefix+seam:1")).notebook
    unit = splice_prompt(lm, scenario, prompt, store, Remedy.parse("prefix+seam:1+ape:1,1")).notebook
    assert torch.equal(unit.read_prompt(prompt).next_token_logits, plain.read_prompt(prompt).next_token_logits)
    assert all(torch.equal(a, b) for a, b in zip(unit.keys + unit.values, plain.keys + plain.values))
    rescaled = splice_prompt(lm, scenario, prompt, store, Remedy.parse("prefix+seam:1+ape:0.9,0.9")).notebook
    assert rescaled.rescale.name == "ape:0.9,0.9"
    spans = prompt.skill_spans.values()
    expected = [any(span.start + 1 <= p < span.end for span in spans) for p in range(len(prompt.context_ids))]
    assert rescaled.spliced[rescaled.order].tolist() == expected  # the skills, less their recomputed seams
    moved = float((rescaled.read_prompt(prompt).next_token_logits - plain.read_prompt(prompt).next_token_logits).abs().max())
    assert moved > 1e-3


def test_ape_is_refused_by_name_where_nothing_is_spliced(lm, store):
    scenario = adhoc_scenario([])
    prompt = render(scenario, lm.tokenizer)
    with pytest.raises(NotebookError, match=r"remedy 'ape:0.9,0.9' reads spliced skills.*places no skill"):
        splice_prompt(lm, scenario, prompt, store, Remedy.parse("ape:0.9,0.9"))


def test_keystone_runs_with_ape_on_the_composed_side_only_and_reuses_a_recomputed_side(lm, store):
    scenario = Scenario.load(bundled_scenarios()["keystone_safety"])
    strategies = ("field_only", "erratum")
    plain = keystone(lm, scenario, store, remedy=Remedy.parse("prefix+seam:1"), strategies=strategies)
    ape = keystone(lm, scenario, store, remedy=Remedy.parse("prefix+seam:1+ape:0.9,0.9"), strategies=strategies).as_dict()
    reused = keystone(
        lm, scenario, store, remedy=Remedy.parse("prefix+seam:1+ape:0.9,0.9"), strategies=strategies, recomputed=plain.recomputed
    )
    margins = lambda data: {name: (row["composed"]["margin"], row["recomputed"]["margin"]) for name, row in data["strategies"].items()}  # noqa: E731
    assert ape["remedy"] == "prefix+seam:1+ape:0.9,0.9" and margins(reused.as_dict()) == margins(ape)
    assert reused.as_dict()["max_recovery_gap"] == ape["max_recovery_gap"] and reused.delta_margin == pytest.approx(
        ape["delta_margin"], abs=1e-4
    )
    assert ape["strategies"]["erratum"]["recomputed"]["margin"] == plain.as_dict()["strategies"]["erratum"]["recomputed"]["margin"]
    assert ape["stale_margin"]["composed"] != pytest.approx(plain.as_dict()["stale_margin"]["composed"], abs=1e-4)
    with pytest.raises(ScenarioError, match="edits 'other' of"):
        keystone(lm, scenario, store, strategies=strategies, recomputed=dataclasses.replace(plain.recomputed, field="other"))


def _own_forward_model(lm):
    """A copy of the model with its own attention (not KVScope's registered function)."""
    model = copy.deepcopy(lm.model)
    model.set_attn_implementation(model.config._kvscope_original_attn_implementation)
    return model


def test_seam_is_epics_legolink_recomputed_by_the_models_own_forward(lm, store):
    """EPIC's sink:K (LegoLink) by hand: the model's own forward runs the text and each skill's first K tokens over a
    transformers cache that holds every earlier token, the rest of each skill appended as its spliced K/V; the K/V
    and the question's logits equal ``seam:K``'s."""
    sink, scenario = 3, adhoc_scenario(SHORT)
    prompt = render(scenario, lm.tokenizer)
    seamed = splice_prompt(lm, scenario, prompt, store, Remedy(seam=sink)).notebook
    spliced = splice_prompt(lm, scenario, prompt, store, Remedy()).notebook.compact()  # reading order: entry i at position i
    model, cache, ids = _own_forward_model(lm), DynamicCache(), list(prompt.context_ids)

    def run(tokens, start):
        with torch.no_grad():
            positions = torch.arange(start, start + len(tokens))[None]
            return model(input_ids=torch.tensor([tokens]), position_ids=positions, cache=cache, use_cache=True).logits[0, -1]

    cursor = 0
    for span in sorted(prompt.skill_spans.values(), key=lambda span: span.start):
        if span.start > cursor:
            run(ids[cursor : span.start], cursor)
        run(ids[span.start : span.start + sink], span.start)
        for layer, (keys, values) in enumerate(zip(spliced.keys, spliced.values)):
            cache.update(keys[:, :, span.start + sink : span.end], values[:, :, span.start + sink : span.end], layer)
        cursor = span.end
    run(ids[cursor:], cursor)
    logits = run(list(prompt.decode_ids), len(ids))
    assert float((logits.float() - seamed.read_prompt(prompt).next_token_logits).abs().max()) < 2e-5  # seam:0 is 0.02 off
    compact = seamed.compact()
    context = slice(0, len(ids))  # the question's entries follow in the cache
    theirs = [layer.keys[:, :, context] for layer in cache.layers] + [layer.values[:, :, context] for layer in cache.layers]
    assert max(float((a - b).abs().max()) for a, b in zip(compact.keys + compact.values, theirs)) < 2e-5
