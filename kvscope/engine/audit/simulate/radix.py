"""The token radix tree, and SGLang's RadixAttention simulated on it.

``RadixTree`` is the one mechanism for the longest shared prefix: a request's match (``match``: the earlier request
it shares the longest prefix with, among those still held, the same session's latest among equals), the fleet's
prefix-aware router, a shard's guess on the distributed pass, OpenAI's simulated cache, and the model pass's store of
computed states (``longest_shared``). Under ``budget_tokens`` the least recently used leaf goes first, a whole node at
a time, until the tokens fit (a heap of the leaves, so an eviction costs a log, not a walk of the tree).

``RadixCache`` is SGLang's prefix cache (``PrefixCache``): the tree under the audit's ``budget_tokens``; a request
reuses the longest prefix in the tree, and after it the tree holds its prompt and the reply tokens computed.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from kvscope.engine.audit.changes.fields import common_prefix
from kvscope.engine.audit.simulate.budgets import GIB, SGLANG_MEM_FRACTION, Budget, kv_memory
from kvscope.engine.audit.simulate.caches import EVICTIONS_KEPT, CacheSettings
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest, PrefixCache, fit_budgets


class _Node:
    __slots__ = ("key", "children", "parent", "latest", "sessions", "access", "prompted")

    def __init__(self, key: np.ndarray, parent: _Node | None):
        self.key = key  # the edge's tokens from the parent
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.latest = -1  # the latest request passing through
        self.sessions: dict[str | None, int] = {}  # per session, its latest request passing through
        self.access = 0
        self.prompted = 0  # the edge's leading tokens that a prompt went through (the rest: only replies so far)


class RadixTree:
    """A token radix tree with a token budget and LRU leaf eviction: the one answer to "which earlier request shares
    the longest prefix" (``match``), under SGLang's cache, OpenAI's, the fleet's router, the shards' guesses and the
    model pass's store (``longest_shared``)."""

    def __init__(self, budget_tokens: int | None = None):
        self.root = _Node(np.zeros(0, dtype=np.int32), None)
        self.budget = budget_tokens
        self.tokens = 0  # tokens held (the edges' lengths)
        self.evicted: deque[tuple[int, int]] = deque(maxlen=EVICTIONS_KEPT)  # (request that last used the node, tokens), the latest
        self._order = itertools.count()
        # under a budget, (access, order, node) for each node when it became a leaf or was touched as one; an entry whose
        # node has since been touched again, grown children or been evicted is stale and skipped when popped
        self._leaves: list[tuple[int, int, _Node]] = []

    def match(self, ids: np.ndarray, session: str | None) -> tuple[int, int | None]:
        """The longest prefix of ``ids`` in the tree and the earlier request it came from: the same session's latest
        among the requests sharing it, else the latest (None when nothing is shared)."""
        node, depth = self.root, 0
        while depth < len(ids):
            child = node.children.get(int(ids[depth]))
            if child is None:
                break
            shared = common_prefix(child.key, ids[depth : depth + len(child.key)])
            depth += shared
            node = child
            if shared < len(child.key):
                break
        if depth == 0:
            return 0, None
        return depth, node.sessions.get(session, node.latest)

    def prompted_match(self, ids: np.ndarray) -> int:
        """The longest prefix of ``ids`` that an earlier prompt held (what a tree fed the prompts alone would match;
        the tokens prompts went through are a prefix of every edge, and every edge above them is whole)."""
        node, depth = self.root, 0
        while depth < len(ids):
            child = node.children.get(int(ids[depth]))
            if child is None:
                break
            shared = min(common_prefix(child.key, ids[depth : depth + len(child.key)]), child.prompted)
            depth += shared
            node = child
            if shared < len(child.key):
                break
        return depth

    def insert(
        self, ids: np.ndarray, request: int, session: str | None, time: int, held: np.ndarray | None = None, prompt: bool = True
    ) -> int:
        """Cache ``held`` (``ids`` and the reply tokens the server computed after them; ``ids`` alone by default) for
        ``request``, ``ids`` marked as a prompt's unless ``prompt`` is False (a reply held alone); returns the tokens
        of ``ids`` reused (the prefix already held, before its last token), then evicts down to the budget."""
        held = ids if held is None else held
        marked = len(ids) if prompt else 0
        node, depth, found = self.root, 0, None
        self._touch(node, request, session, time)
        while depth < len(held):
            token = int(held[depth])
            child = node.children.get(token)
            if child is None:
                found = depth
                node = _Node(np.array(held[depth:], dtype=np.int32), node)  # a copy: the tree holds new tokens only
                node.parent.children[token] = node
                node.prompted = min(max(marked - depth, 0), len(node.key))
                self.tokens += len(node.key)
                self._touch(node, request, session, time)
                break
            shared = common_prefix(child.key, held[depth : depth + len(child.key)])
            if shared < len(child.key):
                child = self._split(child, shared)
            child.prompted = max(child.prompted, min(marked - depth, shared))
            depth += shared
            node = child
            self._touch(node, request, session, time)
        if self.budget is not None and not node.children and node is not self.root:
            heapq.heappush(self._leaves, (time, next(self._order), node))
        reused = min(depth if found is None else found, len(ids) - 1)
        self._evict()
        return reused

    def _touch(self, node: _Node, request: int, session: str | None, time: int) -> None:
        node.latest = request
        node.sessions[session] = request
        node.access = time

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` tokens; returns the new upper node."""
        upper = _Node(child.key[:at], child.parent)
        upper.latest, upper.sessions, upper.access = child.latest, dict(child.sessions), child.access
        upper.prompted, child.prompted = min(child.prompted, at), max(child.prompted - at, 0)
        child.parent.children[int(child.key[0])] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[int(child.key[0])] = child
        return upper

    def _evict(self) -> None:
        while self.budget is not None and self.tokens > self.budget and self._leaves:
            access, _, leaf = heapq.heappop(self._leaves)
            if leaf.parent is None or leaf.children or leaf.access != access:
                continue  # stale: evicted, no longer a leaf, or touched since
            parent = leaf.parent
            del parent.children[int(leaf.key[0])]
            leaf.parent = None
            self.tokens -= len(leaf.key)
            self.evicted.append((leaf.latest, len(leaf.key)))
            if parent is not self.root and not parent.children:
                heapq.heappush(self._leaves, (parent.access, next(self._order), parent))


class RadixCache(PrefixCache):
    """SGLang's RadixAttention: a token radix tree (``tree``) under a token budget, LRU leaves evicted first."""

    name = "sglang"
    owned_by = "sglang"
    names_matches = True

    @classmethod
    def wrote(cls, marks: Collection[str]) -> str | None:
        """SGLang's marks (``python/sglang/srt/entrypoints/openai/protocol.py``): ``matched_stop`` in each choice of its
        chat and completions answers, and ``sglext`` beside them where it returns its extensions."""
        found = [mark for mark in ("choices.matched_stop", "sglext") if mark in marks]
        return f"{' and '.join(found)} (SGLang's fields)" if found else None

    @classmethod
    def fit_grid(cls, working: int) -> list[dict[str, Any]]:
        """Every page size (``--page-size``: 1, SGLang's default, then 16, 32, 64) under every budget (``fit_budgets``)."""
        return [{"page": page, "budget_tokens": budget} for page in (1, 16, 32, 64) for budget in fit_budgets(working)]

    @classmethod
    def fitted(cls, setting: Mapping[str, Any]) -> RadixCache:
        return cls(setting["budget_tokens"], setting["page"])

    def __init__(self, budget_tokens: int | None = None, page: int = 1):
        self.tree = RadixTree(budget_tokens)
        self.page = page  # SGLang's --page-size: a prefix is reused in whole pages

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> RadixCache:
        return cls(cls.budget(settings).limit)

    @classmethod
    def budget(cls, settings: CacheSettings) -> Budget:
        """--kv-budget-tokens, else SGLang's ``max_total_num_tokens`` (``profile_max_num_token``): the memory free after
        the weights less the GPU's memory × (1 − ``mem_fraction_static``), over a token's KV bytes (its cell size)."""
        size = settings.server
        if settings.budget_tokens is not None:
            return Budget(cls.name, "tokens", settings.budget_tokens, settings.budget_tokens, "--kv-budget-tokens")
        if size is None or size.gpu_gib is None:
            return Budget(cls.name, "tokens", None, None, "no --kv-budget-tokens and no --gpu-memory-gib")
        fraction = SGLANG_MEM_FRACTION if size.mem_fraction_static is None else size.mem_fraction_static
        assumed = " (assumed: SGLang picks it from the GPU; give --mem-fraction-static)" if size.mem_fraction_static is None else ""
        said = f"{fraction:g}{assumed}"
        what = f"{size.gpu_gib:g} GiB × mem_fraction_static {said} − {size.weights_words()}"
        memory = kv_memory(size.gpu_gib * GIB * fraction - size.model.weight_bytes(size.served), what)
        tokens = memory // size.model.kv_bytes_per_token(size.served)
        return Budget(cls.name, "tokens", tokens, tokens, f"SGLang's max_total_num_tokens: {what} over {size.kv_words()}")

    def match(self, request: CacheRequest) -> int:
        """The longest prefix of the request's tokens in the tree, in whole pages."""
        return self.tree.match(request.ids, request.session)[0] // self.page * self.page

    def matched(self, request: CacheRequest) -> int | None:
        """The earlier request the longest prefix came from: the same session's latest among those sharing it, else
        the latest (None when nothing is shared)."""
        return self.tree.match(request.ids, request.session)[1]

    def insert(self, request: CacheRequest) -> int:
        reused = self.tree.insert(request.ids, request.request, request.session, request.time, request.held)
        return reused // self.page * self.page

    @property
    def held_tokens(self) -> int:
        """The tokens held now (the tree's edges)."""
        return self.tree.tokens

    def hold(self, request: CacheRequest) -> None:
        self.tree.insert(request.tokens, request.request, request.session, request.time, prompt=False)

    @property
    def tells_prompts_only(self) -> bool:
        """Unbounded, the tree holds every prompt: the tokens of each edge that a prompt went through (``prompted``) are
        the tree a server caching no reply would hold."""
        return self.tree.budget is None

    def prompts_only(self, request: CacheRequest) -> int:
        """The longest prefix of the prompt an earlier prompt held, before its last token, in whole pages."""
        return min(self.tree.prompted_match(request.ids), len(request.ids) - 1) // self.page * self.page


def longest_shared(keys: Sequence[Sequence[int]], ids: Sequence[int], most: int) -> tuple[int | None, int]:
    """Which of ``keys`` shares the longest prefix with ``ids``, counted up to ``most`` tokens (the first in ``keys``'
    order among equals), and that length; (None, 0) where none shares a token. A tree of the keys answers, the first
    key inserted last, so that every node's latest request is the first key passing through it."""
    tree = RadixTree()
    for number in range(len(keys) - 1, -1, -1):
        tree.insert(np.asarray(keys[number]), number, None, 0)
    shared, number = tree.match(np.asarray(ids[: max(most, 0)]), None)
    return (number, shared) if shared else (None, 0)
