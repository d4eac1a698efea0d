"""The audit's model pass, each piece of work done once: a per-run store of computed states keyed by token ids.

A log's prompts share long prefixes: the older request of turn i+1 is the newer one of turn i, recompute's prompt is
the clean reference's, and the erratum, hoist and coarsen prompts start as the older request does. The store keeps
every state the pass computes (each token of a prompt computed from that prompt's own tokens) and computes a new
prompt as a prefix cache would: the longest prefix it shares with a stored state is taken from that state, and only
the rest runs. A prompt is read (next-token log-probs, greedy tokens) once; a KV-level repair's state serves the same
ids from a different cache (stale entries kept), so its reading is its own and is not stored.

How it is timed (:class:`Reading`): ``ttft_ms`` is the wall time of the one forward that computes what the reader
does not reuse (its recorded steps and the rest of its prompt, up to the first next-token logits), never the greedy
tokens after it and never a state another reader computed. A state's ``prefill_ms`` is the time every token of it
took along the forwards that computed them, as a chunked prefill would take it: the reused prefix's share of its
source's ``prefill_ms`` (prorated by tokens), plus its own forward.

The store is bounded by bytes (``budget_bytes`` of K/V): the least recently used states go first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.audit.fields import common_prefix
from engine.cache.loaded import LoadedModel
from engine.cache.lru import BudgetedLRU
from engine.cache.notebook import Notebook
from engine.timing import Stopwatch

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


class ComputedStates:
    """Every state one audit run computed, keyed by token ids (see the module docstring)."""

    def __init__(self, lm: LoadedModel, tokens: int, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.lm, self.tokens = lm, tokens
        self._stored = BudgetedLRU(budget_bytes, weigh=lambda stored: stored.bytes)  # token ids -> _Stored

    def state(self, ids: Sequence[int]) -> Notebook:
        """Every token of ``ids`` computed: the longest prefix shared with a stored state reused, the rest run in one
        forward (nothing run where a stored state starts with all of them); kept."""
        key = tuple(ids)
        if key in self._stored:
            return self._stored[key].state
        base, shared, share_ms = self._longest(key, len(key))
        watch = Stopwatch()
        state = base.append(list(key[shared:]), "request").materialized() if shared < len(key) else base
        self._keep(key, state, share_ms + (watch.ms if shared < len(key) else 0.0))
        return state

    def prefill_ms(self, ids: Sequence[int]) -> float:
        """The time every token of a stored state took along the forwards that computed them (module docstring)."""
        return self._stored[tuple(ids)].prefill_ms

    def read_prompt(self, ids: Sequence[int]) -> Reference:
        """A whole prompt read: its longest prefix shared with a stored state reused (its last token always runs)."""
        key = tuple(ids)
        known = self._stored.get(key)
        if known is not None and known.reading is not None:
            return known.reading
        base, shared, _ = self._longest(key, len(key) - 1)
        return self.read(base, key[shared:], key)

    def read(self, prefix: Notebook, rest: Sequence[int], prompt: Sequence[int], exact: bool = True) -> Reference:
        """``prompt`` read from ``prefix`` (its recorded steps not yet run) with ``rest`` run after it (its last token is
        the one whose next token is read). ``exact``: the state holds only the prompt's own tokens, computed from
        them, so a prompt read before with the same reuse is that reading, and one read with other reuse keeps its
        greedy tokens (only the forward runs, for its own time); not ``exact`` (a KV-level repair), everything runs."""
        key = tuple(prompt)
        reused = len(prefix.visible_positions()) - prefix.pending_tokens
        stored = self._stored.get(key) if exact else None
        known = stored.reading if stored is not None else None
        if known is not None and known.reused_tokens == reused:
            return known
        watch = Stopwatch()
        context = prefix.append(list(rest[:-1]), "request") if len(rest) > 1 else prefix
        state, logits = context.step([rest[-1]], "request")
        ms = watch.ms
        generated = known.generated if known is not None else tuple(state.greedy(logits, self.tokens, self.lm.stop_ids)[1])
        reading = Reference(torch.log_softmax(logits.float(), -1), generated, ms, state, reused)
        if exact and known is None:
            self._keep(key, state, self._share_ms(prefix, reused) + ms, reading)
        return reading

    # ------------------------------------------------------------------------------------------------ bookkeeping
    def _longest(self, key: tuple[int, ...], most: int) -> tuple[Notebook, int, float]:
        """The stored state sharing the longest prefix with ``key`` (at most ``most`` tokens): that prefix as its own
        notebook (no forward), its length, and its share of the source's prefill time."""
        best, shared = None, 0
        for ids in self._stored:
            count = min(common_prefix(ids, key), most)
            if count > shared:
                best, shared = ids, count
        if best is None:
            return Notebook.empty(self.lm), 0, 0.0
        source = self._stored[best]
        base = source.state if shared == len(best) else source.state.prefix(shared)
        return base, shared, source.prefill_ms * shared / len(best)

    def _share_ms(self, prefix: Notebook, reused: int) -> float:
        """The prefill time of a reader's reused prefix: the share of the stored state it was cut from, where one
        holds it (a KV-level repair's prefix is another's cache: 0)."""
        if reused == 0:
            return 0.0
        ids = tuple(prefix.visible_token_ids()[:reused])
        _, shared, share_ms = self._longest(ids, reused)
        return share_ms if shared == reused else 0.0

    def _keep(self, key: tuple[int, ...], state: Notebook, prefill_ms: float, reading: Reference | None = None) -> None:
        """Keep a state (and its reading), the least recently used others dropped past the byte budget."""
        self._stored[key] = _Stored(state, prefill_ms, state.memory_bytes(), reading)
