"""The audit's model pass, each piece of work done once: a per-run store of computed states keyed by token ids
(docs/audit.md, "How the model pass computes").

A prompt is computed as a prefix cache would: the longest prefix it shares with a stored state (``radix.longest_shared``)
is taken from that state, only the rest runs; it is read (next-token log-probs, greedy tokens) once. A KV-level
repair's state serves the same ids from a cache with stale entries, so its reading is its own and is not stored. The
store is bounded by bytes of K/V (``budget_bytes``, least recently used out first).

Timing (:class:`Reference`): ``ttft_ms`` is the one forward that computes what the reader does not reuse; a state's
``prefill_ms`` is its tokens' time along the forwards that computed them (the reused prefix's share of its source's,
prorated by tokens, plus its own forward).

Invariant: each state keeps the forwards that computed it (its *chunks*, tokens [first, end) each). The same tokens
computed by the same chunks are the same numbers bit for bit (a forward of another extent may round otherwise), so
another run's store (``reuse``) lends a reading exactly where this one would compute the same, and nowhere else.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvscope.engine.audit.simulate.radix import longest_shared
from kvscope.engine.cache.budget import forward_token_limit
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.lru import BudgetedLRU
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.timing import Stopwatch

Chunks = tuple[tuple[int, int], ...]  # the forwards that computed a state's entries: each one's tokens [first, end)

DEFAULT_BUDGET_BYTES = 2 << 30  # K/V kept per audit run


@dataclass(frozen=True)
class Reference:
    """A prompt read from a state: its first next-token distribution, its greedy tokens, the time to its first token
    (the module's docstring says how it is timed), the state with every token of the prompt computed, and how many
    of them were reused."""

    logprobs: torch.Tensor  # (vocab,) float32
    generated: tuple[int, ...]
    ttft_ms: float
    notebook: Notebook  # every token of the prompt computed: the next turn's cached state
    reused_tokens: int = 0


@dataclass
class _Stored:
    state: Notebook  # every token of its key computed, nothing pending
    prefill_ms: float
    bytes: int
    reading: Reference | None = None
    chunks: Chunks | None = None  # how it was computed (the module's docstring); None where not known


def forward_chunks(start: int, stop: int, limit: int, last: int | None = None) -> Chunks:
    """The forwards that compute tokens [start, stop) after ``start`` computed entries: the engine runs ``limit``
    tokens at a time while more than ``limit`` of them are pending (``fused_forward.computed_in_chunks``), then the
    rest; a reading's last token is no pending token (``last``: the pending ones end there) but runs with that rest."""
    pending_end = stop if last is None else last
    firsts = [start, *range(start + limit, pending_end, limit)] if stop > start else []
    return tuple(zip(firsts, [*firsts[1:], stop]))


class ComputedStates:
    """Every state one audit run computed, keyed by token ids (see the module docstring)."""

    def __init__(
        self,
        lm: LoadedModel,
        tokens: int,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        *,
        reuse: ComputedStates | None = None,
    ) -> None:
        self.lm, self.tokens, self.reuse = lm, tokens, reuse
        self.on_forward: Callable[[int], None] | None = None  # told each forward's new tokens (``forwards_told``)
        self._stored = BudgetedLRU(budget_bytes, weigh=lambda stored: stored.bytes)  # token ids -> _Stored
        self._chunks: dict[int, tuple[weakref.ref, Chunks]] = {}  # id(notebook) -> (the notebook, its chunks)

    def state(self, ids: Sequence[int]) -> Notebook:
        """Every token of ``ids`` computed: the longest prefix shared with a stored state reused, the rest run in one
        forward (nothing run where a stored state starts with all of them); kept."""
        key = tuple(ids)
        if key in self._stored:
            return self._stored[key].state
        base, shared, share_ms = self._longest(key, len(key))
        watch = Stopwatch()
        state = base.append(list(key[shared:]), "request").materialized() if shared < len(key) else base
        ms = watch.ms if shared < len(key) else 0.0
        if shared < len(key):
            self._forwards(shared, len(key))
        chunks = self._joined(base, shared, forward_chunks(shared, len(key), forward_token_limit()))
        self._keep(key, state, share_ms + ms, chunks=chunks)
        return state

    @contextlib.contextmanager
    def forwards_told(self, on_forward: Callable[[int], None] | None) -> Iterator[None]:
        """Within: every forward this store runs is told to ``on_forward`` (its new tokens)."""
        previous, self.on_forward = self.on_forward, on_forward
        try:
            yield
        finally:
            self.on_forward = previous

    def prefix(self, state: Notebook, count: int) -> Notebook:
        """The first ``count`` entries of ``state`` as their own notebook (``Notebook.prefix``), their chunks known."""
        base = state.prefix(count)
        self._note(base, _cut(self.chunks_of(state), count))
        return base

    def chunks_of(self, state: Notebook) -> Chunks | None:
        """The forwards that computed ``state`` (a notebook this store made or cut), else None."""
        known = self._chunks.get(id(state))
        return known[1] if known is not None and known[0]() is state else None

    def prefill_ms(self, ids: Sequence[int]) -> float:
        """The time every token of a stored state took along the forwards that computed them (module docstring)."""
        return self._stored[tuple(ids)].prefill_ms

    def read_prompt(self, ids: Sequence[int], draft: Sequence[int] = ()) -> Reference:
        """A whole prompt read: its longest prefix shared with a stored state reused (its last token always runs);
        ``draft`` as :meth:`read` takes it."""
        key = tuple(ids)
        known = self._stored.get(key)
        if known is not None and known.reading is not None:
            return known.reading
        base, shared, _ = self._longest(key, len(key) - 1)
        return self.read(base, key[shared:], key, draft=draft)

    def read(
        self, prefix: Notebook, rest: Sequence[int], prompt: Sequence[int], exact: bool = True, draft: Sequence[int] = ()
    ) -> Reference:
        """``prompt`` read from ``prefix`` (its recorded steps not yet run) with ``rest`` run after it (its last token is
        the one whose next token is read). ``exact``: the state holds only the prompt's own tokens, computed from
        them, so a prompt read before with the same reuse is that reading, and one read with other reuse keeps its
        greedy tokens (only the forward runs, for its own time); not ``exact`` (a KV-level repair), everything runs.
        ``draft``: the greedy tokens expected (the clean reading's), checked in one forward (``Notebook.greedy``)."""
        key = tuple(prompt)
        reused = len(prefix.visible_positions()) - prefix.pending_tokens
        stored = self._stored.get(key) if exact else None
        known = stored.reading if stored is not None else None
        if known is not None and known.reused_tokens == reused:
            return known
        chunks = None
        if exact and not prefix.pending_tokens:
            chunks = self._joined(prefix, reused, forward_chunks(reused, len(key), forward_token_limit(), last=len(key) - 1))
        if known is None and chunks is not None and (taken := self._reused_reading(key, reused, chunks)) is not None:
            self._keep(key, taken.notebook, self._share_ms(prefix, reused) + taken.ttft_ms, taken, chunks)
            return taken
        watch = Stopwatch()
        context = prefix.append(list(rest[:-1]), "request") if len(rest) > 1 else prefix
        state, logits = context.step([rest[-1]], "request")
        ms = watch.ms
        self._forwards(0, prefix.pending_tokens + len(rest))
        if known is not None:
            generated = known.generated
        else:
            generated = tuple(state.greedy(logits, self.tokens, self.lm.stop_ids, draft=draft, on_forward=self.on_forward)[1])
        reading = Reference(torch.log_softmax(logits.float(), -1), generated, ms, state, reused)
        if exact and known is None:
            self._keep(key, state, self._share_ms(prefix, reused) + ms, reading, chunks)
        return reading

    def _reused_reading(self, key: tuple[int, ...], reused: int, chunks: Chunks) -> Reference | None:
        """The ``reuse`` store's reading of ``key`` where it was computed exactly as this one would be: the same
        reuse, the same forwards (chunks), the same greedy tokens asked for."""
        other = self.reuse
        if other is None or other.tokens != self.tokens or other.lm is not self.lm:
            return None
        stored = other._stored.get(key)
        reading = stored.reading if stored is not None else None
        if reading is None or reading.reused_tokens != reused or stored.chunks != chunks:
            return None
        return reading

    # ------------------------------------------------------------------------------------------------ bookkeeping
    def _longest(self, key: tuple[int, ...], most: int) -> tuple[Notebook, int, float]:
        """The stored state sharing the longest prefix with ``key`` (at most ``most`` tokens): that prefix as its own
        notebook (no forward), its length, and its share of the source's prefill time."""
        stored = list(self._stored)
        number, shared = longest_shared(stored, key, most)  # the first stored among equally long prefixes
        best = None if number is None else stored[number]
        if best is None:
            empty = Notebook.empty(self.lm)
            self._note(empty, ())
            return empty, 0, 0.0
        source = self._stored[best]
        base = source.state if shared == len(best) else source.state.prefix(shared)
        self._note(base, _cut(source.chunks, shared))
        return base, shared, source.prefill_ms * shared / len(best)

    def _share_ms(self, prefix: Notebook, reused: int) -> float:
        """The prefill time of a reader's reused prefix: the share of the stored state it was cut from, where one
        holds it (a KV-level repair's prefix is another's cache: 0)."""
        if reused == 0:
            return 0.0
        ids = tuple(prefix.visible_token_ids()[:reused])
        _, shared, share_ms = self._longest(ids, reused)
        return share_ms if shared == reused else 0.0

    def _keep(
        self, key: tuple[int, ...], state: Notebook, prefill_ms: float, reading: Reference | None = None, chunks: Chunks | None = None
    ) -> None:
        """Keep a state (and its reading), the least recently used others dropped past the byte budget."""
        self._stored[key] = _Stored(state, prefill_ms, state.memory_bytes(), reading, chunks)
        self._note(state, chunks)

    def _note(self, state: Notebook, chunks: Chunks | None) -> None:
        """Remember how ``state`` was computed (for as long as it lives)."""
        self._chunks = {at: known for at, known in self._chunks.items() if known[0]() is not None}
        if chunks is not None:
            self._chunks[id(state)] = (weakref.ref(state), chunks)

    def _joined(self, prefix: Notebook, reused: int, own: Chunks) -> Chunks | None:
        """The chunks of a state computed as ``own`` after the first ``reused`` entries of ``prefix`` (None: not known)."""
        return None if (before := _cut(self.chunks_of(prefix), reused)) is None else before + own

    def _forwards(self, start: int, stop: int) -> None:
        """Tell ``on_forward`` of the tokens [start, stop) just computed, a forward at a time (the engine's chunks)."""
        if self.on_forward is not None:
            for first, end in forward_chunks(start, stop, forward_token_limit()):
                self.on_forward(end - first)


def _cut(chunks: Chunks | None, count: int) -> Chunks | None:
    """The forwards behind a state's first ``count`` entries: those that computed any of them, each whole (a forward
    that ran further computed its first tokens otherwise than one that stopped at ``count``)."""
    return None if chunks is None else tuple(chunk for chunk in chunks if chunk[0] < count)
