"""The Notebook: a prefilled context's K/V with per-token metadata; every cache operation goes through it.

Storage is a bag of *entries*: one (key, value) per layer plus token id, absolute position (the one baked
into the key by RoPE), segment label and a visibility flag. Attention depends only on positions and the
mask, not on storage order, so operations never rebuild caches: a recomputed token is appended as a new
entry and its stale entry is hidden. A Notebook is immutable: every operation returns a new one that
shares unchanged tensors, so forking is free.

Costs (N stored entries, T tokens computed): prefill/append O(T·N) attention; read O(D·N) for D decode
tokens; replace/recompute/seam repair O(T·N) for the T tokens rewritten; patch and knockout O(1) forwards
beyond the read itself; splice O(L) re-rotation for an L-token block plus the seam.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace as dataclass_replace
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from engine import adapter
from engine.decision import Decision, decide
from engine.models import LoadedModel, ModelFingerprint
from engine.rope import Rotary, RopeUnsupported

if TYPE_CHECKING:
    from engine.scenario import RenderedPrompt


class NotebookError(ValueError):
    """An operation that cannot apply to this notebook; the message says which input and why."""


@dataclass(frozen=True)
class Knockout:
    """Hide cache positions from the decision tokens in some layers and query heads (None = all)."""

    positions: tuple[int, ...]
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None


@dataclass(frozen=True)
class KVBlock:
    """A block's K/V computed once (e.g. a skill), with the positions its keys were rotated for."""

    token_ids: torch.Tensor  # (L,)
    keys: tuple[torch.Tensor, ...]  # per layer (1, kv_heads, L, head_dim)
    values: tuple[torch.Tensor, ...]
    start_position: int
    segments: tuple[str, ...]  # (L,) labels, e.g. "skill:refund_policy" and "field:NAME" inside it
    fingerprint: ModelFingerprint

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def name(self) -> str:
        """The block's main label (its most frequent segment)."""
        return max(set(self.segments), key=self.segments.count)

    def memory_bytes(self) -> int:
        """Bytes of its K/V tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def query_heads_of_kv_head(model_config, kv_head: int) -> tuple[int, ...]:
    """Query heads that read one KV head under grouped-query attention (as ``repeat_kv`` maps them)."""
    heads, kv_heads = model_config.num_attention_heads, getattr(model_config, "num_key_value_heads", None)
    group = heads // (kv_heads or heads)
    return tuple(range(kv_head * group, (kv_head + 1) * group))


@dataclass(frozen=True)
class Notebook:
    """K/V of a context plus what each entry is; see the module docstring."""

    lm: LoadedModel
    keys: tuple[torch.Tensor, ...]  # per layer (1, kv_heads, N, head_dim), post-RoPE
    values: tuple[torch.Tensor, ...]
    token_ids: torch.Tensor  # (N,) int64, CPU
    positions: torch.Tensor  # (N,) int64, CPU
    segments: tuple[str, ...]  # (N,)
    visible: torch.Tensor  # (N,) bool, CPU
    log: tuple[str, ...] = ()

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
        progress: Callable[[int, int], None] | None = None,
    ) -> "Notebook":
        """Prefill tokens (in chunks of ``chunk_size`` if given) starting at ``start_position``."""
        ids = list(token_ids)
        labels = [segments] * len(ids) if isinstance(segments, str) else list(segments)
        if len(labels) != len(ids):
            raise NotebookError(f"got {len(labels)} segment labels for {len(ids)} tokens")
        notebook, step = cls.empty(lm), chunk_size or max(len(ids), 1)
        for begin in range(0, len(ids), step):
            notebook = notebook._compute(
                ids[begin : begin + step],
                list(range(start_position + begin, start_position + min(begin + step, len(ids)))),
                labels[begin : begin + step],
            )
            if progress:
                progress(min(begin + step, len(ids)), len(ids))
        return dataclass_replace(notebook, log=(f"prefill {len(ids)} tokens" + (f" in chunks of {step}" if chunk_size else ""),))

    @classmethod
    def from_prompt(cls, lm: LoadedModel, prompt: RenderedPrompt, **kwargs) -> "Notebook":
        """Prefill a rendered scenario's cached context, with its segment labels."""
        return cls.prefill(lm, prompt.context_ids, prompt.context_segments, **kwargs)

    def read_prompt(self, prompt: RenderedPrompt, answer_texts: Mapping[str, Sequence[str]] | None = None, **kwargs) -> Decision:
        """Read the decision for a rendered scenario's question and answers."""
        return self.read(prompt.decode_ids, prompt.answer_ids, answer_texts=answer_texts, **kwargs)

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
        return [tokenizer.decode([token]) for token in self.visible_token_ids()]

    def memory_bytes(self) -> int:
        """Bytes held by K/V tensors (shared tensors counted once)."""
        seen: dict[int, int] = {}
        for tensor in (*self.keys, *self.values):
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return sum(seen.values())

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
    def _forward(self, token_ids: Sequence[int], positions: Sequence[int], visible: torch.Tensor, **kwargs) -> adapter.ForwardResult:
        device = self.lm.device
        return adapter.forward(
            self.lm.model,
            list(self.keys),
            list(self.values),
            self.positions.to(device),
            visible.to(device),
            torch.tensor(list(token_ids), dtype=torch.long, device=device),
            torch.tensor(list(positions), dtype=torch.long, device=device),
            **kwargs,
        )

    def _with_entries(self, result: adapter.ForwardResult, token_ids, positions, segments, visible: torch.Tensor, note: str) -> "Notebook":
        """A new notebook: these entries plus the forward's new ones appended."""
        if not self.keys:
            keys, values = tuple(result.new_keys), tuple(result.new_values)
        else:
            keys = tuple(torch.cat([old, new], dim=2) for old, new in zip(self.keys, result.new_keys))
            values = tuple(torch.cat([old, new], dim=2) for old, new in zip(self.values, result.new_values))
        count = len(token_ids)
        return Notebook(
            lm=self.lm,
            keys=keys,
            values=values,
            token_ids=torch.cat([self.token_ids, torch.tensor(list(token_ids), dtype=torch.long)]),
            positions=torch.cat([self.positions, torch.tensor(list(positions), dtype=torch.long)]),
            segments=self.segments + tuple(segments),
            visible=torch.cat([visible, torch.ones(count, dtype=torch.bool)]),
            log=self.log + (note,),
        )

    def _compute(self, token_ids, positions, segments, *, hide: torch.Tensor | None = None, note: str = "") -> "Notebook":
        """Compute tokens at positions over this cache (``hide`` entries excluded) and store them."""
        visible = self.visible.clone()
        if hide is not None:
            visible[hide] = False
        result = self._forward(token_ids, positions, visible)
        return self._with_entries(result, token_ids, positions, segments, visible, note)

    def _shifted(self, from_position: int, delta: int, reason: str) -> "Notebook":
        """Move every entry at ``from_position`` or later by ``delta`` positions (keys re-rotated)."""
        moving = self.positions >= from_position
        if delta == 0 or not bool(moving.any()):
            return self
        try:
            rotary = self.rotary
        except RopeUnsupported as error:
            raise NotebookError(f"{reason} needs to move later tokens, but {error}") from error
        index = torch.nonzero(moving).flatten().to(self.lm.device)
        deltas = torch.full((len(index),), delta, dtype=torch.long)
        keys = tuple(k.index_copy(2, index, rotary.rotate(k.index_select(2, index), deltas)) for k in self.keys)
        return dataclass_replace(self, keys=keys, positions=torch.where(moving, self.positions + delta, self.positions))

    # ---------------------------------------------------------------- operations
    def append(self, token_ids: Sequence[int], segment: str | Sequence[str] = "context") -> "Notebook":
        """Prefill tokens after the current context (e.g. an erratum line); one label or one per token."""
        labels = [segment] * len(token_ids) if isinstance(segment, str) else list(segment)
        if not token_ids:
            raise NotebookError(f"nothing to append to segment {segment!r}: no tokens")
        if len(labels) != len(token_ids):
            raise NotebookError(f"got {len(labels)} segment labels for {len(token_ids)} tokens")
        start = self.next_position
        return self._compute(token_ids, range(start, start + len(token_ids)), labels, note=f"append {len(token_ids)} tokens as {labels[0]}")

    def append_text(self, text: str, segment: str = "erratum") -> "Notebook":
        """Tokenize text (no special tokens) and append it."""
        ids = self.lm.tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise NotebookError(f"text for segment {segment!r} tokenizes to nothing: {text!r}")
        return self.append(ids, segment)

    def replace(self, positions: Sequence[int], token_ids: Sequence[int], segment: str | None = None) -> "Notebook":
        """Rewrite a contiguous span with new tokens, recomputing only their K/V against the prefix.

        Later entries keep their (now stale) K/V; a length change moves them by re-rotating their keys.
        """
        if not positions or not token_ids:
            raise NotebookError("replace needs a non-empty span and non-empty new tokens")
        old = self.entries_at(positions)
        start, length = int(self.positions[old].min()), len(positions)
        if sorted(int(p) for p in positions) != list(range(start, start + length)):
            raise NotebookError(f"replace needs contiguous positions, got {list(positions)}")
        label = segment or self.segments[int(old[0])]
        moved = self._shifted(start + length, len(token_ids) - length, f"replacing {length} tokens by {len(token_ids)}")
        return moved._compute(
            token_ids,
            range(start, start + len(token_ids)),
            [label] * len(token_ids),
            hide=old,
            note=f"replace {label} at {start}..{start + length - 1} ({length}→{len(token_ids)} tokens)",
        )

    def recompute(self, positions: Sequence[int]) -> "Notebook":
        """Selective recompute: fresh K/V for these positions against the current cache (CacheBlend-style)."""
        if not len(positions):
            return self
        entries = self.entries_at(sorted(set(int(p) for p in positions)))
        return self._compute(
            self.token_ids[entries].tolist(),
            self.positions[entries].tolist(),
            [self.segments[i] for i in entries.tolist()],
            hide=entries,
            note=f"recompute {len(entries)} positions",
        )

    def patch(self, donor: "Notebook", positions: Sequence[int], layers: Sequence[int] | None = None) -> "Notebook":
        """Copy the donor's K/V at these positions into this notebook, in the given layers (default all)."""
        if donor.lm.fingerprint != self.lm.fingerprint:
            raise NotebookError("patch donor comes from another model or dtype")
        mine, theirs = self.entries_at(positions).to(self.lm.device), donor.entries_at(positions).to(self.lm.device)
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
        return dataclass_replace(self, keys=patched(self.keys, donor.keys), values=patched(self.values, donor.values), log=self.log + (note,))

    def block(self, segment: str | None = None, positions: Sequence[int] | None = None) -> KVBlock:
        """Extract one contiguous segment's (or these positions') K/V as a reusable block."""
        if positions is not None:
            entries = self.entries_at(positions)
        else:
            entries = torch.tensor([i for i in self.order.tolist() if self.segments[i] == segment], dtype=torch.long)
            if not len(entries):
                raise NotebookError(f"segment {segment!r} is not in the notebook (segments: {sorted(set(self.segments))})")
        starts = self.positions[entries]
        if not torch.equal(starts, torch.arange(int(starts[0]), int(starts[0]) + len(entries))):
            raise NotebookError("a block must cover consecutive positions")
        index = entries.to(self.lm.device)
        return KVBlock(
            token_ids=self.token_ids[entries].clone(),
            keys=tuple(k.index_select(2, index) for k in self.keys),
            values=tuple(v.index_select(2, index) for v in self.values),
            start_position=int(starts[0]),
            segments=tuple(self.segments[i] for i in entries.tolist()),
            fingerprint=self.lm.fingerprint,
        )

    def splice(self, block: KVBlock, at: int | None = None, seam: int = 0) -> "Notebook":
        """Insert a precomputed block at position ``at`` (default: the end), keys re-rotated, no forward.

        Entries at or after ``at`` move right by the block's length. ``seam`` recomputes the block's first
        tokens against the real prefix (seam repair); a seam as long as the block equals a prefill.
        """
        if block.fingerprint != self.lm.fingerprint:
            raise NotebookError(
                f"block {block.name!r} was computed by {block.fingerprint.name} ({block.fingerprint.dtype}), "
                f"not by the loaded {self.lm.fingerprint.name} ({self.lm.fingerprint.dtype})"
            )
        at = self.next_position if at is None else at
        if not 0 <= at <= self.next_position:
            raise NotebookError(f"splice position {at} is outside the context (0..{self.next_position})")
        if not 0 <= seam <= len(block):
            raise NotebookError(f"seam {seam} must be between 0 and the block length {len(block)}")
        try:
            rotary = self.rotary
        except RopeUnsupported as error:
            raise NotebookError(f"cannot splice {block.name!r}: {error}") from error
        moved = self._shifted(at, len(block), f"splicing {block.name!r}")
        deltas = torch.full((len(block),), at - block.start_position, dtype=torch.long)
        keys = tuple(torch.cat([k, rotary.rotate(b, deltas)], dim=2) for k, b in zip(moved.keys, block.keys)) if moved.keys else tuple(rotary.rotate(b, deltas) for b in block.keys)
        values = tuple(torch.cat([v, b], dim=2) for v, b in zip(moved.values, block.values)) if moved.values else block.values
        spliced = Notebook(
            lm=self.lm,
            keys=keys,
            values=values,
            token_ids=torch.cat([moved.token_ids, block.token_ids]),
            positions=torch.cat([moved.positions, torch.arange(at, at + len(block))]),
            segments=moved.segments + block.segments,
            visible=torch.cat([moved.visible, torch.ones(len(block), dtype=torch.bool)]),
            log=self.log + (f"splice {block.name} ({len(block)} tokens) at {at}" + (f", seam {seam}" if seam else ""),),
        )
        return spliced.recompute(range(at, at + seam))

    def compact(self) -> "Notebook":
        """Drop hidden entries (frees memory; reading order and results unchanged)."""
        kept = self.order
        index = kept.to(self.lm.device)
        return Notebook(
            lm=self.lm,
            keys=tuple(k.index_select(2, index) for k in self.keys),
            values=tuple(v.index_select(2, index) for v in self.values),
            token_ids=self.token_ids[kept],
            positions=self.positions[kept],
            segments=tuple(self.segments[i] for i in kept.tolist()),
            visible=torch.ones(len(kept), dtype=torch.bool),
            log=self.log + (f"compact to {len(kept)} entries",),
        )

    # ---------------------------------------------------------------- decision
    def _blocked(self, knockouts: Knockout | Sequence[Knockout] | None, extra_columns: int = 0) -> dict[int, torch.Tensor] | None:
        """Knockouts as per-layer (heads or 1, 1, N + extra) bool masks (broadcast over queries), OR-ed."""
        if knockouts is None:
            return None
        config = self.lm.model.config
        layer_count, head_count = config.num_hidden_layers, config.num_attention_heads
        blocked: dict[int, torch.Tensor] = {}
        for knockout in [knockouts] if isinstance(knockouts, Knockout) else knockouts:
            if not knockout.positions:
                continue
            columns = torch.zeros(len(self.positions) + extra_columns, dtype=torch.bool)
            columns[self.entries_at(knockout.positions)] = True
            rows = torch.ones(1, 1, 1, dtype=torch.bool)
            if knockout.heads is not None:
                bad = [h for h in knockout.heads if not 0 <= h < head_count]
                if bad:
                    raise NotebookError(f"head {bad[0]} does not exist (model has {head_count} query heads)")
                rows = torch.zeros(head_count, 1, 1, dtype=torch.bool)
                rows[list(knockout.heads)] = True
            layers = range(layer_count) if knockout.layers is None else knockout.layers
            bad_layers = [layer for layer in layers if not 0 <= layer < layer_count]
            if bad_layers:
                raise NotebookError(f"layer {bad_layers[0]} does not exist (model has {layer_count} layers)")
            for layer in layers:
                mask = rows & columns[None, None, :]
                blocked[layer] = blocked[layer] | mask if layer in blocked else mask
        return blocked or None

    def _answer_logprobs(self, decode_ids, answers, knockout, *, capture: bool = False, grad: bool = False):
        """Per-string answer log-prob tensors, plus the question forward (logits, attentions)."""
        if not decode_ids:
            raise NotebookError("a decision needs decode tokens (the question); got none")
        start = self.next_position
        positions = list(range(start, start + len(decode_ids)))
        question = self._forward(decode_ids, positions, self.visible, blocked=self._blocked(knockout), capture=capture, grad=grad)
        log_probs = torch.log_softmax(question.logits[-1], -1)
        extended = self._with_entries(question, decode_ids, positions, ["question"] * len(decode_ids), self.visible, "question")
        blocked = self._blocked(knockout, len(decode_ids))
        scores: dict[str, list[torch.Tensor]] = {}
        for label, sequences in answers.items():
            scores[label] = []
            for ids in sequences:
                score = log_probs[ids[0]]
                if len(ids) > 1:
                    follow = range(extended.next_position, extended.next_position + len(ids) - 1)
                    rest = extended._forward(list(ids[:-1]), follow, extended.visible, blocked=blocked, logits_to_keep=0, grad=grad)
                    steps = torch.log_softmax(rest.logits, -1)
                    score = score + steps[torch.arange(len(ids) - 1), torch.tensor(list(ids[1:]))].sum()
                scores[label].append(score)
        return scores, question

    def read(
        self,
        decode_ids: Sequence[int],
        answers: Mapping[str, Sequence[Sequence[int]]],
        *,
        knockout: Knockout | Sequence[Knockout] | None = None,
        capture_attention: bool = False,
        answer_texts: Mapping[str, Sequence[str]] | None = None,
    ) -> Decision:
        """Score each answer's token sequence after ``decode_ids`` (question + assistant header).

        The notebook is not changed. With ``capture_attention`` the decision tokens' attention is returned
        as (layers, heads, decode tokens, stored entries + decode tokens), stored entries in storage order.
        """
        scores, question = self._answer_logprobs(decode_ids, answers, knockout, capture=capture_attention)
        texts = answer_texts or {label: [str(i) for i in range(len(seqs))] for label, seqs in answers.items()}
        string_logprobs = {
            label: {text: float(score) for text, score in zip(texts[label], label_scores)} for label, label_scores in scores.items()
        }
        decision = decide(string_logprobs, question.logits[-1].detach().cpu())
        if capture_attention:
            decision.attention = torch.stack([question.attentions[layer] for layer in sorted(question.attentions)]).cpu()
        return decision

    def decision_score(
        self, decode_ids: Sequence[int], answers: Mapping[str, Sequence[Sequence[int]]], knockout: Knockout | Sequence[Knockout] | None = None
    ) -> torch.Tensor:
        """The decision margin as a differentiable scalar (gradients flow into K/V that require grad)."""
        scores, _ = self._answer_logprobs(decode_ids, answers, knockout, grad=True)
        label_scores = [torch.logsumexp(torch.stack(values), 0) for values in scores.values()]
        return label_scores[0] - torch.stack(label_scores[1:]).max()

    def with_grad(self) -> "Notebook":
        """A copy whose K/V are fresh float leaves requiring grad (for attribution patching)."""
        keys = tuple(k.detach().clone().requires_grad_(True) for k in self.keys)
        values = tuple(v.detach().clone().requires_grad_(True) for v in self.values)
        return dataclass_replace(self, keys=keys, values=values)

    def generate(self, decode_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> tuple["Notebook", list[int]]:
        """Greedy decoding after ``decode_ids``; returns the notebook with everything appended and the new ids."""
        positions = list(range(self.next_position, self.next_position + len(decode_ids)))
        question = self._forward(decode_ids, positions, self.visible)
        notebook = self._with_entries(question, decode_ids, positions, ["question"] * len(decode_ids), self.visible, "question")
        logits, generated = question.logits[-1], []
        for _ in range(max_new_tokens):
            token = int(logits.argmax())
            if token in stop_ids:
                break
            generated.append(token)
            position = [notebook.next_position]
            step = notebook._forward([token], position, notebook.visible)
            notebook = notebook._with_entries(step, [token], position, ["generated"], notebook.visible, "generate 1 token")
            logits = step.logits[-1]
        return notebook, generated

    def hidden_states(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Residual stream (layers + 1, T, hidden) of tokens run after this context (nothing is stored)."""
        start = self.next_position
        result = self._forward(list(token_ids), range(start, start + len(token_ids)), self.visible, hidden_states=True)
        return torch.stack(result.hidden_states).float()
