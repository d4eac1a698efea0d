"""Generating after a notebook: tokens run after its entries and stored (:func:`step`), greedy decoding
(:func:`greedy`, :func:`generate`), and the residual stream of tokens run after it (:func:`hidden_states`). A
Notebook's ``step``, ``greedy`` and ``generate`` are these functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace as dataclass_replace

import torch

from kvscope.engine.cache.fused_forward import BranchRun, Continuation, NotebookState, joined, run_notebooks


def _stored(run: BranchRun, continuation: Continuation, segment: str) -> NotebookState:
    """The computed notebook with a continuation's tokens stored as entries (e.g. a generated token)."""
    base = run.notebook
    count = len(continuation.token_ids)
    return dataclass_replace(
        base,
        computed_keys=joined(base.computed_keys, run.keys, slice(None)),
        computed_values=joined(base.computed_values, run.values, slice(None)),
        token_ids=torch.cat([base.token_ids, torch.tensor(continuation.token_ids, dtype=torch.long)]),
        positions=torch.cat([base.positions, torch.tensor(continuation.positions, dtype=torch.long)]),
        segments=base.segments + (segment,) * count,
        visible=torch.cat([base.visible, torch.ones(count, dtype=torch.bool)]),
        log=base.log + (f"{segment} {count} tokens",),
        rope_offsets=torch.cat([base.rope_offsets, torch.full((3, count), continuation.rope_offset)], dim=1),
        spliced=torch.cat([base.spliced, torch.zeros(count, dtype=torch.bool)]),
        rescale=base.rescale,
    )


def step(notebook: NotebookState, token_ids: Sequence[int], segment: str = "question") -> tuple[NotebookState, torch.Tensor]:
    """Run tokens after the context, store them, and return the last token's next-token logits."""
    continuation = Continuation.causal(token_ids, notebook.next_position, [len(token_ids) - 1], notebook.next_rope_offset)
    run = run_notebooks([notebook], [continuation])[0]
    return _stored(run, continuation, segment), run.logits[-1]


def greedy(
    notebook: NotebookState,
    logits: torch.Tensor,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    *,
    draft: Sequence[int] = (),
    on_forward: Callable[[int], None] | None = None,
) -> tuple[NotebookState, list[int]]:
    """Greedy tokens after this notebook, whose next-token ``logits`` are given (e.g. by :func:`step`); returns
    the notebook with them appended (the last one recorded, not run) and the new ids.

    ``draft``: tokens greedy decoding is expected to give (e.g. another state's greedy tokens), checked in one forward
    as speculative decoding checks a draft: the draft's tokens run together, each position's argmax read, and the
    longest run of them greedy decoding reproduces taken at once; decoding goes on a token a time from the first token
    that differs. The tokens are greedy decoding's (the positions' logits are those of one forward, not of one forward
    per token: they may differ in the last bits, as any two forward extents do). ``on_forward``: told each forward's
    new tokens."""
    stops = set(stop_ids)
    current, generated = notebook, []
    checked = list(draft[: max_new_tokens - 1]) if draft and int(logits.argmax()) == draft[0] else []
    if checked:
        ran, checks = _step_all(notebook, checked)
        _told(on_forward, len(checked))
        predicted = [int(logits.argmax()), *(int(row.argmax()) for row in checks)]  # predicted[i]: token i's greedy
        generated = checked[: next((i for i, token in enumerate(checked) if predicted[i] != token or token in stops), len(checked))]
        if len(generated) == len(checked):
            current, logits = ran, checks[-1]
        elif generated:  # the taken tokens run again alone (cheaper than cutting entries off a notebook of any layout)
            current, logits = step(notebook, generated, "generated")
            _told(on_forward, len(generated))
    while len(generated) < max_new_tokens:
        token = int(logits.argmax())
        if token in stops:
            break
        generated.append(token)
        if len(generated) == max_new_tokens:
            return current.append([token], "generated"), generated
        current, logits = step(current, [token], "generated")
        _told(on_forward, 1)
    return current, generated


def _step_all(notebook: NotebookState, token_ids: Sequence[int]) -> tuple[NotebookState, torch.Tensor]:
    """Run tokens after the context in one forward, store them, and return every position's next-token logits."""
    continuation = Continuation.causal(token_ids, notebook.next_position, list(range(len(token_ids))), notebook.next_rope_offset)
    run = run_notebooks([notebook], [continuation])[0]
    return _stored(run, continuation, "generated"), run.logits


def _told(on_forward: Callable[[int], None] | None, tokens: int) -> None:
    if on_forward is not None:
        on_forward(tokens)


def generate(
    notebook: NotebookState, decode_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> tuple[NotebookState, list[int]]:
    """Greedy decoding after ``decode_ids``; returns the notebook with everything appended and the new ids."""
    asked, logits = step(notebook, decode_ids, "question")
    return greedy(asked, logits, max_new_tokens, stop_ids)


def hidden_states(notebook: NotebookState, token_ids: Sequence[int]) -> torch.Tensor:
    """Residual stream (layers + 1, T, hidden) of tokens run after this context (nothing is stored)."""
    run = run_notebooks(
        [notebook], [Continuation.causal(token_ids, notebook.next_position, rope_offset=notebook.next_rope_offset)], hidden_states=True
    )[0]
    return torch.stack(run.hidden_states).float()
