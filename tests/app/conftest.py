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


# Gradio's launch gives up when its one HEAD request to the new page takes over 3 s ("When localhost is not
# accessible, ..."), which a loaded machine can cause; the page is served then, only slow.
LOCALHOST_CHECK = "When localhost is not accessible"
LAUNCH_ATTEMPTS = 3


def launched(blocks, **options) -> str:
    """Serve ``blocks`` on a free 127.0.0.1 port (its queue one event at a time) and return its URL once it answers;
    a launch that failed Gradio's localhost check on a slow machine is closed and tried again."""
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        port = free_port()
        try:
            blocks.queue(default_concurrency_limit=1).launch(
                server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **options
            )
            break
        except ValueError as error:
            blocks.close()
            if LOCALHOST_CHECK not in str(error) or attempt == LAUNCH_ATTEMPTS:
                raise
    url = f"http://127.0.0.1:{port}/"
    wait_until_serving(url, 60)
    return url


@pytest.fixture(scope="session")
def app_url(registry):
    from kvscope.app.ui import build_app

    page = build_app(registry)
    yield launched(page)
    page.close()
