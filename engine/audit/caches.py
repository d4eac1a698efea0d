"""Prefix caches simulated as three serving engines hold them, fed the log's requests in order.

- ``vllm``: whole blocks (16 tokens, ``block``), each keyed by its tokens and every block before it. A request
  reuses the leading blocks found. Under ``budget_blocks`` the least recently used block goes first (a request's
  blocks are touched tail first, so its tail goes before its head).
- ``sglang``: a token radix tree. A request reuses the longest prefix in the tree. Under ``budget_tokens`` the least
  recently used leaf goes first, a whole node at a time, until the tokens fit (a heap of the leaves, so an eviction
  costs a log, not a walk of the tree).
- ``llama_cpp``: one slot per session holding its last prompt. A request reuses the common prefix with its slot,
  plus, with ``cache_reuse`` N > 0, later chunks of at least N equal tokens shifted into place. When the sessions
  outnumber ``slots``, the least recently used slot is taken over.

Every engine computes at least the last token of a request (its logits are the answer), so a request identical to a
cached one reuses all but one token. Budgets default to unbounded. The radix tree also answers which earlier request
a new one shares its longest prefix with (``RadixCache.match``), among those still in the cache (so matching honours
the SGLang budget: a request evicted whole is no longer a match, one evicted down to its head is matched by its head),
preferring the same session's latest request among equally long prefixes.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.audit.fields import BLOCK_TOKENS, common_prefix

ENGINES = {
    "vllm": "vLLM automatic prefix caching: whole blocks, LRU under a block budget",
    "sglang": "SGLang RadixAttention: a token radix tree, LRU leaves under a token budget",
    "llama_cpp": "llama.cpp server: one slot per session, --cache-reuse chunk shifting",
}


@dataclass(frozen=True)
class CacheSettings:
    """The simulated engines' settings (None: unbounded)."""

    block: int = BLOCK_TOKENS
    budget_blocks: int | None = None  # vLLM
    budget_tokens: int | None = None  # SGLang
    slots: int | None = None  # llama.cpp (None: one per session)
    cache_reuse: int = 0  # llama.cpp --cache-reuse N (0: off, its default)

    def as_dict(self) -> dict:
        return {
            "block": self.block,
            "budget_blocks": self.budget_blocks,
            "budget_tokens": self.budget_tokens,
            "slots": self.slots,
            "cache_reuse": self.cache_reuse,
        }


class _Node:
    __slots__ = ("key", "children", "parent", "latest", "sessions", "access")

    def __init__(self, key: np.ndarray, parent: _Node | None):
        self.key = key  # the edge's tokens from the parent
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.latest = -1  # the latest request passing through
        self.sessions: dict[str | None, int] = {}  # per session, its latest request passing through
        self.access = 0


class RadixCache:
    """A token radix tree (SGLang's RadixAttention) with a token budget and LRU leaf eviction."""

    def __init__(self, budget_tokens: int | None = None):
        self.root = _Node(np.zeros(0, dtype=np.int32), None)
        self.budget = budget_tokens
        self.tokens = 0  # tokens held (the edges' lengths)
        self.evicted: list[tuple[int, int]] = []  # (request that last used the node, tokens) per eviction, in order
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

    def insert(self, ids: np.ndarray, request: int, session: str | None, time: int) -> int:
        """Cache ``ids`` for ``request``; returns the tokens reused (the prefix already held, before the last token),
        then evicts down to the budget."""
        node, depth = self.root, 0
        self._touch(node, request, session, time)
        while depth < len(ids):
            token = int(ids[depth])
            child = node.children.get(token)
            if child is None:
                node = _Node(np.array(ids[depth:], dtype=np.int32), node)  # a copy: the tree holds new tokens only
                node.parent.children[token] = node
                self.tokens += len(node.key)
                self._touch(node, request, session, time)
                break
            shared = common_prefix(child.key, ids[depth : depth + len(child.key)])
            if shared < len(child.key):
                child = self._split(child, shared)
            depth += shared
            node = child
            self._touch(node, request, session, time)
        if self.budget is not None and not node.children and node is not self.root:
            heapq.heappush(self._leaves, (time, next(self._order), node))
        reused = min(depth, len(ids) - 1)
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


class BlockCache:
    """vLLM's automatic prefix caching: blocks keyed by the hash of their tokens and of every block before them,
    a block budget, LRU eviction (a request's blocks are touched tail first, so its head stays longest)."""

    def __init__(self, block: int = BLOCK_TOKENS, budget_blocks: int | None = None):
        if block < 1:
            raise ValueError(f"the block size must be at least 1 token, got {block}")
        self.block = block
        self.budget = budget_blocks
        self.blocks: OrderedDict[int, int] = OrderedDict()  # block hash -> the request that last used it, LRU first
        self.evicted: list[tuple[int, int]] = []  # (request that last used it, block number in that request)
        self._position: dict[int, int] = {}

    def insert(self, ids: np.ndarray, request: int, hashes: Sequence[int] | None = None) -> int:
        """Cache ``ids``'s whole blocks for ``request``; returns the tokens reused (leading blocks already held,
        within the tokens before the last), then evicts down to the budget. ``hashes``: the blocks' chained hashes
        where they were computed elsewhere (``block_hashes``, on the token pass's workers)."""
        data = np.ascontiguousarray(ids, dtype=np.int32)
        if hashes is None:
            hashes, parent = [], 0
            for start in range(0, len(data) // self.block * self.block, self.block):
                parent = hash((parent, data[start : start + self.block].tobytes()))
                hashes.append(parent)
        return self.insert_keys(list(hashes), len(data), request)

    def insert_keys(self, hashes: list[int], tokens: int, request: int) -> int:
        """``insert`` from the request's block keys (one per whole block, each naming the block and every block before
        it) and its length in tokens: for callers that hash once and simulate many budgets."""
        usable = (tokens - 1) // self.block  # blocks wholly before the last token
        hits = next((n for n, key in enumerate(hashes[:usable]) if key not in self.blocks), min(usable, len(hashes)))
        for number in range(len(hashes) - 1, -1, -1):  # tail first: the head ends most recently used
            key = hashes[number]
            self.blocks[key] = request
            self.blocks.move_to_end(key)
            self._position[key] = number
        while self.budget is not None and len(self.blocks) > self.budget:
            key, owner = self.blocks.popitem(last=False)
            self.evicted.append((owner, self._position.pop(key)))
        return hits * self.block


class SlotCache:
    """llama.cpp's server: a slot per session holding its last prompt; a new request reuses the common prefix with
    its session's slot and, with ``cache_reuse`` N > 0, later chunks of at least N equal tokens shifted into place."""

    def __init__(self, slots: int | None = None, cache_reuse: int = 0):
        self.slots = slots
        self.cache_reuse = cache_reuse
        self.held: OrderedDict[str | None, np.ndarray] = OrderedDict()  # session -> its slot's tokens, LRU first

    def insert(self, ids: np.ndarray, session: str | None) -> int:
        """The tokens ``ids`` reuses from its session's slot (taking over the least recently used slot when every
        slot is taken); the slot then holds ``ids``."""
        if session in self.held:
            cached = self.held.pop(session)
        elif self.slots is not None and len(self.held) >= self.slots:
            _, cached = self.held.popitem(last=False)
        else:
            cached = np.zeros(0, dtype=np.int32)
        self.held[session] = ids
        reused = common_prefix(cached, ids)
        if self.cache_reuse > 0:
            reused += _shifted_chunks(cached, ids, reused, self.cache_reuse)
        return min(reused, len(ids) - 1)


def _shifted_chunks(cached: np.ndarray, ids: np.ndarray, start: int, minimum: int) -> int:
    """llama.cpp's ``--cache-reuse``: after the common prefix, runs of at least ``minimum`` tokens equal in the cache
    and the prompt are shifted into place (the cache is scanned forward; a shorter run is skipped a token at a time)."""
    head_c = head_p = start
    reused = 0
    while head_c < len(cached) and head_p < len(ids):
        run = common_prefix(cached[head_c:], ids[head_p:])
        if run >= minimum:
            reused += run
            head_c += run
            head_p += run
        else:
            head_c += 1
    return reused


def block_hashes(ids: np.ndarray, block: int) -> np.ndarray:
    """The chained hashes of ``ids``'s whole blocks (each of its tokens and the hash before it), the same in every
    process (BLAKE2b, 8 bytes; Python's ``hash`` of bytes is salted per process): what the token pass's workers send."""
    data = np.ascontiguousarray(ids, dtype=np.int32)
    out, parent = np.zeros(len(data) // block, dtype=np.int64), b""
    for number in range(len(out)):
        parent = hashlib.blake2b(parent + data[number * block : (number + 1) * block].tobytes(), digest_size=8).digest()
        out[number] = int.from_bytes(parent, "little", signed=True)
    return out


class Engines:
    """The three simulated engines side by side, fed one request at a time: one serving replica's caches."""

    def __init__(self, settings: CacheSettings):
        self.radix = RadixCache(settings.budget_tokens)
        self.blocks = BlockCache(settings.block, settings.budget_blocks)
        self.slots = SlotCache(settings.slots, settings.cache_reuse)

    def insert(self, ids: np.ndarray, request: int, session: str | None, time: int, hashes: Sequence[int] | None = None) -> dict[str, int]:
        """Each engine caches ``ids``; the tokens each reused (``ENGINES`` order)."""
        return {
            "vllm": self.blocks.insert(ids, request, hashes),
            "sglang": self.radix.insert(ids, request, session, time),
            "llama_cpp": self.slots.insert(ids, session),
        }
