"""The GPU-task wrapper of a ZeroGPU Space (kvscope/app/gpu.py), tested without a GPU: ``spaces.GPU`` replaced by a
recorder, the app launched on a tiny model staged the way a ZeroGPU start-up stages it (issue 40)."""

from __future__ import annotations

import functools
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gradio_client import Client

from benchmarks.app.space_cold_start import PeakRss, announced_profile
from kvscope.app import gpu
from kvscope.app.hosting import HostingError, from_env, public_profile
from kvscope.app.state import ModelRegistry
from kvscope.engine.cache.loaded import SpliceGate
from kvscope.engine.cache.selftest import run_selftest
from kvscope.engine.models import load_model
from kvscope.viz.common import markdown_literal
from tests.app.conftest import SCENARIO, TINY, launched
from tests.app.test_audit_tab import LOG

ROOT = Path(__file__).resolve().parents[2]
ZERO_GPU = {"SPACES_ZERO_GPU": "true"}
# The host's per-request model time (local profile: any model, so the Models tab can compare the tiny one).
HOSTED = {"KVSCOPE_REQUEST_SECONDS": "20"}
MODEL_ENDPOINTS = {  # api name -> arguments: every kind of model-bound endpoint the issue names
    "load_model": (TINY, None),
    "edit": (SCENARIO, "order_status", "pending", ["field_only", "erratum"], 4, -1),
    "knockout": ("4", 4),
    "probe": (SCENARIO, "order_status", "pending", "suffix", "", "", "ablation"),
    "weights": (SCENARIO, "order_status", "pending", ["rome"], 2, -1),
    "compose": (["account_gate"], "", "", "", "seam:2"),
    "keystone": (["account_gate"], "", "", "", "seam:2"),
    "agent": (["account_gate"], "", "", "", "seam:2", 2, False, "adaptive"),
    "audit": (LOG, ["field_only"], 2, 0.05, 0.9, "none", "computed", "kl"),
    "compare_models": ([TINY], SCENARIO, "order_status", "pending"),
    "learn_1": (),
    "benchmark_quick": (),
}


class Recorder:
    """``spaces.GPU`` as a recorder: each call of a decorated task keeps (task name, its duration), then runs it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.decorated = 0

    def GPU(self, task=None, *, duration=None, size=None):  # noqa: N802 (the spaces API's name)
        def decorate(function):
            self.decorated += 1

            @functools.wraps(function)
            def recorded(*args, **kwargs):
                self.calls.append((args[0], duration(*args, **kwargs) if callable(duration) else duration))
                return function(*args, **kwargs)

            return recorded

        return decorate if task is None else decorate(task)

    def names(self) -> list[str]:
        return [name.split(":", 1)[1] for name, _ in self.calls]


def _spaces_with(recorder: Recorder, patch: pytest.MonkeyPatch) -> None:
    """Make ``spaces`` importable with its GPU replaced by the recorder (the real package where installed)."""
    try:
        import spaces
    except ImportError:
        spaces = types.ModuleType("spaces")
        patch.setitem(sys.modules, "spaces", spaces)
    patch.setattr(spaces, "GPU", recorder.GPU, raising=False)


@pytest.fixture(scope="module")
def zero_gpu_app():
    """The explorer as a ZeroGPU Space serves it: the tiny model staged, every model-bound handler a GPU task."""
    from kvscope.app.page import MODEL_GROUP
    from kvscope.app.ui import build_app

    recorder = Recorder()
    with pytest.MonkeyPatch.context() as patch:
        _spaces_with(recorder, patch)
        registry = ModelRegistry(TINY, profile=from_env(public=False, environ=HOSTED))
        started = time.perf_counter()
        registry.stage(torch.device("cpu"))
        stage_s = time.perf_counter() - started
        blocks = build_app(registry)
        handlers = {index: block_fn.fn for index, block_fn in blocks.fns.items()}
        tasks = gpu.gpu_tasks(blocks, registry, environ=ZERO_GPU)
        url = launched(blocks)
        yield SimpleNamespace(
            url=url, registry=registry, recorder=recorder, tasks=tasks, blocks=blocks, handlers=handlers, stage_s=stage_s, group=MODEL_GROUP
        )
        blocks.close()


def test_every_model_bound_handler_and_nothing_else_is_one_gpu_task(zero_gpu_app):
    app = zero_gpu_app
    model_bound = {index for index, block_fn in app.blocks.fns.items() if block_fn.concurrency_id == app.group and block_fn.fn is not None}
    assert app.recorder.decorated == 1  # one decorated function: every handler shares its worker on ZeroGPU
    assert app.tasks.names() == [gpu.task_name(index, app.handlers[index]) for index in sorted(model_bound)]
    for index, block_fn in app.blocks.fns.items():
        if index in model_bound:
            assert block_fn.fn is not app.handlers[index] and block_fn.fn.__wrapped__ is app.handlers[index]
        else:
            assert block_fn.fn is app.handlers[index]
    assert app.registry.device_label == gpu.ZEROGPU_DEVICE


def test_every_model_endpoint_over_the_api_is_recorded_once_within_the_profiles_bound(zero_gpu_app):
    app, request_s = zero_gpu_app, float(HOSTED["KVSCOPE_REQUEST_SECONDS"])
    client = Client(app.url, verbose=False)
    assert app.registry.preparations()[TINY].selftest_s is None  # staged: no self-test before a GPU task
    first_started = time.perf_counter()
    card, info = client.predict(*MODEL_ENDPOINTS["load_model"], api_name="/load_model")[:2]
    first_s = time.perf_counter() - first_started
    prepared = app.registry.preparations()[TINY]
    assert prepared.selftest_s is not None and 0 < prepared.selftest_s <= first_s and prepared.selftest.ok
    assert info["model"]["device"] == gpu.ZEROGPU_DEVICE and markdown_literal(gpu.ZEROGPU_DEVICE) in card
    assert info["model"]["dtype_reason"] == prepared.reason and "first GPU task" in prepared.reason
    for name, arguments in list(MODEL_ENDPOINTS.items())[1:]:
        before = len(app.recorder.calls)
        result = client.predict(*arguments, api_name=f"/{name}")
        if name == "audit":  # a generator handler (the token pass shown first) streams from its one task: its last result
            assert "Recommended:" in result[0] and "Measuring" not in result[0]
        handler = next(block_fn.fn.__wrapped__ for block_fn in app.blocks.fns.values() if block_fn.api_name == name)
        ran = app.recorder.names()[before:]
        assert ran.count(handler.__name__) == 1, (name, ran)
    (first_name, first_duration), *later = app.recorder.calls
    assert first_name.endswith(":on_load_model")
    # Before the first task: the request time, the measured load and the self-test's allowance.
    assert request_s + prepared.load_s < first_duration <= request_s + app.stage_s + gpu.UNMEASURED_SELFTEST_S + 1
    # After it: the request time plus load and self-test, each at most what this test saw them take.
    for name, seconds in later:
        assert request_s + prepared.load_s < seconds <= request_s + app.stage_s + first_s + 1, name


def test_a_worker_forked_later_keeps_the_models_dtype_choice_and_self_test(zero_gpu_app):
    """A fresh process (another ZeroGPU worker) prepares its staged copy from the kept preparation: same dtype and
    reason, the self-test report recorded, not run again."""
    runs = []

    def loader(spec, **options):
        lm = load_model(spec, **options)
        lm.splice_gate = SpliceGate(lambda model: runs.append(spec) or run_selftest(model))
        return lm

    fresh = ModelRegistry(TINY, profile=public_profile(), loader=loader)
    fresh.stage(torch.device("cpu"))
    kept = zero_gpu_app.registry.prepare_staged()  # the first task's preparation (made once, kept)
    assert kept[TINY].selftest is not None
    fresh.record_preparations(kept)
    prepared = fresh.prepare_staged()[TINY]
    assert runs == [] and prepared.selftest is kept[TINY].selftest and prepared.reason == kept[TINY].reason
    assert fresh.get().splice_gate.report(fresh.get()) is kept[TINY].selftest
    assert fresh.prepare_staged() == {TINY: prepared}  # once per process


def test_staging_defers_the_dtype_choice_and_self_test_to_the_first_task():
    registry = ModelRegistry(TINY, profile=public_profile(), dtype="bfloat16")
    lm = registry.stage(torch.device("cpu"))
    staged = registry.preparations()[TINY]
    assert lm.dtype == torch.bfloat16 and staged.dtype == "bfloat16" and staged.selftest_s is None and staged.load_s > 0
    assert lm.splice_gate._report is None
    prepared = registry.prepare_staged()[TINY]
    assert prepared.dtype == "bfloat16" and prepared.reason == staged.reason and prepared.selftest is lm.splice_gate.report(lm)


def test_the_duration_is_the_request_time_plus_the_slowest_staged_preparation():
    from kvscope.app.state import DevicePreparation

    kept = {
        "a": DevicePreparation("a", "bfloat16", "r", load_s=4.2, selftest_s=1.1),
        "b": DevicePreparation("b", "bfloat16", "r", load_s=2.0),  # self-test not measured yet
    }
    assert gpu.task_seconds(30.0, kept) == 30 + 2 + 30  # 2.0 + UNMEASURED_SELFTEST_S beats 4.2 + 1.1
    assert gpu.task_seconds(30.0, {"a": kept["a"]}) == 36  # ceil(35.3)
    assert gpu.task_seconds(None, {}) == gpu.SPACES_DEFAULT_SECONDS


def test_off_zero_gpu_nothing_is_wrapped_and_spaces_is_not_needed(registry, monkeypatch):
    from kvscope.app.ui import build_app

    monkeypatch.setitem(sys.modules, "spaces", None)  # importing it would fail
    blocks = build_app(registry)
    before = {index: block_fn.fn for index, block_fn in blocks.fns.items()}
    for environ in ({}, {"SPACES_ZERO_GPU": "false"}, {"SPACE_ID": "someone/kvscope"}):
        assert gpu.gpu_tasks(blocks, registry, environ=environ) is None
    assert {index: block_fn.fn for index, block_fn in blocks.fns.items()} == before and registry.device_label is None
    with pytest.raises(HostingError, match="spaces package is missing: pip install spaces==0.51.3"):
        gpu.gpu_tasks(blocks, registry, environ=ZERO_GPU)


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build")
def test_a_cpu_build_of_torch_on_zero_gpu_is_refused_naming_the_file_to_remove():
    with pytest.raises(HostingError, match="is a CPU build: remove pre-requirements.txt"):
        gpu.check_cuda_build()


def test_a_cpu_space_takes_the_cpu_wheel_of_the_pinned_torch():
    """pre-requirements.txt (installed by a Space before requirements.txt) names the PyTorch CPU index and the CPU
    build of exactly the torch requirements.txt pins, which then counts as installed."""
    from packaging.requirements import Requirement

    lines = [line.split("#")[0].strip() for line in (ROOT / "pre-requirements.txt").read_text().splitlines()]
    lines = [line for line in lines if line]
    pinned = next(Requirement(line) for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith("torch=="))
    cpu = Requirement(lines[1])
    assert lines[0] == "--extra-index-url https://download.pytorch.org/whl/cpu" and len(lines) == 2
    assert cpu.name == "torch" and str(cpu.specifier) == f"{pinned.specifier}+cpu"
    assert pinned.specifier.contains(str(cpu.specifier).removeprefix("=="))


def test_the_cold_start_helpers_read_the_profile_line_and_sample_memory():
    assert announced_profile("loading\nKVScope hosting profile: public\nready") == "public"
    assert announced_profile("no such line") is None
    import psutil

    sampler = PeakRss(psutil.Process().pid, interval=0.01)
    time.sleep(0.05)
    assert sampler.stop() >= psutil.Process().memory_info().rss * 0.9
