"""GPU tasks: on a ZeroGPU Space every model-bound endpoint runs as one, lent a GPU for its call.

ZeroGPU (``SPACES_ZERO_GPU`` set; an H200 slice) gives CUDA only inside functions decorated with
``spaces.GPU(duration=…)`` and runs them in a worker process forked from the server, which it reuses while it
stays idle on the same GPU. So:

- ``spaces`` is imported before anything touches CUDA (:func:`import_spaces`: it patches torch at import);
- the default model is staged at start-up (:meth:`kvscope.app.state.ModelRegistry.stage`: weights moved to the device
  outside any task, the way ZeroGPU asks) and made ready in the first task (its dtype chosen on the device, its
  self-test run: :meth:`~kvscope.app.state.ModelRegistry.prepare_staged`);
- one decorated function runs every model-bound handler by name (:class:`GpuTasks`), so that they share one
  worker and the models, sessions and results it keeps; its duration is the profile's model time per request
  plus the slowest staged model's load and self-test (:func:`task_seconds`);
- :func:`gpu_tasks` routes a built explorer's model-bound handlers (its ``MODEL_GROUP`` queue group) through it.

Off ZeroGPU nothing is wrapped and ``spaces`` is never imported. docs/hosting-spaces.md says how to host both kinds.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the hosting layer imports no torch before spaces has patched it
    import gradio as gr

    from kvscope.app.state import DevicePreparation, ModelRegistry

ZEROGPU_DEVICE = "ZeroGPU (H200 slice), lent per request"
SPACES_DEFAULT_SECONDS = 60.0  # spaces.GPU's own duration, for a profile without a per-request model time
UNMEASURED_SELFTEST_S = 30.0  # a staged model's self-test before a task has measured it (seconds on a cold worker)


def on_zero_gpu(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs on a ZeroGPU Space (``SPACES_ZERO_GPU`` true, as the spaces package reads it)."""
    environ = os.environ if environ is None else environ
    return environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")


def import_spaces() -> Any:
    """The spaces package, imported before anything touches CUDA (it patches torch at import); refused by name
    where it is missing."""
    try:
        import spaces
    except ImportError as error:
        from kvscope.app.hosting import HostingError

        raise HostingError("SPACES_ZERO_GPU is set but the spaces package is missing: pip install spaces==0.51.3") from error
    return spaces


def check_cuda_build() -> None:
    """Refuse a CPU build of torch on ZeroGPU (a CPU Space's pre-requirements.txt left in a ZeroGPU Space)."""
    import torch

    from kvscope.app.hosting import HostingError

    if torch.version.cuda is None:
        raise HostingError(
            f"SPACES_ZERO_GPU is set but torch {torch.__version__} is a CPU build: remove pre-requirements.txt "
            "(it names the CPU wheel index, for a CPU Space) so that requirements.txt installs the CUDA build"
        )


def task_seconds(request_seconds: float | None, preparations: Mapping[str, DevicePreparation]) -> int:
    """A GPU task's duration: the model time per request (spaces' default where the profile sets none) plus the
    slowest staged model's load and self-test (an unmeasured self-test counted as ``UNMEASURED_SELFTEST_S``)."""
    preparing = max(
        (done.load_s + (UNMEASURED_SELFTEST_S if done.selftest_s is None else done.selftest_s) for done in preparations.values()),
        default=0.0,
    )
    return math.ceil((SPACES_DEFAULT_SECONDS if request_seconds is None else request_seconds) + preparing)


class GpuTasks:
    """Model-bound handlers run by name in one function decorated by ``decorate`` (``spaces.GPU``): each call makes
    the staged models ready first, and hands every model's preparation back to this process (a ZeroGPU task runs
    in a forked worker), so later durations and later workers keep them."""

    def __init__(self, registry: ModelRegistry, decorate: Callable[..., Callable]) -> None:
        self.registry = registry
        self._handlers: dict[str, Callable] = {}
        self._run = decorate(duration=self.duration)(self._task)

    def duration(self, name: str, args: tuple, kwargs: dict) -> int:
        """The duration of one call (spaces calls this with the task's own arguments)."""
        return task_seconds(self.registry.profile.request_seconds, self.registry.preparations())

    def wrap(self, name: str, handler: Callable) -> Callable:
        """``handler`` run as the GPU task ``name`` (its signature kept, so Gradio still injects progress); a generator
        handler (a result shown while work goes on) stays one, each of its results streamed from the task."""
        if name in self._handlers:
            raise ValueError(f"GPU task {name!r} is already registered")
        self._handlers[name] = handler

        def results(args: tuple, kwargs: dict) -> Iterator[Any]:
            for value, preparations in self._run(name, args, kwargs):
                self.registry.record_preparations(preparations)
                yield value

        @functools.wraps(handler)
        def in_gpu_task(*args, **kwargs):
            *_, value = results(args, kwargs)
            return value

        @functools.wraps(handler)
        def steps_in_gpu_task(*args, **kwargs):
            yield from results(args, kwargs)

        return steps_in_gpu_task if inspect.isgeneratorfunction(handler) else in_gpu_task

    def names(self) -> list[str]:
        """The registered task names, in registration order."""
        return list(self._handlers)

    def _task(self, name: str, args: tuple, kwargs: dict) -> Iterator[tuple[Any, dict[str, DevicePreparation]]]:
        """The one decorated function, a generator (spaces streams what it yields): a generator handler's every
        result, any other handler's one, each with the models' preparations."""
        preparations = self.registry.prepare_staged()
        handler = self._handlers[name]
        values = handler(*args, **kwargs) if inspect.isgeneratorfunction(handler) else (handler(*args, **kwargs),)
        for value in values:
            yield value, preparations


def task_name(fn_index: int, fn: Callable) -> str:
    """A GPU task's name: the event's index in the Blocks and its handler's name."""
    return f"{fn_index}:{getattr(fn, '__name__', type(fn).__name__)}"


def gpu_tasks(blocks: gr.Blocks, registry: ModelRegistry, environ: Mapping[str, str] | None = None) -> GpuTasks | None:
    """On ZeroGPU, route every model-bound handler of ``blocks`` through one GPU task and name the device on the Model
    card; elsewhere change nothing (None)."""
    if not on_zero_gpu(environ):
        return None
    from kvscope.app.page import MODEL_GROUP

    tasks = GpuTasks(registry, import_spaces().GPU)
    registry.device_label = ZEROGPU_DEVICE
    for index, block_fn in blocks.fns.items():
        if block_fn.concurrency_id == MODEL_GROUP and block_fn.fn is not None:
            block_fn.fn = tasks.wrap(task_name(index, block_fn.fn), block_fn.fn)
    return tasks
