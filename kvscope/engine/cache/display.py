"""Small HTML for Jupyter's rich display: the ``_repr_html_`` of the objects a researcher holds.

A Notebook (:func:`notebook_view`), an edit report, a composition's fidelity and a support-matrix row each draw a
few tables with these helpers (the engine draws no figures: plotly figures live in ``kvscope/viz/``). Every value is escaped with
:func:`html.escape` unless it is :class:`Raw` (HTML that a helper here built), so a field value or a segment
label such as ``<b>`` shows as text.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

from kvscope.engine.cache import adapter
from kvscope.engine.cache.fused_forward import NotebookState
from kvscope.engine.cache.loaded import dtype_name

_TABLE = "border-collapse:collapse;margin:2px 0;font-size:12px"
_CELL = "border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top"
_CARD = "display:inline-block;vertical-align:top;border:1px solid #ccc;border-radius:6px;padding:6px 8px;margin:3px;max-width:340px"


class Raw(str):
    """HTML built by these helpers: inserted as it is, not escaped again."""


def text(value: object) -> str:
    """``value`` as escaped HTML (a :class:`Raw` value as it is; None as a dash)."""
    if isinstance(value, Raw):
        return value
    return "–" if value is None else html.escape(str(value))


def number(value: float | None, decimals: int = 4, signed: bool = False) -> str:
    """A float with ``decimals`` decimals (a ``+`` on positive values when ``signed``); None as a dash."""
    if value is None:
        return "–"
    return f"{value:+.{decimals}f}" if signed else f"{value:.{decimals}f}"


def table(rows: Iterable[Sequence[object]], header: Sequence[object] | None = None) -> Raw:
    """A table of rows (each cell escaped, see :func:`text`); a first row of headers when given."""
    head = "<tr>" + "".join(f'<th style="{_CELL}">{text(cell)}</th>' for cell in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f'<td style="{_CELL}">{text(cell)}</td>' for cell in row) + "</tr>" for row in rows)
    return Raw(f'<table style="{_TABLE}">{head}{body}</table>')


def fields(pairs: Iterable[tuple[object, object]]) -> Raw:
    """A two-column table of name → value."""
    return table([(Raw(f"<b>{text(name)}</b>"), value) for name, value in pairs])


def card(title: object, body: object) -> Raw:
    """A bordered box with a bold title (escaped) above its body (escaped unless :class:`Raw`)."""
    return Raw(f'<div style="{_CARD}"><div><b>{text(title)}</b></div>{text(body)}</div>')


def block(title: object, *parts: object, subtitle: object = None) -> Raw:
    """The outer element of a display: a title (escaped), an optional grey subtitle, then its parts."""
    sub = f'<div style="color:#555">{text(subtitle)}</div>' if subtitle is not None else ""
    return Raw(f'<div class="kvscope"><div style="font-weight:bold">{text(title)}</div>{sub}{"".join(text(p) for p in parts)}</div>')


def paragraph(value: object) -> Raw:
    """One paragraph of escaped text."""
    return Raw(f'<p style="margin:4px 0">{text(value)}</p>')


def notebook_view(notebook: NotebookState) -> Raw:
    """Jupyter's view: tokens, the segments' runs with their positions, layers, KV heads, memory and pending
    steps (it runs no forward: memory counts the K/V computed so far)."""
    config = notebook.lm.model.config.get_text_config()
    (kv_heads, _), _ = adapter.cache_entry_shapes(config)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*notebook.computed_keys, *notebook.computed_values)}
    hidden = len(notebook.positions) - len(notebook)
    pending = f"{len(notebook.pending)} ({notebook.pending_tokens} tokens, computed by the next read)" if notebook.pending else "none"
    summary = fields(
        [
            ("model", f"{notebook.lm.name} ({dtype_name(notebook.lm.dtype)})"),
            ("tokens", f"{len(notebook)} visible" + (f", {hidden} hidden (replaced or recomputed, kept for forks)" if hidden else "")),
            ("layers", config.num_hidden_layers),
            ("KV heads", kv_heads),
            ("cache entry", notebook.lm.cache_layout()),
            ("memory", f"{sum(storages.values()):,} bytes of computed K/V"),
            ("pending steps", pending),
            *(
                [("attention", f"{notebook.rescale.name} (APE) over {int(notebook.spliced.sum())} spliced entries")]
                if notebook.rescale
                else []
            ),
        ]
    )
    runs: list[list] = []  # [label, entries] of consecutive equal labels in reading order
    for entry in notebook.order.tolist():
        if runs and runs[-1][0] == notebook.segments[entry]:
            runs[-1][1].append(entry)
        else:
            runs.append([notebook.segments[entry], [entry]])
    shown = 40
    rows = [
        (label, f"{int(notebook.positions[entries[0]])}–{int(notebook.positions[entries[-1]])}", len(entries), _preview(notebook, entries))
        for label, entries in runs[:shown]
    ]
    if len(runs) > shown:
        rows.append(("…", f"{len(runs) - shown} more runs", sum(len(entries) for _, entries in runs[shown:]), ""))
    segments = table(rows, header=("segment", "positions", "tokens", "text"))
    log = paragraph("operations: " + "; ".join(notebook.log[-6:])) if notebook.log else ""
    return block(f"Notebook: {len(notebook)} tokens", summary, paragraph("segments"), segments, log)


def _preview(notebook: NotebookState, entries: Sequence[int], limit: int = 24) -> str:
    """The text of a run of entries (its first ``limit`` tokens)."""
    ids = notebook.token_ids[list(entries[:limit])].tolist()
    if notebook.lm.images is not None and any(token >= notebook.lm.images.first_id for token in ids):
        return f"(picture patches, {len(entries)} tokens)"
    return notebook.lm.tokenizer.decode(ids) + ("…" if len(entries) > limit else "")
