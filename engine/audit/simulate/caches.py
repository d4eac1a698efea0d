"""Prefix caches simulated as three serving engines hold them, fed the log's requests in order.

- ``vllm``: whole blocks (16 tokens, ``block``), each keyed by its tokens and every block before it. A request
  reuses the leading blocks found. Under ``budget_blocks`` the least recently used block goes first (a request's
  blocks are touched tail first, so its tail goes before its head).
- ``sglang``: a token radix tree. A request reuses the longest prefix in the tree. Under ``budget_tokens`` the least
  recently used leaf goes first, a whole node at a time, until the tokens fit (a heap of the leaves, so an eviction
  costs a log, not a walk of the tree).
- ``llama_cpp``: one slot per session holding its last prompt (a client that pins each session to a slot). A request
  reuses the common prefix with its slot, plus, with ``cache_reuse`` N > 0, later chunks of at least N equal tokens
  shifted into place. When the sessions outnumber ``slots``, the least recently used slot is taken over. With
  ``prompt_cache``, the server as a client that pins no slot meets it: slots chosen by prompt similarity, and the
  RAM prompt cache that saves and restores slots (``ServerSlots``).

Every engine computes at least the last token of a request (its logits are the answer), so a request identical to a
cached one reuses all but one token. After a request, each engine holds what its server holds: the prompt and the
reply tokens it computed (``held``; ``replies`` gives the rules, ``simulation`` feeds them): vLLM its whole blocks,
SGLang and the llama.cpp slot every token. Budgets default to unbounded. The radix tree also answers which earlier request
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
from typing import TYPE_CHECKING

import numpy as np

from engine.audit.changes.fields import BLOCK_TOKENS, common_prefix

if TYPE_CHECKING:
    from engine.audit.report.types import CacheSettingsDict


@dataclass(frozen=True)
class CacheSettings:
    """The simulated engines' settings (None: unbounded)."""

    block: int = BLOCK_TOKENS
    budget_blocks: int | None = None  # vLLM
    budget_tokens: int | None = None  # SGLang
    slots: int | None = None  # llama.cpp (None: one per session; with prompt_cache, the server's 4 with one KV cache)
    cache_reuse: int = 0  # llama.cpp --cache-reuse N (0: off, its default)
    prompt_cache: bool = False  # llama.cpp: clients pin no slot; slots by similarity and the RAM prompt cache (``ServerSlots``)

    def as_dict(self) -> CacheSettingsDict:
        return {
            "block": self.block,
            "budget_blocks": self.budget_blocks,
            "budget_tokens": self.budget_tokens,
            "slots": self.slots,
            "cache_reuse": self.cache_reuse,
            "prompt_cache": self.prompt_cache,
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

    def insert(self, ids: np.ndarray, request: int, session: str | None, time: int, held: np.ndarray | None = None) -> int:
        """Cache ``held`` (``ids`` and the reply tokens the server computed after them; ``ids`` alone by default) for
        ``request``; returns the tokens of ``ids`` reused (the prefix already held, before its last token), then
        evicts down to the budget."""
        held = ids if held is None else held
        node, depth, found = self.root, 0, None
        self._touch(node, request, session, time)
        while depth < len(held):
            token = int(held[depth])
            child = node.children.get(token)
            if child is None:
                found = depth
                node = _Node(np.array(held[depth:], dtype=np.int32), node)  # a copy: the tree holds new tokens only
                node.parent.children[token] = node
                self.tokens += len(node.key)
                self._touch(node, request, session, time)
                break
            shared = common_prefix(child.key, held[depth : depth + len(child.key)])
            if shared < len(child.key):
                child = self._split(child, shared)
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

    def insert(self, ids: np.ndarray, request: int, hashes: Sequence[int] | None = None, held: np.ndarray | None = None) -> int:
        """Cache the whole blocks of ``held`` (``ids`` and the reply tokens the server computed after them; ``ids``
        alone by default) for ``request``; returns the tokens of ``ids`` reused (leading blocks already held, within
        the tokens before its last), then evicts down to the budget. ``hashes``: ``held``'s chained block hashes where
        they were computed elsewhere (``block_hashes``, on the token pass's workers)."""
        held = ids if held is None else held
        return self.insert_keys(list(self.keys(held) if hashes is None else hashes), len(ids), request)

    def keys(self, ids: np.ndarray) -> list[int]:
        """The chained keys of ``ids``'s whole blocks (Python's ``hash``: one process's keys)."""
        data = np.ascontiguousarray(ids, dtype=np.int32)
        keys, parent = [], 0
        for start in range(0, len(data) // self.block * self.block, self.block):
            parent = hash((parent, data[start : start + self.block].tobytes()))
            keys.append(parent)
        return keys

    def insert_keys(self, hashes: list[int], tokens: int, request: int) -> int:
        """``insert`` from the block keys of what is held (one per whole block, each naming the block and every block
        before it) and the prompt's length in tokens: for callers that hash once and simulate many budgets."""
        usable = (tokens - 1) // self.block  # blocks wholly before the prompt's last token
        hits = next((n for n, key in enumerate(hashes[:usable]) if key not in self.blocks), min(usable, len(hashes)))
        self.hold_keys(hashes, request)
        return hits * self.block

    def hold_keys(self, hashes: list[int], request: int) -> None:
        """Keep these whole blocks for ``request`` (tail first: the head ends most recently used), then evict."""
        for number in range(len(hashes) - 1, -1, -1):
            key = hashes[number]
            self.blocks[key] = request
            self.blocks.move_to_end(key)
            self._position[key] = number
        while self.budget is not None and len(self.blocks) > self.budget:
            key, owner = self.blocks.popitem(last=False)
            self.evicted.append((owner, self._position.pop(key)))


class SlotCache:
    """llama.cpp's server: a slot per session holding its last prompt; a new request reuses the common prefix with
    its session's slot and, with ``cache_reuse`` N > 0, later chunks of at least N equal tokens shifted into place."""

    def __init__(self, slots: int | None = None, cache_reuse: int = 0):
        self.slots = slots
        self.cache_reuse = cache_reuse
        self.held: OrderedDict[str | None, np.ndarray] = OrderedDict()  # session -> its slot's tokens, LRU first

    def insert(self, ids: np.ndarray, session: str | None, held: np.ndarray | None = None) -> int:
        """The tokens ``ids`` reuses from its session's slot (taking over the least recently used slot when every
        slot is taken); the slot then holds ``held`` (``ids`` and the reply tokens computed after them)."""
        if session in self.held:
            cached = self.held.pop(session)
        elif self.slots is not None and len(self.held) >= self.slots:
            _, cached = self.held.popitem(last=False)
        else:
            cached = np.zeros(0, dtype=np.int32)
        self.held[session] = ids if held is None else held
        reused = common_prefix(cached, ids)
        if self.cache_reuse > 0:
            reused += _shifted_chunks(cached, ids, reused, self.cache_reuse)
        return min(reused, len(ids) - 1)

    def hold(self, held: np.ndarray, session: str | None) -> None:
        """The session's slot, where it still has one, now holds ``held`` (its prompt and reply)."""
        if session in self.held:
            self.held[session] = held


class ServerSlots:
    """llama.cpp's server as a client that pins no slot meets it, with its defaults: ``slots`` slots (4 with one unified
    KV cache where ``-np`` is not given), each request to the idle slot whose tokens share more than ``similarity`` of
    its prompt (the most), else to the least recently used slot; and a RAM prompt cache (``--cache-ram``) that the slot
    saves to when it is about to lose half its tokens or more (or was taken by LRU) and restores from when an entry
    keeps at least a quarter of itself and beats the slot on both shares; every other idle slot is saved when a request
    starts (and cleared, with the unified cache). From the pinned build's ``server-context.cpp``
    (``get_available_slot``, ``cache_idle_slots``) and ``server-task.cpp`` (``server_prompt_cache::alloc`` / ``load``);
    the cache's 8 GiB size limit is not simulated (an audit's logs stay far below it)."""

    def __init__(self, slots: int | None = None, similarity: float = 0.1):
        self.unified = slots is None  # the server's -np auto: 4 slots, one KV cache
        self.tokens = [np.zeros(0, dtype=np.int32) for _ in range(slots or 4)]
        self.used = [-1] * len(self.tokens)
        self.similarity = similarity
        self.saved: list[np.ndarray] = []  # the RAM prompt cache, oldest first
        self.time = 0

    def insert(self, ids: np.ndarray, session: str | None, held: np.ndarray | None = None) -> int:
        """The tokens ``ids`` reuses (the slot chosen, restored from the RAM cache where that wins); the slot then
        holds ``held``, and the other slots are saved (and cleared, with the unified cache)."""
        self.time += 1
        slot, update = self._choose(ids)
        if update:
            self._save(self.tokens[slot])
            self._restore(slot, ids)
        reused = min(common_prefix(self.tokens[slot], ids), len(ids) - 1)
        for other in range(len(self.tokens)):
            if other != slot:
                self._save(self.tokens[other])
                if self.unified:
                    self.tokens[other] = np.zeros(0, dtype=np.int32)
        self.tokens[slot], self.used[slot] = (ids if held is None else held), self.time
        return reused

    def hold(self, held: np.ndarray, session: str | None) -> None:
        """What holds the longest prompt that ``held`` goes on from (a slot, or its saved copy) now holds ``held``."""
        places = [*self.tokens, *self.saved]
        fits = [n for n, tokens in enumerate(places) if 0 < len(tokens) < len(held) and np.array_equal(held[: len(tokens)], tokens)]
        if fits:
            best = max(fits, key=lambda n: len(places[n]))
            if best < len(self.tokens):
                self.tokens[best] = held
            else:
                self.saved[best - len(self.tokens)] = held

    def _choose(self, ids: np.ndarray) -> tuple[int, bool]:
        """The slot for ``ids`` and whether the prompt cache is updated first (``get_available_slot``)."""
        best, best_share = None, 0.0
        for slot, tokens in enumerate(self.tokens):
            if len(tokens):
                share = common_prefix(tokens, ids) / len(ids)
                if share > best_share and share > self.similarity:
                    best, best_share = slot, share
        if best is not None:
            return best, best_share * len(ids) / len(self.tokens[best]) < 0.5
        oldest = 0
        for slot in range(len(self.tokens)):
            if self.used[slot] <= self.used[oldest]:
                oldest = slot
        return oldest, True

    def _save(self, tokens: np.ndarray) -> None:
        """``server_prompt_cache::alloc``: nothing for an empty slot or one a saved entry already holds whole; saved
        entries the slot's tokens hold whole are dropped."""
        if not len(tokens) or any(common_prefix(entry, tokens) == len(tokens) for entry in self.saved):
            return
        self.saved = [entry for entry in self.saved if common_prefix(entry, tokens) < len(entry)]
        self.saved.append(tokens)

    def _restore(self, slot: int, ids: np.ndarray) -> None:
        """``server_prompt_cache::load``: the saved entry that keeps at least a quarter of itself and beats the slot's
        own tokens on both shares (kept of the entry, and of the new prompt) replaces them, and leaves the cache."""
        current = self.tokens[slot]
        shared = common_prefix(current, ids)
        keep, share = (shared / len(current) if len(current) else -1.0), shared / len(ids)
        chosen = None
        for number, entry in enumerate(self.saved):
            shared = common_prefix(entry, ids)
            if shared / len(entry) < 0.25:
                continue
            if keep < shared / len(entry) and share < shared / len(ids):
                keep, share, chosen = shared / len(entry), shared / len(ids), number
        if chosen is not None:
            self.tokens[slot] = self.saved.pop(chosen)


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
        self.slots = ServerSlots(settings.slots) if settings.prompt_cache else SlotCache(settings.slots, settings.cache_reuse)

    def insert(
        self,
        ids: np.ndarray,
        request: int,
        session: str | None,
        time: int,
        hashes: Sequence[int] | None = None,
        held: np.ndarray | None = None,
    ) -> dict[str, int]:
        """Each engine serves ``ids`` and then holds ``held`` (``ids`` and the reply tokens the server computed, by
        default ``ids``; ``hashes``: ``held``'s block hashes); the tokens of ``ids`` each reused (``ENGINES`` order)."""
        return {
            "vllm": self.blocks.insert(ids, request, hashes, held),
            "sglang": self.radix.insert(ids, request, session, time, held),
            "llama_cpp": self.slots.insert(ids, session, held),
        }

    def hold(self, held: np.ndarray, request: int, session: str | None, time: int, hashes: Sequence[int] | None = None) -> None:
        """Each engine now also holds ``held``: a request's prompt and its reply, known only once the next turn resent
        it (``simulation``)."""
        self.blocks.hold_keys(list(self.blocks.keys(held) if hashes is None else hashes), request)
        self.radix.insert(held, request, session, time)
        self.slots.hold(held, session)
