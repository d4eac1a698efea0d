"""Where in a prompt (kvscope/engine/audit/prompts/text_spans.py), on tiny-qwen2's chat template: a found text and a picked candidate come
back as characters of one message's content holding exactly that text; the menu pairs labels with numbers; an exact
prefix cache stops where the two rendered texts part (never inside a changed field) and the appended span holds the
new turn."""

import json

import numpy as np
import pytest

from kvscope.engine.audit.changes.fields import candidate_spans, diff_requests
from kvscope.engine.audit.logs.reading import parse_prompt
from kvscope.engine.audit.logs.render import render_request
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.paged_blocks import BLOCK_TOKENS
from kvscope.engine.audit.prompts.text_spans import (
    LABEL_CHARS,
    appended_chars,
    candidate_menu,
    candidate_span,
    find_span,
    prefix_cache_stop,
)
from kvscope.engine.models.tiny import tiny_model

SYSTEM = "You are the help desk of a bike shop.\nSession started: 2026-05-12 09:{minute}\nTicket: {ticket}\nBe brief."
ASK = "Is the repair of my wheel covered? Order A-48213."


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


def _prompt(minute: str, ticket: str = "T-1", *turns: str) -> str:
    messages = [{"role": "system", "content": SYSTEM.format(minute=minute, ticket=ticket)}, {"role": "user", "content": ASK}]
    messages += [{"role": role, "content": text} for role, text in zip(("assistant", "user") * len(turns), turns)]
    return json.dumps(messages)


def test_a_found_text_is_its_first_occurrence_in_message_order():
    request = parse_prompt(_prompt("41"))
    site = find_span(request, "A-48213")
    assert site.message == 1 and request.contents[1][slice(*site.chars)] == "A-48213"
    assert find_span(request, "e").message == 0  # the system message holds it first
    with pytest.raises(RequestLogError, match="'refunded' does not occur in the prompt's text"):
        find_span(request, "refunded")


def test_the_menu_pairs_numbered_labels_with_numbers_and_a_pick_is_that_candidates_text(lm):
    request = parse_prompt(_prompt("41", "x" * 60))
    rendered = render_request(lm, request)
    found = candidate_spans(rendered)
    menu = candidate_menu(found)
    assert [number for _, number in menu] == list(range(1, len(found) + 1))
    for (label, number), candidate in zip(menu, found):
        shown = candidate.text if len(candidate.text) <= LABEL_CHARS else candidate.text[: LABEL_CHARS - 1] + "…"
        assert label == f"{number} · {candidate.kind} · {shown}"
        site = candidate_span(rendered, found, number)
        assert request.contents[site.message][slice(*site.chars)] == candidate.text
    assert any(label.endswith("…") and len(label.split(" · ", 2)[2]) == LABEL_CHARS for label, _ in menu)  # the long ticket, cut
    with pytest.raises(RequestLogError, match=f"no candidate span {len(found) + 1}: .* one of the {len(found)} offered"):
        candidate_span(rendered, found, len(found) + 1)


def test_the_prefix_cache_stops_where_the_texts_part_and_never_inside_the_changed_field(lm):
    old, new = (render_request(lm, parse_prompt(_prompt(minute))) for minute in ("41", "42"))
    diff = diff_requests(old, new, BLOCK_TOKENS)
    (field,) = diff.fields
    stop = prefix_cache_stop(diff, new)
    assert old.text[:stop] == new.text[:stop] and stop <= field.char_span[0]
    assert int(np.sum(new.offsets[:, 1] <= stop)) <= diff.common_prefix_tokens  # only reused tokens lie before it
    assert appended_chars(diff, new) is None  # nothing was appended


def test_the_appended_span_holds_the_new_turn(lm):
    old = render_request(lm, parse_prompt(_prompt("41")))
    new = render_request(lm, parse_prompt(_prompt("41", "T-1", "Yes, within the warranty.", "And the brakes?")))
    diff = diff_requests(old, new, BLOCK_TOKENS)
    start, end = appended_chars(diff, new)
    assert end == len(new.text) and "And the brakes?" in new.text[start:end] and new.text[:start] in old.text
    assert prefix_cache_stop(diff, new) <= start
