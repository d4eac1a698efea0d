"""Shared fixtures: a registry holding a tiny model, and a launched app for API and browser tests."""
import os
import socket
import time
import urllib.request

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from app.state import ModelRegistry, SessionStore  # noqa: E402
from tests.shared import SAME_LENGTH_SCENARIO  # noqa: E402

TINY = "tiny-qwen2"
SCENARIO = SAME_LENGTH_SCENARIO


@pytest.fixture(scope="session")
def registry():
    registry = ModelRegistry(TINY)
    registry.get()
    return registry


@pytest.fixture
def sessions():
    return SessionStore()


def wait_until_serving(url: str, timeout: float) -> None:
    """Poll ``url`` until it answers HTTP 200 (or ``timeout`` seconds pass)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.3)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def app_url(registry):
    from app.ui import build_app

    page = build_app(registry)
    port = _free_port()
    page.queue(default_concurrency_limit=1).launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}/"
    wait_until_serving(url, 60)
    yield url
    page.close()
