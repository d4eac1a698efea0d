"""The vLLM plugin of the LMCache CacheBlend arm, against stand-ins for vLLM's worker and LMCache's tracker."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

PLUGIN = Path(__file__).parents[3] / "benchmarks" / "serving" / "lmcache_blend" / "kvscope_lmcache_blend.py"


class Worker:
    """vLLM's GPU worker, reduced to what the plugin touches."""

    def __init__(self) -> None:
        self.model_runner = types.SimpleNamespace(get_model=lambda: "the loaded model")

    def load_model(self, *, load_dummy_weights: bool = False) -> str:
        return f"loaded (dummy={load_dummy_weights})"


def _fake_modules(monkeypatch) -> dict:
    registered = {}
    tracker = types.SimpleNamespace(register_model=lambda name, model: registered.setdefault(name, model))
    modules = {
        "lmcache.integration.vllm.utils": types.SimpleNamespace(ENGINE_NAME="vllm-instance"),
        "lmcache.v1.compute.models.utils": types.SimpleNamespace(VLLMModelTracker=tracker),
        "vllm.v1.worker.gpu_worker": types.SimpleNamespace(Worker=Worker),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(Worker, "load_model", Worker.load_model)  # restored after the test
    return registered


def _plugin():
    spec = importlib.util.spec_from_file_location("kvscope_lmcache_blend", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loading_the_model_registers_it_under_lmcaches_engine_name_once(monkeypatch):
    registered = _fake_modules(monkeypatch)
    plugin = _plugin()
    plugin.register()
    wrapped = Worker.load_model
    plugin.register()  # vLLM loads general plugins in every process, possibly more than once
    assert Worker.load_model is wrapped and wrapped.__name__ == "load_model"
    assert Worker().load_model(load_dummy_weights=True) == "loaded (dummy=True)"
    assert registered == {"vllm-instance": "the loaded model"}


def test_the_plugin_is_declared_as_a_vllm_general_plugin():
    import tomllib

    project = tomllib.loads((PLUGIN.parent / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["vllm.general_plugins"] == {"kvscope_lmcache_blend": "kvscope_lmcache_blend:register"}


def test_without_lmcache_the_plugin_leaves_vllm_alone(monkeypatch):
    _fake_modules(monkeypatch)
    original = Worker.load_model
    monkeypatch.setitem(sys.modules, "lmcache.v1.compute.models.utils", None)  # import fails
    _plugin().register()
    assert Worker.load_model is original
