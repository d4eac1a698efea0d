"""Reading a notebook's decision: the question and every answer's continuation run after its entries, its pending
steps in the same forward, and each answer scored.

:func:`read_many` reads several forks of one notebook in one forward (each fork's tokens see only its own entries;
equal forks run once). Fusing is exact: a token's K/V depend only on the entries it attends to, exactly as in a
chunked prefill; the planner of that forward is :mod:`kvscope.engine.cache.fused_forward`. :func:`decision_score` is the
same read as a differentiable scalar, for attribution patching on a notebook :func:`with_grad`. A Notebook's
``read_many``, ``read`` and ``read_prompt`` are these functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace as dataclass_replace
from typing import TYPE_CHECKING

import torch

from kvscope.engine.cache.decision import Decision, answer_logprob, decide, decision_margin, label_scores
from kvscope.engine.cache.fused_forward import BranchRun, Continuation, Knockout, NotebookState, run_notebooks
from kvscope.engine.errors import NotebookError

if TYPE_CHECKING:
    from kvscope.engine.scenario import RenderedPrompt


def _question(
    notebook: NotebookState, decode_ids: Sequence[int], answers: Mapping[str, Sequence[Sequence[int]]], knockout
) -> tuple[Continuation, dict]:
    """The question plus every multi-token answer's continuation as one branch each, and where each
    answer token's log-prob is read: label -> [(answer ids, kept logit row per answer token)]."""
    if not decode_ids:
        raise NotebookError("a decision needs decode tokens (the question); got none")
    start, count = notebook.next_position, len(decode_ids)
    ids, positions, branches, kept = list(decode_ids), list(range(start, start + count)), [], [count - 1]
    layout: dict[str, list[tuple[Sequence[int], list[int]]]] = {}
    for label, sequences in answers.items():
        layout[label] = []
        for answer in sequences:
            rows = [0]
            if len(answer) > 1:
                first = len(ids)
                ids += list(answer[:-1])
                positions += range(start + count, start + count + len(answer) - 1)
                branches.append((first, len(ids)))
                rows += range(len(kept), len(kept) + len(answer) - 1)
                kept += range(first, len(ids))
            layout[label].append((answer, rows))
    sees = torch.zeros(len(ids), len(ids), dtype=torch.bool)
    sees[:, :count] = True
    for first, stop in branches:
        sees[first:stop, first:stop] = True
    return Continuation(ids, positions, sees, kept, knockout, list(range(count)), notebook.next_rope_offset), layout


def _scores(run: BranchRun, layout: dict) -> dict[str, list[torch.Tensor]]:
    """Per-string answer log-probs from a question's kept logits."""
    return {label: [answer_logprob(run.logits, rows, answer) for answer, rows in strings] for label, strings in layout.items()}


def read_many(
    notebooks: Sequence[NotebookState],
    decode_ids: Sequence[int],
    answers: Mapping[str, Sequence[Sequence[int]]],
    *,
    knockout: Knockout | Sequence[Knockout] | None = None,
    capture_attention: bool | Sequence[bool] = False,
    answer_texts: Mapping[str, Sequence[str]] | None = None,
) -> list[Decision]:
    """Read the same question from several forks of one notebook in a single forward.

    Each fork's pending steps and question run together (forks with the same ``computation()`` once;
    forks of different bases, or beyond the new-token limit of a forward, in several forwards); every fork
    is left computed. With
    ``capture_attention`` (for all forks, or one flag per fork) each decision carries the question tokens' attention as (layers, heads,
    decode tokens, stored entries + decode tokens), stored entries in storage order.
    """
    questions = [_question(notebook, decode_ids, answers, knockout) for notebook in notebooks]
    captures = [capture_attention] * len(notebooks) if isinstance(capture_attention, bool) else list(capture_attention)
    computations = [notebook.computation() for notebook in notebooks]
    first_of: dict[tuple, int] = {}
    for index, key in enumerate(computations):
        first_of.setdefault(key, index)
    unique = sorted(set(first_of.values()))
    wanted = {i: any(captures[j] for j, key in enumerate(computations) if first_of[key] == i) for i in unique}
    continuations = [questions[i][0] if wanted[i] else dataclass_replace(questions[i][0], captured_rows=[]) for i in unique]
    unique_runs = run_notebooks([notebooks[i] for i in unique], continuations, capture=any(wanted.values()))
    runs: dict[int, BranchRun] = dict(zip(unique, unique_runs))
    for index, notebook in enumerate(notebooks):
        twin = runs[first_of[computations[index]]]
        if index not in runs:
            done = dataclass_replace(
                notebook.latest(), computed_keys=twin.notebook.computed_keys, computed_values=twin.notebook.computed_values, pending=()
            )
            notebook._remember(done)
            runs[index] = dataclass_replace(twin, notebook=done)
    texts = answer_texts or {label: [str(i) for i in range(len(seqs))] for label, seqs in answers.items()}
    decisions = []
    for run, (_, layout) in zip((runs[i] for i in range(len(notebooks))), questions):
        scores = _scores(run, layout)
        string_logprobs = {label: {text: float(score) for text, score in zip(texts[label], scores[label])} for label in scores}
        decision = decide(string_logprobs, run.logits[0].detach().cpu().clone())  # not a view of every kept row
        if captures[len(decisions)]:
            entries, count = len(run.notebook.positions), len(decode_ids)
            decision.attention = torch.stack([run.attentions[layer][:, :, : entries + count] for layer in sorted(run.attentions)]).cpu()
        decisions.append(decision)
    return decisions


def read(
    notebook: NotebookState,
    decode_ids: Sequence[int],
    answers: Mapping[str, Sequence[Sequence[int]]],
    *,
    knockout: Knockout | Sequence[Knockout] | None = None,
    capture_attention: bool = False,
    answer_texts: Mapping[str, Sequence[str]] | None = None,
) -> Decision:
    """Score each answer's token sequence after ``decode_ids`` (question + assistant header).

    The notebook is not changed (pending steps are computed in the same forward). With
    ``capture_attention`` the decision tokens' attention is kept (see :func:`read_many`).
    """
    return read_many([notebook], decode_ids, answers, knockout=knockout, capture_attention=capture_attention, answer_texts=answer_texts)[0]


def read_prompt(
    notebook: NotebookState, prompt: RenderedPrompt, answer_texts: Mapping[str, Sequence[str]] | None = None, **kwargs
) -> Decision:
    """Read the decision for a rendered scenario's question and answers."""
    return read(notebook, prompt.decode_ids, prompt.answer_ids, answer_texts=answer_texts, **kwargs)


def decision_score(
    notebook: NotebookState,
    decode_ids: Sequence[int],
    answers: Mapping[str, Sequence[Sequence[int]]],
    knockout: Knockout | Sequence[Knockout] | None = None,
) -> torch.Tensor:
    """The decision margin as a differentiable scalar (gradients flow into K/V that require grad)."""
    question, layout = _question(notebook, decode_ids, answers, knockout)
    run = run_notebooks([notebook], [question], grad=True)[0]
    strings = _scores(run, layout).values()
    return decision_margin(torch.stack([label_scores(torch.stack(values)) for values in strings]))


def with_grad(notebook: NotebookState) -> NotebookState:
    """A copy whose K/V are fresh float leaves requiring grad (for attribution patching)."""
    keys = tuple(k.detach().clone().requires_grad_(True) for k in notebook.keys)
    values = tuple(v.detach().clone().requires_grad_(True) for v in notebook.values)
    return dataclass_replace(notebook.materialized(), computed_keys=keys, computed_values=values)
