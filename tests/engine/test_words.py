"""Counts in words: one form for one, another for the rest."""

from kvscope.engine.words import counted


def test_counts_take_the_singular_only_for_one():
    assert [counted(n, "client") for n in (0, 1, 2)] == ["0 clients", "1 client", "2 clients"]
    assert counted(1, "remedy", "remedies") == "1 remedy" and counted(3, "remedy", "remedies") == "3 remedies"
    assert counted(1, "keystone run") == "1 keystone run"
