"""Words for counts: one home for "1 client" / "3 clients", so no sentence says "1 clients"."""

from __future__ import annotations


def counted(count: int, word: str, plural: str | None = None) -> str:
    """``count`` and ``word`` in its number: "1 client", "3 clients", "0 clients" (``plural`` where "+s" is wrong:
    counted(2, "entry", "entries"))."""
    return f"{count:,} {word if count == 1 else plural or word + 's'}"
