"""The Notebook: a prefilled context's K/V with per-token metadata; every cache operation goes through it.

Storage is a bag of *entries*: one (key, value) per layer plus token id, absolute position (the one baked
into the key by RoPE), segment label and a visibility flag. Attention depends only on positions and the
mask, not on storage order, so operations never rebuild caches: a recomputed token is appended as a new
entry and its stale entry is hidden. A Notebook is immutable: every operation returns a new one that
shares unchanged tensors, so forking is free.

Computation is deferred: append, replace, recompute, seam repair and the last chunk of a prefill record a
*pending step* (which tokens, and which earlier entries they see), and the next read runs them with the question in
one forward. The notebook's reads, generation and blocks are functions of their own modules (``reading``,
``fused_forward``, ``generation``, ``blocks``; docs/engine.md, "The layers"), its methods their front.

Every entry remembers whether its K/V came from a splice and were never recomputed (``spliced``). A notebook
:meth:`Notebook.rescaled` with APE's setting (:class:`~kvscope.engine.cache.adapter.AttentionRescale`) reads those entries
through the rescaled attention in every forward it runs from then on (pending steps included): the text after
and between spliced blocks, recomputed tokens, the question and generated tokens.

Costs (N stored entries, T tokens computed): prefill/append O(T·N) attention; read O(D·N) for D decode
tokens; replace/recompute/seam repair O(T·N) for the T tokens rewritten; patch and knockout O(1) forwards
beyond the read itself; splice O(L) re-rotation for an L-token block plus the seam.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import replace as dataclass_replace
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from kvscope.engine.cache import adapter, blocks, display, generation, reading, vision
from kvscope.engine.cache.adapter import AttentionRescale
from kvscope.engine.cache.budget import compute_slot
from kvscope.engine.cache.fused_forward import Knockout, PendingStep, run_notebooks
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.rope import RopeUnsupported, Rotary
from kvscope.engine.errors import NotebookError
from kvscope.engine.progress import StepProgress

if TYPE_CHECKING:
    from kvscope.engine.scenario import RenderedPrompt


@dataclass(frozen=True)
class Notebook:
    """K/V of a context plus what each entry is; see the module docstring."""

    lm: LoadedModel
    computed_keys: tuple[torch.Tensor, ...]  # per layer (1, kv_heads, C, head_dim), post-RoPE, C = computed entries
    computed_values: tuple[torch.Tensor, ...]
    token_ids: torch.Tensor  # (N,) int64, CPU
    positions: torch.Tensor  # (N,) int64, CPU
    segments: tuple[str, ...]  # (N,)
    visible: torch.Tensor  # (N,) bool, CPU
    log: tuple[str, ...] = ()
    pending: tuple[PendingStep, ...] = ()  # entries C..N-1, in order
    rope_offsets: torch.Tensor | None = None  # (3, N) int64: rope position − position per M-RoPE axis (None: all 0)
    spliced: torch.Tensor | None = None  # (N,) bool: K/V from a splice, never recomputed (None: none)
    rescale: AttentionRescale | None = None  # APE's attention over the spliced entries in later forwards

    def __post_init__(self) -> None:
        count = len(self.positions)
        if self.rope_offsets is None:
            object.__setattr__(self, "rope_offsets", torch.zeros(3, count, dtype=torch.long))
        elif tuple(self.rope_offsets.shape) != (3, count):
            raise NotebookError(f"rope offsets of shape {tuple(self.rope_offsets.shape)} for {count} entries")
        if self.spliced is None:
            object.__setattr__(self, "spliced", torch.zeros(count, dtype=torch.bool))
        elif tuple(self.spliced.shape) != (count,):
            raise NotebookError(f"splice flags of shape {tuple(self.spliced.shape)} for {count} entries")

    # ---------------------------------------------------------------- construction
    @classmethod
    def empty(cls, lm: LoadedModel) -> "Notebook":
        """A notebook with no entries."""
        none = torch.zeros(0, dtype=torch.long)
        return cls(lm, (), (), none, none, (), torch.zeros(0, dtype=torch.bool))

    @classmethod
    def prefill(
        cls,
        lm: LoadedModel,
        token_ids: Sequence[int],
        segments: Sequence[str] | str = "context",
        *,
        chunk_size: int | None = None,
        start_position: int = 0,
        progress: StepProgress = None,
    ) -> "Notebook":
        """Prefill tokens (in chunks of ``chunk_size`` if given) starting at ``start_position``.

        Every chunk but the last is computed at once; the last stays pending (a read fuses it with the
        question) unless ``progress`` asks to report it.
        """
        ids = list(token_ids)
        labels = [segments] * len(ids) if isinstance(segments, str) else list(segments)
        if len(labels) != len(ids):
            raise NotebookError(f"got {len(labels)} segment labels for {len(ids)} tokens")
        notebook, step = cls.empty(lm), chunk_size or max(len(ids), 1)
        offsets = notebook._offsets_for(ids, start_position, start_position)
        for begin in range(0, len(ids), step):
            end = min(begin + step, len(ids))
            positions = list(range(start_position + begin, start_position + end))
            notebook = notebook._record_pending(ids[begin:end], positions, labels[begin:end], rope_offsets=offsets[:, begin:end])
            if end < len(ids) or progress:
                notebook = notebook.materialized()
            if progress:
                progress(end, len(ids))
        return dataclass_replace(notebook, log=(f"prefill {len(ids)} tokens" + (f" in chunks of {step}" if chunk_size else ""),))

    @staticmethod
    def prefill_layer(lm: LoadedModel, token_ids: Sequence[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values a fresh prefill of ``token_ids`` (from position 0) stores at ``layer``, running only
        the layers up to it; nothing is kept."""
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=lm.device)
        rope = vision.rope_positions(lm, token_ids, 0).to(lm.device) if vision.uses_mrope(lm.model) else None
        with compute_slot(len(token_ids)):
            return adapter.prefill_layer_kv(
                lm.model, ids, torch.arange(len(token_ids), device=lm.device), layer, rope, vision.input_embeddings(lm, ids)
            )

    @classmethod
    def from_prompt(cls, lm: LoadedModel, prompt: RenderedPrompt, **kwargs) -> "Notebook":
        """Prefill a rendered scenario's cached context, with its segment labels."""
        return cls.prefill(lm, prompt.context_ids, prompt.context_segments, **kwargs)

    # ---------------------------------------------------------------- views
    def __len__(self) -> int:
        """Number of visible entries (the context as the model sees it)."""
        return int(self.visible.sum())

    @property
    def next_position(self) -> int:
        """The position a token appended now would take."""
        shown = self.positions[self.visible]
        return int(shown.max()) + 1 if len(shown) else 0

    @property
    def rope_positions(self) -> torch.Tensor:
        """(3, N) positions each entry's key was rotated for (temporal, height, width; equal for text)."""
        return self.positions[None] + self.rope_offsets

    @property
    def next_rope_offset(self) -> int:
        """Rope position − position of a token appended now (non-zero after an image, kvscope.engine.cache.vision)."""
        shown = self.visible
        return int(self.rope_positions[:, shown].max()) + 1 - self.next_position if bool(shown.any()) else 0

    def _offsets_for(self, token_ids: Sequence[int], position: int, rope_position: int) -> torch.Tensor:
        """(3, T) rope offsets of tokens laid out from ``position`` whose first rope position is ``rope_position``."""
        rope = vision.rope_positions(self.lm, token_ids, rope_position)
        return rope - torch.arange(position, position + len(token_ids))[None]

    @property
    def order(self) -> torch.Tensor:
        """Entry indices of visible entries sorted by position: the context in reading order."""
        shown = torch.nonzero(self.visible).flatten()
        return shown[torch.argsort(self.positions[shown])]

    def visible_positions(self, segment: str | None = None) -> list[int]:
        """Positions of visible entries, optionally only those of one segment, in order."""
        return [int(self.positions[i]) for i in self.order if segment is None or self.segments[i] == segment]

    def visible_token_ids(self) -> list[int]:
        """Token ids of the visible context in reading order."""
        return self.token_ids[self.order].tolist()

    def visible_segments(self) -> list[str]:
        """Segment labels of the visible context in reading order."""
        return [self.segments[i] for i in self.order.tolist()]

    def token_texts(self) -> list[str]:
        """Readable text of each visible token, in reading order."""
        tokenizer = self.lm.tokenizer
        return [vision.token_label(self.lm, token) or tokenizer.decode([token]) for token in self.visible_token_ids()]

    @property
    def keys(self) -> tuple[torch.Tensor, ...]:
        """Per-layer keys (1, kv_heads, N, head_dim) of every entry, pending ones computed first."""
        return self.materialized().computed_keys

    @property
    def values(self) -> tuple[torch.Tensor, ...]:
        """Per-layer values of every entry, pending ones computed first."""
        return self.materialized().computed_values

    @property
    def pending_tokens(self) -> int:
        """How many entries still wait for their K/V (computed by the next read or K/V access)."""
        return sum(step.stop - step.start for step in self.pending)

    def materialized(self) -> "Notebook":
        """This notebook with every pending step computed (one forward, remembered)."""
        if not self.pending:
            return self
        if "_computed" not in self.__dict__:
            run_notebooks([self], [None])
        return self.__dict__["_computed"]

    def latest(self) -> "Notebook":
        """The computed twin if a read already computed this notebook, else itself (never recompute twice)."""
        return self.__dict__.get("_computed", self)

    def _remember(self, computed: "Notebook") -> None:
        """Keep the computed twin of a pending notebook, so that nothing is computed twice."""
        if self.pending and computed is not self:
            self.__dict__["_computed"] = computed

    def computation(self) -> tuple:
        """What determines this notebook's K/V: its computed tensors, tokens, positions and what each pending
        step sees. Forks with equal computations hold equal K/V, so a fused read computes them once."""
        latest = self.latest()
        return (
            tuple(id(tensor) for tensor in latest.computed_keys),
            tuple(latest.token_ids.tolist()),
            tuple(latest.positions.tolist()),
            latest.rope_offsets.numpy().tobytes(),
            latest.visible.numpy().tobytes(),
            tuple((step.start, step.stop, step.sees.numpy().tobytes()) for step in latest.pending),
            latest.spliced.numpy().tobytes(),
            latest.rescale,
        )

    def memory_bytes(self) -> int:
        """Bytes held by K/V tensors (shared tensors counted once)."""
        seen: dict[int, int] = {}
        for tensor in (*self.keys, *self.values):
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return sum(seen.values())

    def _repr_html_(self) -> str:
        """Jupyter's view (:func:`kvscope.engine.cache.display.notebook_view`)."""
        return display.notebook_view(self)

    @cached_property
    def rotary(self) -> Rotary:
        """The model's rotary embedding (raises :class:`RopeUnsupported` where keys cannot move)."""
        return Rotary.for_model(self.lm.model)

    def entries_at(self, positions: Sequence[int]) -> torch.Tensor:
        """Entry indices of the visible entries at ``positions``, with a clear error for a missing one."""
        lookup = {int(self.positions[i]): int(i) for i in torch.nonzero(self.visible).flatten()}
        missing = [p for p in positions if int(p) not in lookup]
        if missing:
            shown = sorted(lookup)
            span = f"{shown[0]}–{shown[-1]}" if shown else "none"
            raise NotebookError(f"position {missing[0]} is not in the notebook (visible positions: {span})")
        return torch.tensor([lookup[int(p)] for p in positions], dtype=torch.long)

    # ---------------------------------------------------------------- primitive
    def _record_pending(
        self, token_ids, positions, segments, *, rope_offsets: torch.Tensor, hide: torch.Tensor | None = None, note: str = ""
    ) -> "Notebook":
        """Record tokens at positions (their M-RoPE ``rope_offsets``, (3, T)) to compute over this cache (``hide``
        entries excluded from now on)."""
        base = self.latest()
        visible = base.visible.clone()
        if hide is not None:
            visible[hide] = False
        count, stored = len(token_ids), len(base.positions)
        return Notebook(
            lm=base.lm,
            computed_keys=base.computed_keys,
            computed_values=base.computed_values,
            token_ids=torch.cat([base.token_ids, torch.tensor(list(token_ids), dtype=torch.long)]),
            positions=torch.cat([base.positions, torch.tensor(list(positions), dtype=torch.long)]),
            segments=base.segments + tuple(segments),
            visible=torch.cat([visible, torch.ones(count, dtype=torch.bool)]),
            log=base.log + (note,),
            pending=base.pending + (PendingStep(stored, stored + count, visible),),
            rope_offsets=torch.cat([base.rope_offsets, rope_offsets], dim=1),
            spliced=torch.cat([base.spliced, torch.zeros(count, dtype=torch.bool)]),
            rescale=base.rescale,
        )

    def _shifted(self, from_position: int, delta: int, reason: str, rope_delta: int | None = None) -> "Notebook":
        """Move every entry at ``from_position`` or later by ``delta`` positions, their keys re-rotated by
        ``rope_delta`` (default ``delta``; they differ where an image's patches span fewer rope steps than tokens)."""
        moving = self.positions >= from_position
        rope_delta = delta if rope_delta is None else rope_delta
        if delta == rope_delta == 0 or not bool(moving.any()):
            return self
        try:
            rotary = self.rotary
        except RopeUnsupported as error:
            raise NotebookError(f"{reason} needs to move later tokens, but {error}") from error
        index = torch.nonzero(moving).flatten().to(self.lm.device)
        deltas = torch.full((len(index),), rope_delta, dtype=torch.long)
        keys, values = rotary.move(self.keys, self.values, deltas, index)
        offsets = torch.where(moving[None], self.rope_offsets + rope_delta - delta, self.rope_offsets)
        return dataclass_replace(
            self.materialized(),
            computed_keys=keys,
            computed_values=values,
            positions=torch.where(moving, self.positions + delta, self.positions),
            rope_offsets=offsets,
        )

    # ---------------------------------------------------------------- operations
    def append(self, token_ids: Sequence[int], segment: str | Sequence[str] = "context") -> "Notebook":
        """Prefill tokens after the current context (e.g. an erratum line); one label or one per token."""
        labels = [segment] * len(token_ids) if isinstance(segment, str) else list(segment)
        if not token_ids:
            raise NotebookError(f"nothing to append to segment {segment!r}: no tokens")
        if len(labels) != len(token_ids):
            raise NotebookError(f"got {len(labels)} segment labels for {len(token_ids)} tokens")
        start = self.next_position
        offsets = self._offsets_for(token_ids, start, start + self.next_rope_offset)
        return self._record_pending(
            token_ids,
            range(start, start + len(token_ids)),
            labels,
            rope_offsets=offsets,
            note=f"append {len(token_ids)} tokens as {labels[0]}",
        )

    def replace(self, positions: Sequence[int], token_ids: Sequence[int], segment: str | Sequence[str] | None = None) -> "Notebook":
        """Rewrite a contiguous span with new tokens, recomputing only their K/V against the prefix.

        Later entries keep their (now stale) K/V; a length change moves them by re-rotating their keys.
        ``segment`` labels the new tokens (one label or one per token; default: the span's first label).
        """
        if not positions or not token_ids:
            raise NotebookError("replace needs a non-empty span and non-empty new tokens")
        old = self.entries_at(positions)
        start, length = int(self.positions[old].min()), len(positions)
        if sorted(int(p) for p in positions) != list(range(start, start + length)):
            raise NotebookError(f"replace needs contiguous positions, got {list(positions)}")
        labels = [segment or self.segments[int(old[0])]] * len(token_ids) if segment is None or isinstance(segment, str) else list(segment)
        if len(labels) != len(token_ids):
            raise NotebookError(f"got {len(labels)} segment labels for {len(token_ids)} new tokens")
        in_order = old[torch.argsort(self.positions[old])]
        vision.rope_positions(self.lm, self.token_ids[in_order].tolist(), 0)  # refuses a span that cuts a picture
        first = in_order[0]
        rope_start = int(self.rope_positions[0, first])  # the temporal axis: where a picture or a text token begins
        offsets = self._offsets_for(token_ids, start, rope_start)
        old_span = int(self.rope_positions[:, old].max()) + 1 - rope_start
        new_span = int((offsets + torch.arange(start, start + len(token_ids))).max()) + 1 - rope_start
        moved = self._shifted(
            start + length, len(token_ids) - length, f"replacing {length} tokens by {len(token_ids)}", new_span - old_span
        )
        return moved._record_pending(
            token_ids,
            range(start, start + len(token_ids)),
            labels,
            rope_offsets=offsets,
            hide=old,
            note=f"replace {labels[0]} at {start}..{start + length - 1} ({length}→{len(token_ids)} tokens)",
        )

    def recompute(self, positions: Sequence[int]) -> "Notebook":
        """Selective recompute: fresh K/V for these positions against the current cache (CacheBlend-style)."""
        if not len(positions):
            return self
        entries = self.entries_at(sorted(set(int(p) for p in positions)))
        return self._record_pending(
            self.token_ids[entries].tolist(),
            self.positions[entries].tolist(),
            [self.segments[i] for i in entries.tolist()],
            rope_offsets=self.rope_offsets[:, entries],
            hide=entries,
            note=f"recompute {len(entries)} positions",
        )

    def patch(self, donor: "Notebook", positions: Sequence[int], layers: Sequence[int] | None = None) -> "Notebook":
        """Copy the donor's K/V at these positions into this notebook, in the given layers (default all); a patched
        entry stays spliced (read through APE's attention where asked) only where the donor's entry was spliced too."""
        if donor.lm.fingerprint != self.lm.fingerprint:
            raise NotebookError("patch donor comes from another model or dtype")
        mine, theirs = self.entries_at(positions), donor.entries_at(positions)
        if not torch.equal(self.rope_offsets[:, mine], donor.rope_offsets[:, theirs]):
            raise NotebookError(
                "the donor's keys at these positions were rotated for other rope positions (the pictures before "
                "them differ): patch only where both contexts place their pictures alike"
            )
        mine, theirs = mine.to(self.lm.device), theirs.to(self.lm.device)
        chosen = set(range(len(self.keys)) if layers is None else layers)
        bad = [layer for layer in chosen if not 0 <= layer < len(self.keys)]
        if bad:
            raise NotebookError(f"layer {bad[0]} does not exist (model has {len(self.keys)} layers)")

        def patched(own: tuple[torch.Tensor, ...], other: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return tuple(
                own[layer].index_copy(2, mine, other[layer].index_select(2, theirs)) if layer in chosen else own[layer]
                for layer in range(len(own))
            )

        note = f"patch {len(positions)} positions in {len(chosen)} layers from donor"
        done = self.materialized()
        spliced = done.spliced.clone()
        spliced[mine.cpu()] &= donor.spliced[theirs.cpu()]
        return dataclass_replace(
            done,
            computed_keys=patched(self.keys, donor.keys),
            computed_values=patched(self.values, donor.values),
            log=self.log + (note,),
            spliced=spliced,
        )

    def rescaled(self, rescale: AttentionRescale | None) -> "Notebook":
        """This notebook read with APE's attention over its spliced entries (None: plain attention) in every forward
        it runs from now on, its pending steps included; refused where no visible entry was spliced."""
        if rescale is not None and not bool((self.spliced & self.visible).any()):
            raise NotebookError(
                f"APE's rescaled attention ({rescale.name}) reads spliced entries, and this notebook has none: splice a "
                "block first (recomputed or replaced entries are plain context)"
            )
        note = f"attention over spliced entries: {rescale.name}" if rescale else "plain attention over spliced entries"
        return dataclass_replace(self, rescale=rescale, log=self.log + (note,))

    def compact(self) -> "Notebook":
        """Drop hidden entries (frees memory; reading order and results unchanged)."""
        return self._keeping(self.order, f"compact to {len(self.order)} entries")

    def prefix(self, count: int) -> "Notebook":
        """The first ``count`` positions of the context as their own notebook, their K/V shared, no forward: what an
        exact prefix cache keeps of this context for a request that starts the same way."""
        done = self.materialized()
        kept = done.order[done.positions[done.order] < count]
        if len(kept) != count:
            raise NotebookError(f"the context holds {len(kept)} of the first {count} positions: a prefix needs every one")
        return done._keeping(kept, f"prefix of {count} positions")

    def _keeping(self, kept: torch.Tensor, note: str) -> "Notebook":
        """Only the computed entries ``kept`` (in that order), all visible."""
        index = kept.to(self.lm.device)
        return Notebook(
            lm=self.lm,
            computed_keys=tuple(k.index_select(2, index) for k in self.keys),
            computed_values=tuple(v.index_select(2, index) for v in self.values),
            token_ids=self.token_ids[kept],
            positions=self.positions[kept],
            segments=tuple(self.segments[i] for i in kept.tolist()),
            visible=torch.ones(len(kept), dtype=torch.bool),
            log=self.log + (note,),
            rope_offsets=self.rope_offsets[:, kept],
            spliced=self.spliced[kept],
            rescale=self.rescale,
        )

    # ---------------------------------------------------------------- knockouts
    def blocked_masks(self, knockouts: Knockout | Sequence[Knockout] | None) -> dict[int, torch.Tensor]:
        """Knockouts as per-layer (heads or 1, N) bool masks over this notebook's entries, OR-ed."""
        if knockouts is None:
            return {}
        config = self.lm.model.config.get_text_config()
        layer_count, head_count = config.num_hidden_layers, config.num_attention_heads
        blocked: dict[int, torch.Tensor] = {}
        for knockout in [knockouts] if isinstance(knockouts, Knockout) else knockouts:
            if not knockout.positions:
                continue
            columns = torch.zeros(len(self.positions), dtype=torch.bool)
            columns[self.entries_at(knockout.positions)] = True
            rows = torch.ones(1, 1, dtype=torch.bool)
            if knockout.heads is not None:
                bad = [h for h in knockout.heads if not 0 <= h < head_count]
                if bad:
                    raise NotebookError(f"head {bad[0]} does not exist (model has {head_count} query heads)")
                rows = torch.zeros(head_count, 1, dtype=torch.bool)
                rows[list(knockout.heads)] = True
            layers = range(layer_count) if knockout.layers is None else knockout.layers
            bad_layers = [layer for layer in layers if not 0 <= layer < layer_count]
            if bad_layers:
                raise NotebookError(f"layer {bad_layers[0]} does not exist (model has {layer_count} layers)")
            for layer in layers:
                mask = rows & columns[None, :]
                blocked[layer] = blocked[layer] | mask if layer in blocked else mask
        return blocked

    # ---------------------------------------------------------------- reading, generating, blocks (their own modules)
    read_many = staticmethod(reading.read_many)
    read = reading.read
    read_prompt = reading.read_prompt
    step = generation.step
    greedy = generation.greedy
    generate = generation.generate
    block = blocks.block
    splice = blocks.splice
