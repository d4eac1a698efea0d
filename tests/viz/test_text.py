"""The app's text panels from the engine's results: values escaped, KL never shown below zero, the remedy named."""

import torch

from kvscope.engine.cache.decision import Decision
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.viz.learn import decisions_html, splice_html
from kvscope.viz.text import knockout_markdown, memory_markdown, remedy_info, remedy_words

PROFILE = {
    "name": "public",
    "model_capacity": 2,
    "pin_default_model": True,
    "baseline_budget_bytes": 2**20,
    "max_context_tokens": 1024,
    "request_seconds": 30.0,
    "max_agent_turns": 8,
    "export_max_bytes": 2 * 2**20,
}


def _decision(label: str, margin: float) -> Decision:
    return Decision(scores={label: margin, "other": 0.0}, string_logprobs={}, margin=margin, label=label, next_token_logits=torch.zeros(4))


def test_remedy_words_say_what_each_part_recomputes():
    blend = remedy_words(Remedy.parse("prefix+seam:1+blend:0.15").as_dict())
    assert "system prompt" in blend and "its first token" in blend and "15% of its other tokens" in blend and "CacheBlend" in blend
    assert remedy_words(DEFAULT_REMEDY.as_dict()) == (
        "the skill compiled after the scenario's own system prompt; its first 16 tokens recomputed against the real prefix (seam)"
    )
    assert "APE's rescaled attention (temperature 1, scale 0.7)" in remedy_words(Remedy.parse("prefix+ape:1,0.7").as_dict())
    adaptive = remedy_words(Remedy.parse("seam:1+tail:8+query:0.3+cover:0.5").as_dict())
    assert "its last 8 tokens recomputed against their real predecessors" in adaptive
    assert "at most 30% of its other tokens recomputed: those the question attends to most" in adaptive and "hold 50%" in adaptive
    assert remedy_words(Remedy.parse("seam:3").as_dict()) == "its first 3 tokens recomputed against the real prefix (seam)"
    assert "nothing recomputed" in remedy_words(Remedy.parse("splice").as_dict())


def test_splice_step_names_the_remedy_and_its_recomputed_share():
    summary = {
        "decision_agree": True,
        "cosine": 0.99991,
        "kl": 0.0,  # the engine clamps rounding noise below zero (kvscope.engine.cache.decision.kl_divergence)
        "ttft_ms": {"splice": 120.0, "full": 300.0},
        "speedup": 2.5,
        "skill_tokens": 200,
        "context_tokens": 260,
        "recomputed_tokens": 141,
        "recomputed_fraction": 0.705,
        "remedy": DEFAULT_REMEDY.as_dict(),
    }
    text = splice_html(summary)
    assert "KL 0.0000," in text and "-0.0000" not in text
    assert f"The remedy {DEFAULT_REMEDY.name} recomputed 141 of the 200 skill tokens (70%)" in text
    assert "logit cosine 0.90–0.999" in text and "notes effect" not in text  # the caveat is about splicing


def test_user_text_in_panels_is_escaped():
    html_text = decisions_html("m<i>", "<b>old</b>", "new", _decision("yes", 1.0), _decision("no", -1.0))
    assert "<b>old</b>" not in html_text and "&lt;b&gt;old&lt;/b&gt;" in html_text and "m&lt;i&gt;" in html_text
    memory = memory_markdown(
        PROFILE,
        ["org/[x](http://e)"],
        2**20,
        {"baselines": 0, "skills": 0},
        {"sessions": 1, "bytes": 0, "budget_bytes": 2**20, "ttl_s": 900.0},
    )
    assert r"org/\[x\]\(http://e\)" in memory and "context ≤ 1,024 tokens" in memory
    knocked = knockout_markdown([1, 2], ["a", "*b*"], _decision("<no>", -0.5), _decision("yes", 1.0), _decision("no", -1.0))
    assert "Knocked out 2 positions" in knocked and "&lt;no&gt;" in knocked and r"\*b\*" in knocked
    one = knockout_markdown([1], ["a", "b"], _decision("no", -0.5), _decision("yes", 1.0), _decision("no", -1.0))
    assert "Knocked out 1 position (" in one


def test_a_soak_of_one_visitor_and_one_session_says_so_in_the_singular():
    from kvscope.viz.benchmarks import soak_figure

    figure = soak_figure({"profile": "public", "sessions": 1, "clients": 1, "edit_seconds_under_load": {"p50": 1.0, "n": 1}})
    title = figure.layout.title.text
    assert "1 session, 1 client" in title and "1 clients" not in title and "1 sessions" not in title
    assert "1 visitor at once (n=1)" in [trace.name for trace in figure.data]


def test_remedy_info_without_a_stored_study_gives_the_grammar():
    info = remedy_info("prefix+seam:1", model="tiny-llama")
    assert info.startswith("Default for tiny-llama prefix+seam:1: not measured for this model yet. auto: this model's own calibration")
    assert "parts joined by +" in info
