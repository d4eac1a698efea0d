"""Shared fixtures: a registry holding a tiny model, and a launched app for API and browser tests."""

import os

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from benchmarks.common import free_port, wait_until_serving  # noqa: E402
from kvscope.app.state import ModelRegistry, SessionStore  # noqa: E402
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


@pytest.fixture(scope="session")
def app_url(registry):
    from kvscope.app.ui import build_app

    page = build_app(registry)
    port = free_port()
    page.queue(default_concurrency_limit=1).launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}/"
    wait_until_serving(url, 60)
    yield url
    page.close()
