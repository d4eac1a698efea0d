"""Permalinks without a browser: a Notes-tab state to a query and back, the TOML bound, strict parsing of every value."""

import base64
import random
import string
import zlib
from urllib.parse import parse_qsl, urlsplit

import pytest

from kvscope.app import permalink
from kvscope.app.handlers.common import bundled_scenario_text
from kvscope.app.handlers.notes import EditInputs
from kvscope.app.hosting import public_profile
from kvscope.app.permalink import MAX_ENCODED_TOML, LinkError, decode_toml, encode_toml, link_query, parse_link
from kvscope.engine.edit.strategies import STRATEGIES
from kvscope.engine.probes.analysis import DEFAULT_STRATEGIES
from tests.app.conftest import SCENARIO

OFFERED = [name for name in STRATEGIES if name not in ("stale", "oracle")]


def _parse(query: str | dict, **options):
    params = dict(parse_qsl(urlsplit(query).query, keep_blank_values=True)) if isinstance(query, str) else query
    return parse_link(params, offered_strategies=OFFERED, default_strategies=DEFAULT_STRATEGIES, heads=2, **options)


def test_a_bundled_scenario_travels_by_name_and_comes_back_whole():
    text = bundled_scenario_text("boarding_visa")
    query = link_query(
        EditInputs(text, field="visa_status", new="valid", strategies=["field_only", "erratum"], top_k=4, head=1, separately=True),
        remedy="prefix+seam:1",
    )
    assert "scenario=boarding_visa" in query and "toml=" not in query
    link = _parse(query)
    edit = link.edit
    assert (link.scenario, edit.text, edit.field, edit.new) == ("boarding_visa", text.strip(), "visa_status", "valid")
    assert (edit.strategies, edit.top_k, edit.head, link.remedy, edit.separately, edit.all_positions) == (
        ("field_only", "erratum"),
        4,
        1,
        "prefix+seam:1",
        True,
        False,
    )


def test_an_edited_scenario_travels_compressed_and_exactly():
    text = SCENARIO + "# an edit with ünïcödé, quotes ''' and \\ backslashes\n"
    query = link_query(EditInputs(text, field="order_status", new="pending", strategies=["erratum"], top_k=8, head=-1), hint="refund_gate")
    assert "toml=" in query and "scenario=" not in query
    assert decode_toml(encode_toml(text)) == text
    link = _parse(query)
    edit = link.edit
    assert link.scenario is None and edit.text == text.strip() and edit.field == "order_status" and edit.strategies == ("erratum",)


def test_the_links_bound_is_stated_and_enforced():
    assert f"{MAX_ENCODED_TOML:,} characters" in permalink.BOUND_WORDS and "8 KB" in permalink.BOUND_WORDS
    noise = "".join(random.Random(0).choices(string.ascii_letters + string.digits, k=12_000))
    big = SCENARIO + f"# {noise}\n"
    with pytest.raises(LinkError, match=r"this scenario takes 1\d,\d{3} characters in a link \(compressed\); a link carries at most 8,192"):
        link_query(EditInputs(big, field="order_status", new="pending", top_k=8, head=-1))
    with pytest.raises(LinkError, match="a link carries at most 8,192"):
        decode_toml("A" * (MAX_ENCODED_TOML + 1))


@pytest.mark.parametrize(
    "token, message",
    [
        ("not base64!", "not URL-safe base64"),
        ("abc", "not valid base64|not zlib"),
        (base64.urlsafe_b64encode(b"plain text, not zlib").decode().rstrip("="), "not zlib-compressed"),
        (base64.urlsafe_b64encode(zlib.compress(b"x" * 4_000_000, 9)).decode().rstrip("="), "expands past 512 KB"),
        (base64.urlsafe_b64encode(zlib.compress(b"name = 1" * 50)[:-6]).decode().rstrip("="), "ends early"),
        (base64.urlsafe_b64encode(zlib.compress(b"\xff\xfe bytes")).decode().rstrip("="), "not UTF-8"),
    ],
    ids=["alphabet", "cut", "not-zlib", "zip-bomb", "truncated", "not-utf8"],
)
def test_a_damaged_toml_parameter_is_refused_by_name(token, message):
    with pytest.raises(LinkError, match=message):
        decode_toml(token)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"scenario": "nope"}, "unknown scenario 'nope' in the link; bundled: .*refund_gate"),
        ({"scenario": "refund_gate", "field": "colour"}, "unknown field 'colour' in the link; scenario 'refund_gate' has: refund_eligible"),
        ({"scenario": "refund_gate", "strategies": "erratum,telepathy"}, "unknown strategy 'telepathy' in the link; choose from"),
        ({"scenario": "refund_gate", "strategies": "oracle"}, "unknown strategy 'oracle'"),
        ({"scenario": "refund_gate", "k": "0"}, "k=0 in the link is out of range; K takes 1 to 64"),
        ({"scenario": "refund_gate", "k": "8.5"}, "k='8.5' in the link is not a whole number"),
        (
            {"scenario": "refund_gate", "head": "2"},
            r"head=2 in the link is out of range; the attention head \(-1 = mean over heads\) takes -1 to 1",
        ),
        ({"scenario": "refund_gate", "value": "{x}"}, "without braces"),
        ({"scenario": "refund_gate", "value": " "}, "non-empty"),
        ({"scenario": "refund_gate", "remedy": "magic"}, "remedy='magic' in the link: remedy part 'magic' not understood"),
        ({"scenario": "refund_gate", "separately": "maybe"}, "separately='maybe' in the link is not a yes/no flag"),
        ({"scenario": "refund_gate", "toml": "abc"}, "names a bundled scenario and carries one too"),
        ({"field": "refund_eligible"}, "the link names no scenario"),
        ({"toml": encode_toml("name = [broken")}, "the link's scenario does not parse: .*TOML syntax error"),
        ({"scenario": "../../etc/passwd"}, "unknown scenario '../../etc/passwd'"),
    ],
)
def test_every_bad_value_gets_a_message_that_names_it(params, message):
    with pytest.raises(LinkError, match=message):
        _parse(params)


def test_no_link_parameters_means_no_restore_and_foreign_ones_are_named():
    assert _parse({}) is None and _parse({"__theme": "dark", "view": "api"}) is None
    link = _parse({"scenario": "refund_gate", "utm_source": "mail", "__theme": "dark"})
    assert link.ignored == ("utm_source",) and link.edit.field == "refund_eligible" and link.edit.new == "true"
    assert link.edit.strategies == tuple(DEFAULT_STRATEGIES) and link.edit.top_k == 8 and link.edit.head == -1 and link.remedy is None
    assert _parse({"scenario": "refund_gate", "remedy": "auto"}).remedy == "auto"  # the model's calibrated choice


def test_the_public_profile_bounds_apply_to_links():
    profile = public_profile()
    long_text = SCENARIO.replace("POLICY", "POLICY " + "x" * profile.max_scenario_chars)
    with pytest.raises(LinkError, match="does not parse: .*accepts at most 12,000"):
        _parse({"toml": encode_toml(long_text)}, profile=profile)
    assert _parse({"scenario": "refund_gate", "strategies": "erratum,erratum, field_only"}, profile=profile).edit.strategies == (
        "erratum",
        "field_only",
    )


def test_a_link_made_before_a_strategy_was_renamed_opens_with_its_new_name():
    link = _parse({"scenario": "refund_gate", "strategies": "field_only,hoist"})  # hoist appended a line: now restate
    assert link.edit.strategies == ("field_only", "restate")
