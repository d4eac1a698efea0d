"""The page's tabs, one module each. Every tab module has one contract: ``build(ctx: TabContext) -> None`` makes its
components inside the page's tab strip, wires their events, and puts what later tabs need on ``ctx``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import gradio as gr

from kvscope.app.page import Page

if TYPE_CHECKING:
    from kvscope.app.tabs.model import ModelLoad
    from kvscope.app.tabs.notes import NotesInputs


@dataclass
class TabContext:
    """What a tab's ``build`` receives: the page and its tab strip, and the parts that tabs built earlier share (each set
    once, by the tab named beside it)."""

    page: Page
    tabs: gr.Tabs
    model: ModelLoad | None = None  # the Model tab's load event (the Notes baseline follows it)
    notes: NotesInputs | None = None  # the Notes tab's scenario, field and new value (Your prompt, Probes, Models use them)
    remedy: gr.Dropdown | None = None  # the Composer's remedy menu (a Notes link carries its choice)
    # wiring that needs the page's own load event (run by kvscope.app.ui once every tab is built)
    on_page_load: list[Callable[[gr.events.Dependency], None]] = field(default_factory=list)

    def shared_notes(self) -> NotesInputs:
        """The Notes tab's inputs, for a tab built after it."""
        if self.notes is None:
            raise RuntimeError("the Notes tab must be built before a tab that uses its scenario")
        return self.notes
