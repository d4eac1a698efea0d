"""The cache dir (converted model copies, the GGUF, measurements) and its small JSON stores."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """Where converted copies and measurements live: $KVSCOPE_CACHE_DIR, else ~/.cache/kvscope."""
    configured = os.environ.get("KVSCOPE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvscope"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON store's contents; empty when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
    os.replace(tmp, path)
