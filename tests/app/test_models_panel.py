"""The Models panel and what it needs from the server: byte-budget eviction that says what it dropped, the public
allowlist of the 1.5B model, and the comparison handler on tiny models (issue 31)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvscope.app.handlers.common import AppError
from kvscope.app.handlers.model import memory_markdown
from kvscope.app.handlers.models import run_model_comparison
from kvscope.app.hosting import MODEL_SHARE, from_env, local_profile, public_profile
from kvscope.app.state import ModelRegistry, SessionStore
from kvscope.engine.models import expected_parameter_bytes, load_model
from tests.app.conftest import SCENARIO, TINY

GB = 10**9


class FakeModel:
    """A loaded model as the registry sees it: only its parameter bytes."""

    def __init__(self, spec: str, nbytes: int) -> None:
        self.spec, self.nbytes = spec, nbytes

    def info(self) -> dict:
        return {"parameter_bytes": self.nbytes}


def _registry(sizes: dict[str, int], budget: int, capacity: int = 3, default: str = "a", public: bool = False) -> ModelRegistry:
    profile = replace(public_profile() if public else local_profile(), model_budget_bytes=budget, model_capacity=capacity)
    return ModelRegistry(
        default,
        profile=profile,
        loader=lambda spec, **options: FakeModel(spec, sizes[spec]),
        estimate=lambda spec, dtype: sizes[spec],
    )


def test_the_model_budget_scales_with_ram_and_fits_two_models_of_1_5b_on_24_gb():
    assert local_profile(memory_bytes=24 * GB).model_budget_bytes == int(24 * GB * MODEL_SHARE)
    two = 2 * expected_parameter_bytes("qwen-1.5b", "float32")
    assert two <= local_profile(memory_bytes=24 * GB).model_budget_bytes
    assert from_env(False, {"KVSCOPE_MODEL_BUDGET_BYTES": "123"}).model_budget_bytes == 123


def test_eviction_by_bytes_drops_the_least_recently_used_and_says_so():
    registry = _registry({"a": 4 * GB, "b": 4 * GB, "c": 5 * GB}, budget=10 * GB)
    mark = registry.drop_serial
    registry.get("a")
    registry.get("b")
    assert registry.loaded() == ["a", "b"] and registry.model_bytes() == {"a": 4 * GB, "b": 4 * GB}
    registry.get("c")  # 4 + 4 + 5 > 10: "a" (least recently used) goes before "c" loads
    assert registry.loaded() == ["b", "c"]
    (message,) = registry.drops_since(mark)
    assert message.startswith("dropped a (4.0 GB)") and "to load c (5.0 GB)" in message and "10.0 GB" in message
    assert registry.drops_since(registry.drop_serial) == []
    assert "**Model weights** 9.0 GB of 10.0 GB (b 4.0 GB, c 5.0 GB" in memory_markdown(registry, SessionStore())


def test_a_public_server_keeps_its_default_pinned_and_still_drops_others():
    registry = _registry({"a": 4 * GB, "b": 4 * GB, "c": 5 * GB}, budget=10 * GB, public=True)
    registry.profile = replace(registry.profile, allowed_models=("a", "b", "c"))
    registry.get("a")
    registry.get("b")
    registry.get("c")
    assert registry.loaded() == ["a", "c"]


def test_a_model_larger_than_what_is_left_is_still_measured_after_loading():
    """The estimate is a guess (None for an unknown spec): the loaded model's own parameter bytes decide."""
    sizes = {"a": 3 * GB, "big": 9 * GB}
    registry = ModelRegistry(
        "a",
        profile=replace(local_profile(), model_budget_bytes=10 * GB),
        loader=lambda spec, **options: FakeModel(spec, sizes[spec]),
        estimate=lambda spec, dtype: None,
    )
    mark = registry.drop_serial
    registry.get("a")
    registry.get("big")
    assert registry.loaded() == ["big"] and "dropped a" in registry.drops_since(mark)[0]


def test_the_1_5b_model_is_offered_publicly_only_where_the_host_allowlists_it():
    assert "qwen-1.5b" not in public_profile().allowed_models and "embedded" in public_profile().allowed_models
    allowed = from_env(True, {"KVSCOPE_ALLOWED_MODELS": "qwen-1.5b"})
    assert "qwen-1.5b" in allowed.allowed_models
    public = ModelRegistry(TINY, profile=public_profile())
    with pytest.raises(Exception, match="not offered"):
        public.resolve("qwen-1.5b")
    assert ModelRegistry(TINY, profile=allowed).resolve("qwen-1.5b") == "qwen-1.5b"
    assert local_profile().allowed_models is None


def test_the_models_panel_compares_tiny_models_and_reports_progress():
    registry = ModelRegistry(TINY, profile=local_profile())
    registry.add(TINY, load_model(TINY))
    steps, messages = [], []
    view = run_model_comparison(
        registry,
        [TINY, "tiny-llama"],
        text=SCENARIO,
        field="order_status",
        new="pending",
        progress=lambda *s: steps.append(s),
        messages=messages.append,
    )
    assert [row["model"] for row in view.result["models"]] == [TINY, "tiny-llama"]
    assert steps[-1][0] == steps[-1][1] and any("tiny-llama" in m for m in messages)
    assert "| model |" in view.summary and "Mistral" in view.summary
    assert view.share_figure.data and view.metrics_figure.data
    assert registry.loaded()[-1] == "tiny-llama"
    with pytest.raises(AppError, match="1 to 3"):
        run_model_comparison(registry, [], text=SCENARIO, field="order_status", new="pending")


def test_the_models_tab_answers_through_its_endpoint(app_url):
    from gradio_client import Client

    summary, _, _, data = Client(app_url, verbose=False).predict([TINY], SCENARIO, "order_status", "pending", api_name="/compare_models")
    assert [row["model"] for row in data["models"]] == [TINY] and "| model |" in summary
