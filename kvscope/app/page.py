"""What every tab shares: the server-side state, the per-browser state, how a handler runs (within the request budget,
refusals as toasts, progress on the outputs) and how results are exported.

Events pass their inputs by name (``inputs_kwargs={"text": editor, ...}``): a handler receives keyword arguments, so
no call depends on the order of its inputs, and the API endpoint's parameters carry those names.
"""

from __future__ import annotations

import contextlib
import functools
import html
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import gradio as gr
import plotly.graph_objects as go
import plotly.io

from kvscope.app.handlers.common import AppError, AppNotice, export_files
from kvscope.app.handlers.notes import prepare_baseline
from kvscope.app.state import ExportFolder, ModelRegistry, SessionStore
from kvscope.engine import MessageProgress, StepProgress, bounded, fraction, waits_reported
from kvscope.viz.common import markdown_literal

MODEL_GROUP = "model"  # every model-bound handler shares one queue group
UI_ONLY = {"api_name": False, "concurrency_limit": None}  # event options of a page-only step: no API endpoint, never queued
# Two plots in a row each get half the page from a 1,400 px window (600 px); below that width they wrap to one plot per
# row (704 px at a 1,000 px window) instead of shrinking to 344 px, where no title, tick or legend fits.
PAIRED_PLOT_MIN_WIDTH = 560


def step_progress(progress: gr.Progress) -> StepProgress:
    """A ``(done, total)`` callback drawn on the outputs."""
    return lambda done, total: progress(done / max(total, 1))


def message_progress(progress: gr.Progress) -> MessageProgress:
    """A message callback drawn on the outputs. Gradio shows a description only beside a progress level: a message
    that says how far its work is (``kvscope.engine.StepMessage``) moves the bar, any other shows at 0."""
    return lambda message: progress(fraction(message) or 0.0, desc=str(message))


def user_error(error: Exception) -> gr.Error:
    """A refusal as a Gradio toast: the message escaped (toasts render HTML), no server traceback."""
    return gr.Error(html.escape(str(error), quote=False), print_exception=False)


def notice(given: AppNotice) -> str:
    """Cancelled work or input not given yet, as information rather than a failure: a toast (info, or warning where there
    is something to do), and the sentence (Markdown) for the panel its result would have filled."""
    said = str(given)
    said = said[:1].upper() + said[1:]
    (gr.Warning if given.warning else gr.Info)(html.escape(said, quote=False))
    return f"{'⚠️' if given.warning else 'ℹ️'} {markdown_literal(said)}"


def plot_figure(plot, index: int) -> go.Figure | None:
    """A plot component's value as a figure (None when empty), with a clear error for one that is not a plot."""
    if plot is None or getattr(plot, "type", None) != "plotly":
        return None
    try:
        return plotly.io.from_json(plot.plot)
    except (ValueError, TypeError) as error:
        raise AppError(
            f"plot {index + 1} of this export is not a valid plotly figure ({type(error).__name__}); re-run to redraw it"
        ) from error


@dataclass
class Page:
    """What every tab shares: the server-side state and the per-browser state (a session id, the model spec)."""

    registry: ModelRegistry
    sessions: SessionStore
    exports: ExportFolder
    session: gr.State
    spec: gr.State

    def session_id(self, session: str | None) -> str:
        """The browser's session id, minted on its first action."""
        return session or self.sessions.new_id()

    def bounded(self):
        """The hosting profile's per-request budget, taking turns with other requests at the registry's gate."""
        return bounded(self.registry.profile.work_budget, self.registry.gate)

    def action(self, function: Callable) -> Callable:
        """A UI handler run within the request budget, with :class:`AppError` shown as a toast; the session stays usable.
        A handler given a progress tracker shows on it what it waits for at the model's gate; a generator handler (a
        result shown while work goes on) runs each of its steps so."""

        def within(args: tuple, kwargs: dict) -> contextlib.ExitStack:
            tracker = next((value for value in (*args, *kwargs.values()) if isinstance(value, gr.Progress)), None)
            stack = contextlib.ExitStack()
            stack.enter_context(self.bounded())
            stack.enter_context(waits_reported(message_progress(tracker) if tracker else None))
            return stack

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            try:
                with within(args, kwargs):
                    return function(*args, **kwargs)
            except AppError as error:
                raise user_error(error) from error

        @functools.wraps(function)
        def steps(*args, **kwargs):
            """A generator handler: each step to its next yield within the budget (gradio may run each step on another
            thread, so no context spans a yield)."""
            running = function(*args, **kwargs)
            while True:
                try:
                    with within(args, kwargs):
                        shown = next(running)
                except StopIteration:
                    return
                except AppError as error:
                    raise user_error(error) from error
                yield shown

        return steps if inspect.isgeneratorfunction(function) else wrapper

    def model_bound(self, **options) -> dict:
        """Event options of a handler that uses a shared model: one queue group, as many in flight as the profile
        allows (their forwards take turns at the gate)."""
        return {"concurrency_id": MODEL_GROUP, "concurrency_limit": self.registry.profile.concurrency, **options}

    def prepare_message(self, spec: str | None, text: str) -> str:
        """Prefill the editor's scenario at its old values; the current decision, or why it cannot be prepared."""
        try:
            with self.bounded():
                return prepare_baseline(self.registry, spec, text)
        except AppError as error:
            return f"⚠️ {markdown_literal(str(error))}"

    def then_prepare(self, event, editor: gr.Code, baseline: gr.Markdown):
        """After ``event``, prefill the editor's scenario at its old values and state the current decision there."""
        return event.then(
            lambda spec, text: self.prepare_message(spec, text),
            inputs_kwargs={"spec": self.spec, "text": editor},
            outputs=baseline,
            api_name=False,
            **self.model_bound(),
        )

    def export_on(
        self,
        button: gr.Button,
        stem: str,
        *,
        result: gr.JSON,
        plots: Mapping[str, gr.Plot],
        files: gr.File,
        api_name: str,
        views: Mapping[str, gr.HTML] | None = None,
        recipe: gr.State | None = None,
    ) -> None:
        """``button`` exports ``result`` with its plots (and HTML views) as files; with the ``recipe`` that computed it, also
        a script and a notebook that rerun it. The endpoint's parameters: the result, then each plot and view by name."""
        views = dict(views or {})

        def export(result, recipe=None, **shown):
            figures = [plot_figure(shown[name], index) for index, name in enumerate(plots)]
            parts = [shown[name] for name in views if shown[name]]
            return export_files(self.exports, result, figures, stem, parts, recipe)

        inputs = {"result": result, **({"recipe": recipe} if recipe is not None else {}), **plots, **views}
        button.click(self.action(export), inputs_kwargs=inputs, outputs=files, api_name=api_name, concurrency_limit=None)
