"""One fused forward for several forks of a notebook: the planner behind every deferred computation.

A :class:`Notebook` records *pending steps* instead of computing K/V at once; a read, a K/V access or a
generation step hands its forks and their continuations (a question, answer branches, generated tokens) to
:func:`run_together`, which lays every fork's new tokens side by side in one forward. Each row attends to
the shared computed entries its step saw, to its own fork's earlier new tokens, and to nothing of the other
forks, so fusing is exact: a token's K/V depend only on the entries it attends to. The rows of a fork that reads its
spliced entries through APE's rescaled attention (``Notebook.rescaled``) are rescaled, the other forks' rows are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from typing import Protocol

import torch

from kvscope.engine.cache import adapter, vision
from kvscope.engine.cache.budget import compute_slot, forward_token_limit
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.rope import Rotary
from kvscope.engine.errors import NotebookError


@dataclass(frozen=True)
class PendingStep:
    """Entries [start, stop) recorded but not computed yet; their tokens see the earlier entries in ``sees``
    (and each other), causally by position."""

    start: int
    stop: int
    sees: torch.Tensor  # (start,) bool, CPU


@dataclass(frozen=True)
class Knockout:
    """Hide cache positions from the decision tokens in some layers and query heads (None = all)."""

    positions: tuple[int, ...]
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None


class NotebookState(Protocol):
    """What the planner, reading (:mod:`kvscope.engine.cache.reading`), generation (:mod:`kvscope.engine.cache.generation`), blocks
    (:mod:`kvscope.engine.cache.blocks`) and the Jupyter view (:func:`kvscope.engine.cache.display.notebook_view`) use of a notebook
    (``kvscope.engine.cache.notebook.Notebook``, a dataclass they copy with ``dataclasses.replace``): these modules are the
    notebook's private half and never import it."""

    lm: LoadedModel
    computed_keys: tuple[torch.Tensor, ...]
    computed_values: tuple[torch.Tensor, ...]
    token_ids: torch.Tensor
    positions: torch.Tensor
    segments: tuple[str, ...]
    visible: torch.Tensor
    pending: tuple[PendingStep, ...]
    rope_offsets: torch.Tensor
    spliced: torch.Tensor
    rescale: adapter.AttentionRescale | None
    log: tuple[str, ...]

    @property
    def pending_tokens(self) -> int: ...
    @property
    def next_position(self) -> int: ...
    @property
    def next_rope_offset(self) -> int: ...
    @property
    def order(self) -> torch.Tensor: ...
    @property
    def keys(self) -> tuple[torch.Tensor, ...]: ...
    @property
    def values(self) -> tuple[torch.Tensor, ...]: ...
    @property
    def rotary(self) -> Rotary: ...
    def __len__(self) -> int: ...
    def latest(self) -> "NotebookState": ...
    def materialized(self) -> "NotebookState": ...
    def _remember(self, computed: "NotebookState") -> None: ...
    def computation(self) -> tuple: ...
    def entries_at(self, positions: Sequence[int]) -> torch.Tensor: ...
    def _shifted(self, from_position: int, delta: int, reason: str, rope_delta: int | None = None) -> "NotebookState": ...
    def append(self, token_ids: Sequence[int], segment: str | Sequence[str] = "context") -> "NotebookState": ...
    def recompute(self, positions: Sequence[int]) -> "NotebookState": ...
    def blocked_masks(self, knockouts: Knockout | Sequence[Knockout] | None) -> dict[int, torch.Tensor]: ...


@dataclass(frozen=True)
class Continuation:
    """Tokens run after a notebook's entries without being stored (a question, answer continuations)."""

    token_ids: list[int]
    positions: list[int]
    sees: torch.Tensor  # (T, T) bool: which continuation tokens each one sees (causal by position on top)
    logit_rows: list[int]  # rows whose next-token logits are kept
    knockout: Knockout | Sequence[Knockout] | None = None
    captured_rows: list[int] = field(default_factory=list)  # rows whose attention is kept when capturing
    rope_offset: int = 0  # rope position − position on every M-RoPE axis (text after an image, kvscope.engine.cache.vision)

    @classmethod
    def causal(cls, token_ids: Sequence[int], start: int, logit_rows: Sequence[int] = (), rope_offset: int = 0) -> "Continuation":
        """Plain tokens at ``start``, ``start + 1``, ... each seeing the earlier ones."""
        count = len(token_ids)
        return cls(
            list(token_ids),
            list(range(start, start + count)),
            torch.ones(count, count, dtype=torch.bool),
            list(logit_rows),
            rope_offset=rope_offset,
        )


@dataclass
class BranchRun:
    """One notebook's share of a fused forward: itself computed, and what its continuation produced."""

    notebook: NotebookState  # no pending steps
    keys: list[torch.Tensor]  # per layer (1, kv_heads, T, head_dim): the continuation's K/V
    values: list[torch.Tensor]
    logits: torch.Tensor  # (len(logit_rows), vocab) float32
    attentions: dict[int, torch.Tensor]  # layer -> (heads, captured rows, entries + T), entries in storage order
    hidden_states: tuple[torch.Tensor, ...] | None  # per layer (T, hidden), when asked


def computed_in_chunks(notebook: NotebookState, limit: int) -> NotebookState:
    """The notebook with its pending tokens computed ``limit`` at a time until at most ``limit`` remain: exact,
    like a chunked prefill (a later chunk sees the earlier ones of its step as stored entries)."""
    while notebook.pending_tokens > limit:
        stop = computed_count(notebook) + limit
        first, rest = [], []
        for step in notebook.pending:
            if step.stop <= stop:
                first.append(step)
            elif step.start < stop:
                first.append(PendingStep(step.start, stop, step.sees))
                rest.append(PendingStep(stop, step.stop, torch.cat([step.sees, torch.ones(stop - step.start, dtype=torch.bool)])))
            else:
                rest.append(step)
        head = dataclass_replace(
            notebook,
            token_ids=notebook.token_ids[:stop],
            positions=notebook.positions[:stop],
            segments=notebook.segments[:stop],
            visible=notebook.visible[:stop],
            pending=tuple(first),
            rope_offsets=notebook.rope_offsets[:, :stop],
            spliced=notebook.spliced[:stop],
        )
        done = run_together([head], [None])[0].notebook
        notebook = dataclass_replace(notebook, computed_keys=done.computed_keys, computed_values=done.computed_values, pending=tuple(rest))
    return notebook


def batches(forks: Sequence[NotebookState], continuations: Sequence[Continuation | None], limit: int) -> list[list[int]]:
    """Indices of forks of one base split into forwards of at most ``limit`` new tokens each (one fork at least)."""
    groups: list[list[int]] = [[]]
    used = 0
    for index, (fork, continuation) in enumerate(zip(forks, continuations)):
        size = fork.pending_tokens + (len(continuation.token_ids) if continuation else 0)
        if groups[-1] and used + size > limit:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += size
    return groups


def computed_count(notebook: NotebookState) -> int:
    """How many of the notebook's entries have K/V already (the rest are pending)."""
    return len(notebook.positions) - notebook.pending_tokens


def forks_by_base(notebooks: Sequence[NotebookState]) -> list[list[int]]:
    """Indices of the notebooks grouped by the computed K/V they share (each group runs in one forward)."""
    groups: dict[tuple, list[int]] = {}
    for index, notebook in enumerate(notebooks):
        latest = notebook.latest()
        key = (computed_count(latest), tuple(id(tensor) for tensor in latest.computed_keys))
        groups.setdefault(key, []).append(index)
    return list(groups.values())


@dataclass
class _FusedInput:
    """Everything one fused forward runs: every fork's new tokens (pending, then continuation) and masks."""

    token_ids: list[int]
    positions: list[int]
    rope_offsets: list[torch.Tensor]  # per fork: (3, new tokens) M-RoPE offsets
    allowed: torch.Tensor  # (Q, computed + Q) bool, causal by position
    logit_rows: list[int]
    captured_rows: list[int]
    blocked: dict[int, torch.Tensor]  # layer -> (heads or 1, Q, computed + Q)
    spans: list[tuple[int, int, int]]  # per fork: (first row, pending tokens, continuation tokens)
    rescales: list[adapter.AttentionRescale | None]  # per row: its fork's APE setting


def fused_input(forks: Sequence[NotebookState], extras: Sequence[Continuation], computed: int) -> _FusedInput:
    """Lay the forks' new tokens side by side: each row sees the shared computed entries its step saw, its own
    fork's earlier new tokens, and nothing of the other forks."""
    sizes = [(len(fork.positions) - computed, len(extra.token_ids)) for fork, extra in zip(forks, extras)]
    total = sum(new + more for new, more in sizes)
    layout = _FusedInput([], [], [], torch.zeros(total, computed + total, dtype=torch.bool), [], [], {}, [], [])
    offset = 0
    for fork, extra, (new, more) in zip(forks, extras, sizes):
        layout.token_ids += fork.token_ids[computed:].tolist() + extra.token_ids
        layout.positions += fork.positions[computed:].tolist() + extra.positions
        layout.rope_offsets += [fork.rope_offsets[:, computed:], torch.full((3, more), extra.rope_offset)]
        own = computed + offset  # column of the fork's first new token
        for step in fork.pending:
            first, last = offset + step.start - computed, offset + step.stop - computed
            layout.allowed[first:last, :computed] = step.sees[:computed]
            layout.allowed[first:last, own : own + step.start - computed] = step.sees[computed:]
            layout.allowed[first:last, computed + first : computed + last] = True
        rows = slice(offset + new, offset + new + more)
        layout.allowed[rows, :computed] = fork.visible[:computed]
        layout.allowed[rows, own : own + new] = fork.visible[computed:]
        layout.allowed[rows, own + new : own + new + more] = extra.sees
        layout.logit_rows += [offset + new + row for row in extra.logit_rows]
        layout.captured_rows += [offset + new + row for row in extra.captured_rows]
        for layer, mask in fork.blocked_masks(extra.knockout).items():  # knockouts act on the continuation only
            full = torch.zeros(mask.shape[0], total, computed + total, dtype=torch.bool)
            full[:, rows, :computed] = mask[:, None, :computed]
            full[:, rows, own : own + new] = mask[:, None, computed:]
            layout.blocked[layer] = layout.blocked[layer] | full if layer in layout.blocked else full
        layout.spans.append((offset, new, more))
        layout.rescales += [fork.rescale] * (new + more)
        offset += new + more
    positions = torch.cat([forks[0].positions[:computed], torch.tensor(layout.positions, dtype=torch.long)])
    layout.allowed &= positions[None, :] <= positions[computed:, None]
    return layout


def run_notebooks(notebooks: Sequence[NotebookState], continuations: Sequence[Continuation | None], **options) -> list[BranchRun]:
    """Run notebooks with their continuations: forks of one computed base share a forward
    (:func:`kvscope.engine.cache.fused_forward.run_together`), each forward within the new-token limit (longer pending steps
    computed in chunks first); each pending notebook then remembers its computed twin."""
    limit = forward_token_limit()
    ready = [computed_in_chunks(notebook.latest(), limit) for notebook in notebooks]
    runs: dict[int, BranchRun] = {}
    for group in forks_by_base(ready):
        forks, extras = [ready[i] for i in group], [continuations[i] for i in group]
        for batch in batches(forks, extras, limit):
            chosen = [group[i] for i in batch]
            for index, run in zip(chosen, run_together([ready[i] for i in chosen], [continuations[i] for i in chosen], **options)):
                runs[index] = run
    for index, notebook in enumerate(notebooks):
        notebook._remember(runs[index].notebook)
    return [runs[index] for index in range(len(notebooks))]


def run_together(
    notebooks: Sequence[NotebookState],
    continuations: Sequence[Continuation | None],
    *,
    capture: bool = False,
    grad: bool = False,
    hidden_states: bool = False,
) -> list[BranchRun]:
    """One forward for several forks of one computed notebook: each fork's pending steps, then its continuation.

    Each run's ``notebook`` is its fork computed (see :func:`fused_input` for the masks); the caller decides
    whether the fork remembers it.
    """
    if len(forks_by_base(notebooks)) != 1:
        raise NotebookError("notebooks run together must be forks of one computed notebook")
    forks = [notebook.latest() for notebook in notebooks]
    extras = [continuation or Continuation([], [], torch.zeros(0, 0, dtype=torch.bool), []) for continuation in continuations]
    ends = [int(fork.positions.max()) + 1 for fork in forks if len(fork.positions)] + [
        max(extra.positions) + 1 for extra in extras if extra.positions
    ]
    with compute_slot(max(ends, default=0)):  # the context's length; planning and joining take the turn too
        return _run_together(forks, extras, capture=capture, grad=grad, hidden_states=hidden_states)


def _run_together(
    forks: list[NotebookState], extras: list[Continuation], *, capture: bool, grad: bool, hidden_states: bool
) -> list[BranchRun]:
    base, computed = forks[0], computed_count(forks[0])
    layout = fused_input(forks, extras, computed)
    device = base.lm.device
    width = layout.allowed.shape[1]
    seen = layout.allowed[:, :computed].any(0).nonzero()[:, 0]  # computed entries some new token attends to
    kept = torch.cat([seen, torch.arange(computed, width)])  # the forward's keys, as layout columns
    stored_keys, stored_values, allowed, blocked = list(base.computed_keys), list(base.computed_values), layout.allowed, layout.blocked
    if len(seen) < computed:  # unseen entries (e.g. a stale context's tokens after its field) would cost attention for nothing
        index = seen.to(device)
        stored_keys, stored_values = [k.index_select(2, index) for k in stored_keys], [v.index_select(2, index) for v in stored_values]
        allowed, blocked = allowed[:, kept], {layer: mask[..., kept] for layer, mask in blocked.items()}
    token_ids, positions = (
        torch.tensor(layout.token_ids, dtype=torch.long, device=device),
        torch.tensor(layout.positions, dtype=torch.long, device=device),
    )
    rope = positions[None] + torch.cat(layout.rope_offsets, dim=1).to(device) if vision.uses_mrope(base.lm.model) else None
    result = adapter.forward(
        base.lm.model,
        stored_keys,
        stored_values,
        base.positions[seen].to(device),
        token_ids,
        positions,
        allowed.to(device),
        rope_positions=rope,
        inputs_embeds=vision.input_embeddings(base.lm, token_ids),
        blocked={layer: mask.to(device) for layer, mask in blocked.items()},
        capture_rows=torch.tensor(layout.captured_rows, dtype=torch.long, device=device) if capture else None,
        logit_rows=torch.tensor(layout.logit_rows, dtype=torch.long, device=device),
        hidden_states=hidden_states,
        grad=grad,
        rescale=_rescale_plan(layout.rescales, base.spliced[seen]),
    )
    attentions = {layer: _widened(weights, kept.to(device), width) for layer, weights in result.attentions.items()}
    runs, logit_row, captured_row = [], 0, 0
    for fork, extra, (offset, new, more) in zip(forks, extras, layout.spans):
        mine, theirs = slice(offset, offset + new), slice(offset + new, offset + new + more)
        done = fork
        if fork.pending:
            keys, values = joined(base.computed_keys, result.new_keys, mine), joined(base.computed_values, result.new_values, mine)
            done = dataclass_replace(fork, computed_keys=keys, computed_values=values, pending=())
        columns = torch.cat([torch.arange(computed), torch.arange(computed + offset, computed + offset + new + more)]).to(device)
        captured = slice(captured_row, captured_row + len(extra.captured_rows))
        runs.append(
            BranchRun(
                notebook=done,
                keys=[k[:, :, theirs] for k in result.new_keys],
                values=[v[:, :, theirs] for v in result.new_values],
                logits=result.logits[logit_row : logit_row + len(extra.logit_rows)],
                attentions={layer: weights[:, captured].index_select(-1, columns) for layer, weights in attentions.items()},
                hidden_states=tuple(h[theirs] for h in result.hidden_states) if hidden_states else None,
            )
        )
        logit_row += len(extra.logit_rows)
        captured_row += len(extra.captured_rows)
    return runs


def _rescale_plan(rescales: Sequence[adapter.AttentionRescale | None], context: torch.Tensor) -> adapter.RescalePlan | None:
    """The forward's APE block (None where no fork rescales): the rows of rescaling forks, their settings, and the
    ``context`` entries (spliced, among the stored entries run) they read through it."""
    rows = [row for row, rescale in enumerate(rescales) if rescale is not None]
    if not rows:
        return None
    settings = torch.tensor([[rescales[row].temperature, rescales[row].scale] for row in rows], dtype=torch.float32)
    return adapter.RescalePlan(torch.tensor(rows), torch.nonzero(context).flatten(), settings[:, 0], settings[:, 1])


def _widened(weights: torch.Tensor, columns: torch.Tensor, width: int) -> torch.Tensor:
    """Attention (heads, rows, keys run) over every layout column: 0 where an unseen entry was left out."""
    if weights.shape[-1] == width:
        return weights
    return weights.new_zeros(*weights.shape[:-1], width).index_copy_(-1, columns, weights)


def joined(computed: tuple[torch.Tensor, ...], new: list[torch.Tensor], part: slice) -> tuple[torch.Tensor, ...]:
    """Per layer: the computed K (or V) followed by the ``part`` of a forward's new ones."""
    if not computed:
        return tuple(tensor[:, :, part] for tensor in new)
    return tuple(torch.cat([old, tensor[:, :, part]], dim=2) for old, tensor in zip(computed, new))
