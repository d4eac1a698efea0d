"""llama-server's RAM prompt cache (``server_prompt_cache`` in the pinned build's ``server-task.cpp``), the store
``ServerSlots`` saves slots to and restores them from: whole prompts, oldest first, within ``--cache-ram``.

Its rules, as the server has them:
- ``save`` (``alloc``): a prompt that an entry holds whole is not saved, nor one larger than the limit; else the entries
  it holds whole are dropped, the oldest go until it fits, and it is appended.
- ``restore`` (``load``): the entry that keeps at least a quarter of itself and beats the slot's own tokens on both
  shares (kept of the entry, and of the new prompt), the oldest first, each winner replacing the last; it leaves.

So no entry is a prefix of another, and each entry is a leaf of a token trie over them. A prompt's longest shared
prefix with every entry comes from one walk down the trie, and an entry can only win where it shares more than the slot
does, so only the subtrees that branch off below that depth are read: a request costs its own length, not a scan of
every saved prompt. The limit is in tokens (``--cache-ram`` over the model's KV bytes a token); None: no limit.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from kvscope.engine.audit.changes.fields import common_prefix

KEEP_AT_LEAST = 0.25  # ``load`` skips an entry that would keep less of itself ("don't trash large prompts")


class _Node:
    __slots__ = ("edge", "children", "parent", "depth", "entry")

    def __init__(self, edge: np.ndarray, parent: _Node | None):
        self.edge = edge  # the tokens from the parent (a copy: an entry's array is not kept alive by the trie)
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.depth = (parent.depth if parent else 0) + len(edge)  # tokens from the root to this node's end
        self.entry: int | None = None  # the entry ending here (a leaf)


class PromptRam:
    """The saved prompts (oldest first) as leaves of a token trie, within ``limit`` tokens (None: no limit)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.root = _Node(np.zeros(0, dtype=np.int32), None)
        self.leaves: dict[int, _Node] = {}  # entry number -> its leaf, oldest first
        self.tokens = 0  # the entries' tokens, as the server counts them (each entry whole)
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self.leaves)

    def entries(self) -> list[np.ndarray]:
        """The saved prompts' tokens, oldest first."""
        return [self.entry_tokens(number) for number in self.leaves]

    def save(self, tokens: np.ndarray) -> None:
        """``alloc``: ``tokens`` saved, unless empty, held whole by an entry, or over the limit."""
        if not len(tokens) or self._holds(tokens) or (self.limit is not None and len(tokens) > self.limit):
            return
        inside = self.prefix_entry(tokens, len(tokens) + 1)
        if inside is not None:
            self._remove(inside)
        while self.leaves and self.limit is not None and self.tokens + len(tokens) > self.limit:
            self._remove(next(iter(self.leaves)))
        self._insert(tokens, next(self._numbers))

    def would_evict(self, tokens: np.ndarray) -> set[int]:
        """The entries ``save(tokens)`` would drop for room (not those it holds whole): what a look-ahead leaves out."""
        if not len(tokens) or self.limit is None or self._holds(tokens) or len(tokens) > self.limit:
            return set()
        inside = self.prefix_entry(tokens, len(tokens) + 1)
        held = self.tokens - (self.leaves[inside].depth if inside is not None else 0)
        dropped: set[int] = set()
        for number, leaf in self.leaves.items():
            if held + len(tokens) <= self.limit:
                break
            if number != inside:
                dropped.add(number)
                held -= leaf.depth
        return dropped

    def best(self, current: np.ndarray, ids: np.ndarray, skip: set[int] | None = None) -> int | None:
        """``load``'s choice for a slot holding ``current`` and the prompt ``ids`` (None: the slot keeps its own)."""
        shared = common_prefix(current, ids)
        keep, share = (shared / len(current) if len(current) else -1.0), shared / len(ids)
        chosen = None
        for number, lcp, length in sorted(self._sharing_more(ids, shared)):
            if (skip and number in skip) or lcp / length < KEEP_AT_LEAST:
                continue
            if keep < lcp / length and share < lcp / len(ids):
                keep, share, chosen = lcp / length, lcp / len(ids), number
        return chosen

    def restore(self, number: int) -> np.ndarray:
        """The entry's tokens; it leaves the cache."""
        tokens = self.entry_tokens(number)
        self._remove(number)
        return tokens

    def entry_tokens(self, number: int) -> np.ndarray:
        """An entry's tokens, read up its path."""
        edges, node = [], self.leaves[number]
        while node is not None:
            edges.append(node.edge)
            node = node.parent
        return np.concatenate(edges[::-1]).astype(np.int32, copy=False)

    def prefix_entry(self, tokens: np.ndarray, shorter_than: int) -> int | None:
        """The entry that is a prefix of ``tokens`` and shorter than ``shorter_than`` (at most one: no entry is a prefix
        of another), or None."""
        node, depth = self.root, 0
        while node.entry is None:
            child = node.children.get(int(tokens[depth])) if depth < len(tokens) else None
            if child is None or common_prefix(child.edge, tokens[depth : depth + len(child.edge)]) < len(child.edge):
                return None
            node, depth = child, depth + len(child.edge)
        return node.entry if node.depth < shorter_than else None

    def replace(self, number: int, tokens: np.ndarray) -> None:
        """Entry ``number`` (a prefix of ``tokens``) now holds ``tokens``, in its place in the age order."""
        order = list(self.leaves)
        self._remove(number)
        self._insert(tokens, number)
        self.leaves = {n: self.leaves[n] for n in order}

    def _holds(self, tokens: np.ndarray) -> bool:
        """Whether an entry holds ``tokens`` whole (``tokens`` is a prefix of an entry)."""
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(int(tokens[depth]))
            if child is None:
                return False
            step = common_prefix(child.edge, tokens[depth : depth + len(child.edge)])
            if step < min(len(child.edge), len(tokens) - depth):
                return False
            node, depth = child, depth + step
        return node is not self.root

    def _sharing_more(self, ids: np.ndarray, floor: int) -> Iterator[tuple[int, int, int]]:
        """(entry, its longest shared prefix with ``ids``, its length) for each entry sharing more than ``floor`` tokens."""
        node, depth = self.root, 0
        while True:
            if node.entry is not None:
                if depth > floor:
                    yield node.entry, depth, node.depth
                return
            nxt = node.children.get(int(ids[depth])) if depth < len(ids) else None
            if depth > floor:
                for child in node.children.values():
                    if child is not nxt:
                        yield from ((number, depth, length) for number, length in _leaves(child))
            if nxt is None:
                return
            step = common_prefix(nxt.edge, ids[depth : depth + len(nxt.edge)])
            if step < len(nxt.edge):
                if depth + step > floor:
                    yield from ((number, depth + step, length) for number, length in _leaves(nxt))
                return
            node, depth = nxt, depth + step

    def _insert(self, tokens: np.ndarray, number: int) -> None:
        """``tokens`` as entry ``number`` (neither a prefix of an entry nor holding one), the newest."""
        node, depth = self.root, 0
        while True:
            child = node.children.get(int(tokens[depth]))
            if child is None:
                leaf = _Node(np.array(tokens[depth:], dtype=np.int32), node)
                node.children[int(tokens[depth])] = leaf
                break
            step = common_prefix(child.edge, tokens[depth : depth + len(child.edge)])
            if step < len(child.edge):
                child = _split(child, step)
            node, depth = child, depth + step
        leaf.entry = number
        self.leaves[number] = leaf
        self.tokens += len(tokens)

    def _remove(self, number: int) -> None:
        """Entry ``number`` out, its leaf pruned and a parent left with one child merged into it."""
        node = self.leaves.pop(number)
        self.tokens -= node.depth
        parent = node.parent
        del parent.children[int(node.edge[0])]
        if parent is not self.root and len(parent.children) == 1:
            (only,) = parent.children.values()
            only.edge = np.concatenate([parent.edge, only.edge])
            only.parent = parent.parent
            parent.parent.children[int(only.edge[0])] = only


def _split(child: _Node, at: int) -> _Node:
    """``child``'s edge cut after ``at`` tokens: the new middle node, ``child`` below it."""
    parent = child.parent
    middle = _Node(child.edge[:at].copy(), parent)
    parent.children[int(middle.edge[0])] = middle
    child.edge = child.edge[at:].copy()
    child.parent = middle
    middle.children[int(child.edge[0])] = child
    return middle


def _leaves(node: _Node) -> Iterator[tuple[int, int]]:
    """(entry, length) for every leaf at or below ``node``."""
    stack = [node]
    while stack:
        node = stack.pop()
        if node.entry is not None:
            yield node.entry, node.depth
        stack.extend(node.children.values())
