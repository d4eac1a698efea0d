"""Learn: the classroom walkthrough on the notes demo, one button per step."""

from __future__ import annotations

import functools

import gradio as gr

from kvscope.app.handlers.learn import learn_step
from kvscope.app.tabs import TabContext
from kvscope.engine import DEFAULT_REMEDY
from kvscope.viz.learn import FIGURE_LABELS
from kvscope.viz.text import remedy_words

LEARN_STEPS = (
    (
        "1 · The notebook",
        "A prefilled context is a *notebook*: every token's keys and values, its position and its segment. "
        "Reading a decision scores each answer after the question. Run the demo with the old and the new value of its field.",
    ),
    (
        "2 · Does editing the field alone work?",
        "Recompute only the field's K/V (`field_only`) and compare with recomputing "
        "everything after it (`full_downstream`). Where the model wrote its conclusion onto later tokens — its notes — the "
        "field-only edit keeps reading the stale notes. The result below says how much of this decision the loaded model "
        "keeps in its notes, beside the paper's figures for larger models.",
    ),
    (
        "3 · The erratum",
        "Append one salient line — `[STATE UPDATE] field -> new; overrides any earlier value and conclusion` — "
        "instead of touching the prefix. It is append-only, so a server's prefix cache stays valid.",
    ),
    (
        "4 · Splicing skills",
        "Compute a skill's K/V once, rotate its keys to new positions (values carry no position) and splice it "
        f"into a context, repaired by the composer's default remedy `{DEFAULT_REMEDY.name}`: {remedy_words(DEFAULT_REMEDY.as_dict())}. "
        "The result says how many of the skill's tokens that recomputed. Compare with a full recompute.",
    ),
)


def build(ctx: TabContext) -> None:
    """The Learn tab."""
    page = ctx.page

    def on_step(index: int, session, spec):
        sid = page.session_id(session)
        return (*learn_step(page.registry, page.sessions, index, session=sid, spec=spec), sid)

    with gr.Tab("Learn", id="learn"):
        for index, (title, text) in enumerate(LEARN_STEPS):
            with gr.Group():
                gr.Markdown(f"### {title}\n{text}")
                button = gr.Button(f"Run step {index + 1}", elem_id=f"learn-{index + 1}")
                result_md = gr.HTML(elem_id=f"learn-{index + 1}-result")
                result_plot = gr.Plot(label=FIGURE_LABELS[index], elem_id=f"learn-{index + 1}-plot")
            button.click(
                page.action(functools.partial(on_step, index)),
                inputs_kwargs={"session": page.session, "spec": page.spec},
                outputs=[result_md, result_plot, page.session],
                api_name=f"learn_{index + 1}",
                **page.model_bound(),
            )
