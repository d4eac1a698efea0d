"""One vocabulary: every name a first visitor meets has one plain line beside its registry entry, and the figures'
titles fit a 1,000 px window and tell the figures apart."""

import plotly.graph_objects as go

from kvscope.engine.audit.measure.repairs import REPAIR_SUMMARIES
from kvscope.engine.audit.prompts.repair_requests import REPAIRS
from kvscope.engine.cache.decision import RECOVERY_WORDS
from kvscope.engine.compose.choice import RemedyChoice, RemedyPoint
from kvscope.engine.compose.remedy import RANKED_SELECTIONS, RANKING_WORDS, REMEDY_GRAMMAR
from kvscope.engine.edit.strategies import REGISTRY
from kvscope.viz.common import NOTE_CHARS, TITLE_CHARS, figure_label, set_title
from kvscope.viz.models import comparison_markdown
from kvscope.viz.text import glossary, remedy_menu, strategy_glossary
from tests.viz.test_models import COMPARISON


def test_every_strategy_repair_and_ranking_has_its_own_plain_line():
    for summaries in ({name: strategy.summary for name, strategy in REGISTRY.items()}, REPAIR_SUMMARIES, RANKING_WORDS):
        assert all(line.strip() for line in summaries.values()) and len(set(summaries.values())) == len(summaries)
    assert tuple(REPAIR_SUMMARIES) == REPAIRS and set(RANKING_WORDS) == set(RANKED_SELECTIONS)
    for part in ("prefix", "seam:N", "tail:N", "aggregators", "blend:F", "query:F", "deviation:F", "causal:F", "cover:M", "splice"):
        assert part in REMEDY_GRAMMAR, part
    assert "above 1 it overshoots the clean prefill's margin" in RECOVERY_WORDS


def test_glossaries_name_each_entry_with_its_registry_line():
    assert glossary({"a": "does a", "b": "does b"}) == "a: does a · b: does b"
    assert glossary({"a": "does a", "b": "does b"}, ["b"]) == "b: does b"
    assert strategy_glossary(["restate"]) == f"restate: {REGISTRY['restate'].summary}"


def _point(name: str, agree: int, speedup: float) -> RemedyPoint:
    return RemedyPoint(name, agree, 35, 0, agree / 35, speedup, 0.15, 0.1)


def test_the_remedy_menu_says_what_its_numbers_compare_with_and_which_are_unmeasured():
    choice = RemedyChoice("seam:1", True, "", 5.8, (_point("seam:1", 33, 2.61), _point("splice", 30, 5.8)))
    menu = remedy_menu("seam:1", "auto", ["seam:1", "splice", "tail:8"], choice)
    assert menu[0] == ("seam:1 — keeps 33/35 decisions of a full recompute, ×2.61 faster first token (median) (default)", "seam:1")
    assert menu[2] == ("splice — keeps 30/35 decisions of a full recompute, ×5.80 faster first token (median)", "splice")
    assert menu[3] == ("tail:8 — not measured for this model yet", "tail:8")
    assert _point("seam:1", 33, 2.61).words().startswith("seam:1: keeps 33/35 decisive decisions of a full recompute (94%)")


def test_titles_wrap_to_fit_and_the_label_is_their_heading():
    figure = go.Figure(layout={"height": 400})
    heading = "word " * 20
    note = "note " * 30
    set_title(figure, heading.strip(), note.strip(), subplot_titles=1)
    heads, *notes = figure.layout.title.text.split("<br><sup>")
    assert [len(line) for line in heads.split("<br>")] == [TITLE_CHARS, 99 - TITLE_CHARS - 1]  # 13 words, then 7
    assert all(len(line.removesuffix("</sup>")) <= NOTE_CHARS for line in notes) and len(notes) == 2
    assert figure_label(figure) == heading.strip()
    assert figure.layout.margin.t == 58 + 22 + 16 + 22 + 12 + 24 + 8  # label, two title lines, two notes, a subplot title row
    assert figure_label(go.Figure()) == "Figure"


def test_the_model_table_has_one_column_per_model_and_short_row_names():
    lines = comparison_markdown(COMPARISON).splitlines()
    header = next(line for line in lines if line.startswith("| model |"))
    assert header.count("|") == len(COMPARISON["models"]) + 2
    names = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and line != header]
    assert names[:4] == ["parameters", "dtype", "decision", "notes share"] and "notes depth" in names
    assert "| notes share | 0.630 | – |" in lines
