"""Blocks: a span's K/V lifted out of one context (:class:`KVBlock`, e.g. a skill or a picture) and spliced into
another at new positions, keys re-rotated and nothing run but the seam. A Notebook's ``block`` and ``splice`` are
these functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import replace as dataclass_replace

import torch

from kvscope.engine.cache import vision
from kvscope.engine.cache.fused_forward import NotebookState, PendingStep, computed_count
from kvscope.engine.cache.loaded import ModelFingerprint
from kvscope.engine.cache.rope import RopeUnsupported
from kvscope.engine.errors import NotebookError


@dataclass(frozen=True)
class KVBlock:
    """A block's K/V computed once (e.g. a skill), with the positions its keys were rotated for."""

    token_ids: torch.Tensor  # (L,)
    keys: tuple[torch.Tensor, ...]  # per layer (1, kv_heads, L, head_dim)
    values: tuple[torch.Tensor, ...]
    start_position: int
    segments: tuple[str, ...]  # (L,) labels, e.g. "skill:refund_policy" and "field:NAME" inside it
    fingerprint: ModelFingerprint
    rope_offsets: torch.Tensor | None = None  # (3, L) M-RoPE offsets from the positions (None: text, all 0)

    def __post_init__(self) -> None:
        if self.rope_offsets is None:
            object.__setattr__(self, "rope_offsets", torch.zeros(3, len(self.token_ids), dtype=torch.long))

    @property
    def rope_start(self) -> int:
        """The rope position of its first token (temporal axis)."""
        return self.start_position + int(self.rope_offsets[0, 0])

    @property
    def rope_span(self) -> int:
        """How many rope positions it covers: its length, less where an image's patches share positions."""
        rope = self.rope_offsets + torch.arange(self.start_position, self.start_position + len(self))[None]
        return int(rope.max()) + 1 - self.rope_start

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def name(self) -> str:
        """The block's main label (its most frequent segment)."""
        return max(set(self.segments), key=self.segments.count)

    def memory_bytes(self) -> int:
        """Bytes of its K/V tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def block(notebook: NotebookState, segment: str | None = None, positions: Sequence[int] | None = None) -> KVBlock:
    """Extract one contiguous segment's (or these positions') K/V as a reusable block."""
    if positions is not None:
        entries = notebook.entries_at(positions)
    else:
        entries = torch.tensor([i for i in notebook.order.tolist() if notebook.segments[i] == segment], dtype=torch.long)
        if not len(entries):
            raise NotebookError(f"segment {segment!r} is not in the notebook (segments: {sorted(set(notebook.segments))})")
    starts = notebook.positions[entries]
    if not torch.equal(starts, torch.arange(int(starts[0]), int(starts[0]) + len(entries))):
        raise NotebookError("a block must cover consecutive positions")
    vision.rope_positions(notebook.lm, notebook.token_ids[entries].tolist(), 0)  # refuses a block that cuts a picture
    index = entries.to(notebook.lm.device)
    return KVBlock(
        token_ids=notebook.token_ids[entries].clone(),
        keys=tuple(k.index_select(2, index) for k in notebook.keys),
        values=tuple(v.index_select(2, index) for v in notebook.values),
        start_position=int(starts[0]),
        segments=tuple(notebook.segments[i] for i in entries.tolist()),
        fingerprint=notebook.lm.fingerprint,
        rope_offsets=notebook.rope_offsets[:, entries],
    )


def splice(notebook: NotebookState, block: KVBlock, at: int | None = None, seam: int = 0) -> NotebookState:
    """Insert a precomputed block at position ``at`` (default: the end), keys re-rotated, no forward.

    Entries at or after ``at`` move right by the block's length. ``seam`` recomputes the block's first
    tokens against the real prefix (seam repair); a seam as long as the block equals a prefill. Refused
    (:class:`~kvscope.engine.cache.loaded.SpliceLocked`) on a model whose cache self-test failed.
    """
    notebook.lm.splice_gate.require(notebook.lm)
    if block.fingerprint != notebook.lm.fingerprint:
        raise NotebookError(
            f"block {block.name!r} was computed by {block.fingerprint.name} ({block.fingerprint.dtype}), "
            f"not by the loaded {notebook.lm.fingerprint.name} ({notebook.lm.fingerprint.dtype})"
        )
    at = notebook.next_position if at is None else at
    if not 0 <= at <= notebook.next_position:
        raise NotebookError(f"splice position {at} is outside the context (0..{notebook.next_position})")
    if not 0 <= seam <= len(block):
        raise NotebookError(f"seam {seam} must be between 0 and the block length {len(block)}")
    try:
        rotary = notebook.rotary
    except RopeUnsupported as error:
        raise NotebookError(f"cannot splice {block.name!r}: {error}") from error
    if at < notebook.next_position:
        vision.check_boundary(notebook.lm, int(notebook.token_ids[notebook.entries_at([at])[0]]), at)
    rope_at = at + (
        notebook.next_rope_offset if at == notebook.next_position else int(notebook.rope_offsets[0, notebook.entries_at([at])[0]])
    )
    moved = notebook._shifted(at, len(block), f"splicing {block.name!r}", block.rope_span).latest()
    count, done = len(block), computed_count(moved)  # the block joins the computed entries; pending ones follow it
    deltas = torch.full((count,), rope_at - block.rope_start, dtype=torch.long)
    block_keys, block_values = rotary.move(block.keys, block.values, deltas)
    keys = tuple(torch.cat([k, b], dim=2) for k, b in zip(moved.computed_keys, block_keys)) if moved.computed_keys else block_keys
    values = tuple(torch.cat([v, b], dim=2) for v, b in zip(moved.computed_values, block_values)) if moved.computed_values else block_values
    unseen = torch.zeros(count, dtype=torch.bool)  # steps recorded before the splice never see the block
    spliced = dataclass_replace(
        moved,
        computed_keys=keys,
        computed_values=values,
        token_ids=torch.cat([moved.token_ids[:done], block.token_ids, moved.token_ids[done:]]),
        positions=torch.cat([moved.positions[:done], torch.arange(at, at + count), moved.positions[done:]]),
        segments=moved.segments[:done] + block.segments + moved.segments[done:],
        visible=torch.cat([moved.visible[:done], torch.ones(count, dtype=torch.bool), moved.visible[done:]]),
        log=notebook.log + (f"splice {block.name} ({count} tokens) at {at}" + (f", seam {seam}" if seam else ""),),
        pending=tuple(
            PendingStep(step.start + count, step.stop + count, torch.cat([step.sees[:done], unseen, step.sees[done:]]))
            for step in moved.pending
        ),
        rope_offsets=torch.cat(
            [
                moved.rope_offsets[:, :done],
                block.rope_offsets + (rope_at - block.rope_start) - (at - block.start_position),
                moved.rope_offsets[:, done:],
            ],
            dim=1,
        ),
        spliced=torch.cat([moved.spliced[:done], torch.ones(count, dtype=torch.bool), moved.spliced[done:]]),
        rescale=moved.rescale,
    )
    return spliced.recompute(range(at, at + seam))
