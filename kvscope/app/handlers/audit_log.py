"""The log the Your prompt tab audits: a bundled demo's text, an upload (named with its size, read from its path), the
text box, and the words for an empty one."""

from __future__ import annotations

from pathlib import Path

from kvscope.app.handlers.common import AppError, bundled_text
from kvscope.engine import bundled_logs
from kvscope.viz.common import markdown_literal

NOTHING_TO_AUDIT = (
    "**Nothing to audit yet:** the log is empty. Paste a request log (one JSON request a line), upload one or pick a "
    "bundled demo log, then press *Audit the log*."
)


def bundled_log_text(name: str) -> str:
    """The text of a bundled request log."""
    return bundled_text(bundled_logs(), name, "demo log")


def size_words(count: int) -> str:
    """A file's size as people read it: bytes, KB or MB (of 1,024)."""
    if count < 2**10:
        return f"{count:,} bytes"
    return f"{count / 2**10:,.1f} KB" if count < 2**20 else f"{count / 2**20:,.1f} MB"


def upload_markdown(path: str | None) -> str:
    """What the tab says of an uploaded log: the file's name and size, and when the audit reads it (empty: none)."""
    if not path:
        return ""
    file = Path(path)
    return (
        f"Uploaded: **{markdown_literal(file.name)}** · {size_words(file.stat().st_size)}. The audit reads this file while the "
        "box below is empty (text typed or pasted there is read instead); upload another file to replace it."
    )


def given_log(text: str | None, upload: str | None) -> str | None:
    """The log (or prompt) the tab audits: the text box's text where it holds any (typed, pasted or a demo's), else the
    uploaded file, read from its path (an upload empties the box). The upload is read here, once, rather than pasted into
    the text box (a 20 MB log took 23 s to show there)."""
    if (text or "").strip() or not upload:
        return text
    try:
        return Path(upload).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError as error:
        raise AppError(
            f"the uploaded file {Path(upload).name} is no longer on the server (uploads are kept an hour): upload it again"
        ) from error


def nothing_to_audit(text: str | None) -> str | None:
    """The tab's information where the log is empty or only blank lines (shown in one place, not as an error), else None."""
    return NOTHING_TO_AUDIT if not (text or "").strip() else None


def audit_text(text: str | None, what: str) -> str:
    """``text``, refused with what to give where it is empty."""
    if not (text or "").strip():
        raise AppError(f"paste {what} first, upload a file or pick a bundled demo log")
    return text
