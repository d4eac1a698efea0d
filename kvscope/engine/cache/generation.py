"""Generating after a notebook: tokens run after its entries and stored (:func:`step`), greedy decoding
(:func:`greedy`, :func:`generate`), and the residual stream of tokens run after it (:func:`hidden_states`). A
Notebook's ``step``, ``greedy`` and ``generate`` are these functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace as dataclass_replace

import torch

from kvscope.engine.cache.fused_forward import BranchRun, Continuation, NotebookState, joined, run_notebooks

# tokens guessed by prompt lookup a forward: on a 0.5B model on 2 CPU cores a decode forward of 1 token took 94 ms, of
# 9 tokens 159 ms, so a wrong guess costs less than the forward it may save (benchmarks/studies/greedy_lookup.py)
LOOKUP_TOKENS = 8


def _stored(run: BranchRun, continuation: Continuation, segment: str, count: int | None = None) -> NotebookState:
    """The computed notebook with a continuation's tokens stored as entries (e.g. a generated token): its first
    ``count`` (default: all; each token's K/V depend only on the tokens before it, so a prefix of them is exact)."""
    base = run.notebook
    count = len(continuation.token_ids) if count is None else count
    return dataclass_replace(
        base,
        computed_keys=joined(base.computed_keys, [k[:, :, :count] for k in run.keys], slice(None)),
        computed_values=joined(base.computed_values, [v[:, :, :count] for v in run.values], slice(None)),
        token_ids=torch.cat([base.token_ids, torch.tensor(continuation.token_ids[:count], dtype=torch.long)]),
        positions=torch.cat([base.positions, torch.tensor(continuation.positions[:count], dtype=torch.long)]),
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
    lookup: int = LOOKUP_TOKENS,
    on_forward: Callable[[int], None] | None = None,
) -> tuple[NotebookState, list[int]]:
    """Greedy tokens after this notebook, whose next-token ``logits`` are given (e.g. by :func:`step`); returns
    the notebook with them appended (the last one recorded, not run) and the new ids.

    Each forward runs the newest greedy token with a guess of the tokens after it, and keeps the longest run of the
    guess that greedy decoding reproduces (speculative decoding's check; the rest of the forward is dropped): the guess
    is ``draft`` (the tokens greedy decoding is expected to give, e.g. another state's), whole, while the tokens so far
    follow it, else up to ``lookup`` tokens that followed the last 2 or 3 tokens where they occur earlier in the draft
    or the context (prompt lookup: a model often copies its context). A right guess of N tokens costs one forward
    instead of N; a wrong one costs its tokens in a forward that runs anyway (decoding reads the weights once a
    forward however many tokens it runs). The tokens are greedy decoding's (the positions' logits are those of one
    forward, not of one forward per token: they may differ in the last bits, as any two forward extents do).
    ``lookup`` 0: no lookup guess. ``on_forward``: told each forward's new tokens."""
    stops = set(stop_ids)
    context = notebook.token_ids
    current, generated = notebook, []
    while True:
        token = int(logits.argmax())
        if token in stops:
            return current, generated
        generated.append(token)
        if len(generated) == max_new_tokens:
            return current.append([token], "generated"), generated
        room = max_new_tokens - len(generated) - 1  # the last token is recorded, not run
        guess = _guess(generated, draft, context, lookup)[:room]
        current, logits, taken = _checked(current, [token, *guess], stops)
        if on_forward is not None:
            on_forward(1 + len(guess))
        generated += guess[:taken]


def _guess(generated: list[int], draft: Sequence[int], context: torch.Tensor, lookup: int) -> list[int]:
    """The tokens expected after ``generated``: the draft's rest while ``generated`` follows it, else up to ``lookup``
    tokens after the latest earlier occurrence of its (or the context's and its) last 3, then 2 tokens, found in the
    draft first, then in the context and ``generated``."""
    count = len(generated)
    if count < len(draft) and list(draft[:count]) == generated:
        return list(draft[count:])
    if lookup <= 0:
        return []
    history = torch.cat([context, torch.tensor(generated, dtype=torch.long)])
    for size in (3, 2):
        if len(history) <= size:
            continue
        tail = history[-size:]
        for corpus in (torch.tensor(list(draft), dtype=torch.long), history[:-1]):
            if len(corpus) <= size:
                continue
            starts = (corpus.unfold(0, size, 1) == tail).all(1).nonzero()[:, 0]
            starts = starts[starts + size < len(corpus)]  # something follows it
            if len(starts):
                first = int(starts[-1]) + size
                return corpus[first : first + lookup].tolist()
    return []


def _checked(notebook: NotebookState, token_ids: list[int], stops: set[int]) -> tuple[NotebookState, torch.Tensor, int]:
    """Run a greedy token and a guess of the tokens after it in one forward: the notebook with the token and the
    guess's longest greedy-reproduced run stored, the next-token logits after them, and that run's length (a stop
    token ends it: greedy decoding would have stopped before running it)."""
    continuation = Continuation.causal(token_ids, notebook.next_position, list(range(len(token_ids))), notebook.next_rope_offset)
    run = run_notebooks([notebook], [continuation])[0]
    predicted = run.logits.argmax(-1).tolist()  # predicted[i]: greedy's token after token_ids[i]
    guess = token_ids[1:]
    taken = next((i for i, token in enumerate(guess) if predicted[i] != token or token in stops), len(guess))
    return _stored(run, continuation, "generated", 1 + taken), run.logits[taken], taken


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
