"""Prefix caches simulated as three serving engines hold them, fed the log's requests in order; each a ``PrefixCache``
(``prefix_cache``: ``match``, ``insert``, ``hold``), named in ``registry``.

- ``vllm`` (``BlockCache``): whole blocks (16 tokens, ``block``), each keyed by its tokens and every block before it. A
  request reuses the leading blocks found. Under ``budget_blocks`` the least recently used block goes first (a
  request's blocks are touched tail first, so its tail goes before its head). The keys alone, the same in every
  process, are ``blocks.block_hashes`` (the one block hash: the cache, the workers and ``fit_observed`` hash alike),
  apart from the pool that holds them.
- ``sglang`` (``radix.RadixCache``): a token radix tree. A request reuses the longest prefix in the tree. Under
  ``budget_tokens`` the least recently used leaf goes first, a whole node at a time, until the tokens fit.
- ``llama_cpp`` (``SlotCache``): one slot per session holding its last prompt (a client that pins each session to a
  slot). A request reuses the common prefix with its slot, plus, with ``cache_reuse`` N > 0, later chunks of at least N
  equal tokens shifted into place. When the sessions outnumber ``slots``, the least recently used slot is taken over.
  With ``prompt_cache``, the server as a client that pins no slot meets it: slots chosen by prompt similarity, and the
  RAM prompt cache that saves and restores slots (``ServerSlots``).

Every engine computes at least the last token of a request (its logits are the answer), so a request identical to a
cached one reuses all but one token. After a request, each engine holds what its server holds: the prompt and the
reply tokens it computed (``CacheRequest.held``; ``replies`` gives the rules, ``step`` feeds them): vLLM its whole
blocks, SGLang and the llama.cpp slot every token. Budgets default to unbounded. The radix tree also answers which
earlier request a new one shares its longest prefix with (``RadixCache.matched``), among those still in the cache (so
matching honours the SGLang budget: a request evicted whole is no longer a match, one evicted down to its head is
matched by its head), preferring the same session's latest request among equally long prefixes.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from kvscope.engine.audit.changes.fields import common_prefix
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.paged_blocks import BLOCK_SIZES, block_hashes
from kvscope.engine.audit.simulate.budgets import GIB, LLAMA_AUTO_SLOTS, Budget, kv_memory, prompt_ram_tokens
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest, CacheSettings, PrefixCache, fit_budgets
from kvscope.engine.audit.simulate.prompt_ram import PromptRam

EVICTIONS_KEPT = 4_096  # evictions a cache remembers (the latest, for inspection), not every one of a long log's
_LLAMA_BUILD = re.compile(r"system_fingerprint=b\d+-[0-9a-f]+")  # llama.cpp's build_info


class BlockCache(PrefixCache):
    """vLLM's automatic prefix caching: blocks keyed by the hash of their tokens and of every block before them,
    a block budget, LRU eviction (a request's blocks are touched tail first, so its head stays longest)."""

    name = "vllm"
    owned_by = "vllm"
    counts_in_blocks = True

    @classmethod
    def wrote(cls, marks: Collection[str]) -> str | None:
        """vLLM's marks (``vllm/entrypoints/openai``): its ``system_fingerprint`` (``vllm-<version>-...``,
        ``fingerprint.py``), else the fields its chat and completions answers add to OpenAI's (``stop_reason`` in
        each choice, ``kv_transfer_params`` beside them: ``chat_completion/protocol.py``)."""
        fingerprint = next((mark for mark in marks if mark.startswith("system_fingerprint=vllm-")), None)
        if fingerprint:
            return f"{fingerprint.replace('=', ' ', 1)} (vLLM's fingerprint)"
        found = [mark for mark in ("choices.stop_reason", "kv_transfer_params") if mark in marks]
        return f"{' and '.join(found)} (fields vLLM adds to OpenAI's answer)" if found else None

    @classmethod
    def granule(cls, block: int) -> int:
        return block

    @classmethod
    def fit_grid(cls, working: int) -> list[dict[str, Any]]:
        """Every block size (``BLOCK_SIZES``) under every budget (``fit_budgets``, in tokens)."""
        return [{"block": block, "budget_tokens": budget} for block in BLOCK_SIZES for budget in fit_budgets(working)]

    @classmethod
    def fitted(cls, setting: Mapping[str, Any]) -> BlockCache:
        block, budget = setting["block"], setting["budget_tokens"]
        return cls(block, None if budget is None else max(budget // block, 1))

    @classmethod
    def excess_hint(cls, observed: int, usable: int, block: int) -> str | None:
        size = next((size for size in BLOCK_SIZES if size < block and usable // size * size == observed), None)
        blocks = f"{size}-token blocks" if size else "blocks"
        return f"a smaller block: {observed:,} of the {usable:,} shared tokens fit in {blocks}, not {block}-token ones"

    def __init__(self, block: int, budget_blocks: int | None = None):
        if block < 1:
            raise ValueError(f"the block size must be at least 1 token, got {block}")
        self.block = block
        self.budget = budget_blocks
        self.blocks = BlockTable()  # block hash -> the request that last used it and its number there, in LRU order
        self.evicted: deque[tuple[int, int]] = deque(maxlen=EVICTIONS_KEPT)  # (request that last used it, block number in it), the latest

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> BlockCache:
        return cls(settings.block, cls.budget(settings).limit)

    @classmethod
    def budget(cls, settings: CacheSettings) -> Budget:
        """--kv-budget-blocks, else vLLM's ``num_gpu_blocks`` less its null block: the KV memory
        (``determine_available_memory``: ``VLLM_CPU_KVCACHE_SPACE`` on its CPU backend, else the GPU's memory ×
        ``gpu_memory_utilization`` less the weights) over a block's bytes over every layer (``page_size_bytes`` × layers)."""
        block, size = settings.block, settings.server
        if settings.budget_blocks is not None:
            return Budget(cls.name, "blocks", settings.budget_blocks, settings.budget_blocks * block, "--kv-budget-blocks")
        if size is None or (size.gpu_gib is None and size.cpu_kvcache_gib is None):
            return Budget(cls.name, "blocks", None, None, "no --kv-budget-blocks, no --gpu-memory-gib or --vllm-cpu-kvcache-space")
        if size.cpu_kvcache_gib is not None:
            what = f"VLLM_CPU_KVCACHE_SPACE={size.cpu_kvcache_gib:g} GiB"
            memory = kv_memory(size.cpu_kvcache_gib * GIB, what)
        else:
            what = f"{size.gpu_gib:g} GiB × gpu_memory_utilization {size.gpu_memory_utilization:g} − {size.weights_words()}"
            memory = kv_memory(size.gpu_gib * GIB * size.gpu_memory_utilization - size.model.weight_bytes(size.served), what)
        page = block * size.model.kv_bytes_per_token(size.served)
        blocks = memory // page
        if blocks < 2:
            raise RequestLogError(f"{what} holds {blocks} {block}-token block(s) of {size.model.name}: vLLM needs at least 2")
        source = f"vLLM's num_gpu_blocks {blocks:,} − its null block: {what} over {page:,} B a block ({size.kv_words()} × {block})"
        source += "" if size.cpu_kvcache_gib else "; activations not counted"
        return Budget(cls.name, "blocks", blocks - 1, (blocks - 1) * block, source)

    def match(self, request: CacheRequest) -> int:
        """The prompt's leading whole blocks held, in tokens."""
        whole = len(request.ids) // self.block
        keys = self.keys(request.ids) if request.hashes is None else np.asarray(request.hashes[:whole], dtype=np.int64)
        return self.blocks.leading(keys) * self.block

    def insert(self, request: CacheRequest) -> int:
        """The leading blocks already held, within the tokens before the prompt's last; then the whole blocks of
        ``request.tokens`` are held (keyed by ``request.hashes`` where a worker computed them), and the LRU evicted."""
        return self.insert_keys(self._held_keys(request), len(request.ids), request.request)

    @property
    def tells_prompts_only(self) -> bool:
        """Unbounded, every block a prompt ever held is held still: each marked when a prompt held it (not only a
        reply), the marked blocks are the cache a server caching no reply would hold."""
        return self.budget is None

    def prompts_only(self, request: CacheRequest) -> int:
        """The prompt's leading blocks an earlier prompt held, within the tokens before its last."""
        usable = (len(request.ids) - 1) // self.block
        keys = self.keys(request.ids[: usable * self.block]) if request.hashes is None else request.hashes[:usable]
        return self.blocks.leading(np.asarray(keys, dtype=np.int64), prompted=True) * self.block

    def hold(self, request: CacheRequest) -> None:
        self.hold_keys(self._held_keys(request), request.request)

    @property
    def held_tokens(self) -> int:
        """The tokens held now (its whole blocks)."""
        return len(self.blocks) * self.block

    def _held_keys(self, request: CacheRequest) -> np.ndarray:
        return self.keys(request.tokens) if request.hashes is None else np.asarray(request.hashes, dtype=np.int64)

    def keys(self, ids: np.ndarray) -> np.ndarray:
        """The chained keys of ``ids``'s whole blocks: ``blocks.block_hashes``, as every process computes them."""
        return block_hashes(ids, self.block)

    def insert_keys(self, hashes: Sequence[int] | np.ndarray, tokens: int, request: int) -> int:
        """``insert`` from the block keys of what is held (one per whole block, each naming the block and every block
        before it) and the prompt's length in tokens: for callers that hash once and simulate many budgets."""
        hashes = np.asarray(hashes, dtype=np.int64)
        usable = (tokens - 1) // self.block  # blocks wholly before the prompt's last token
        hits = self.blocks.leading(hashes[:usable])
        self.hold_keys(hashes, request, prompt_blocks=tokens // self.block)
        return hits * self.block

    def hold_keys(self, hashes: Sequence[int] | np.ndarray, request: int, prompt_blocks: int = 0) -> None:
        """Keep these whole blocks for ``request`` (tail first: the head ends most recently used; the first
        ``prompt_blocks`` marked as a prompt's), then evict."""
        self.blocks.touch(np.asarray(hashes, dtype=np.int64), request, prompt_blocks)
        if self.budget is not None and len(self.blocks) > self.budget:
            self.evicted.extend(self.blocks.evict(len(self.blocks) - self.budget))


class BlockTable:
    """The blocks a ``BlockCache`` holds, as an ``OrderedDict`` of block hash -> (request that last used it, its
    number there) in LRU order would hold them, without a Python object per block (169 bytes a block that way; about
    50 here: an unbounded cache of a million requests holds tens of millions of blocks).

    The 64-bit keys sit in an open-addressing table (linear probing, deleted slots marked, rebuilt at most 5/8 full),
    each slot with its request, its number, its stamp and whether a prompt held it (not only a reply). The LRU order
    is a log of touched slots, oldest first: an entry is current while its slot's stamp is its place in the log (a
    slot touched again gets a later entry), so the least recently used block is the first current entry. The log is
    compacted once it is mostly stale."""

    _EMPTY, _HELD, _DELETED = 0, 1, 2

    def __init__(self, capacity: int = 1 << 10):
        self._allocate(capacity)
        self.order = np.zeros(capacity, dtype=np.int32)  # the log: touched slots, oldest first
        self.head = self.end = 0  # the log's entries before ``head`` are all stale
        self.count = 0  # blocks held

    def _allocate(self, capacity: int) -> None:
        self.keys = np.zeros(capacity, dtype=np.int64)
        self.state = np.zeros(capacity, dtype=np.int8)
        self.owner = np.zeros(capacity, dtype=np.int32)  # the request that last used the block
        self.number = np.zeros(capacity, dtype=np.int32)  # the block's number in that request
        self.stamp = np.full(capacity, -1, dtype=np.int32)  # the block's place in the log
        self.prompted = np.zeros(capacity, dtype=bool)  # a prompt held the block (not only a reply)
        self.used = 0  # slots held or deleted

    def __len__(self) -> int:
        return self.count

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """Each key's slot (-1: not held)."""
        mask, found, probe, todo = self._probing(keys)
        while len(todo):
            at = probe[todo]
            state = self.state[at]
            hit = (state == self._HELD) & (self.keys[at] == keys[todo])
            found[todo[hit]] = at[hit]
            todo = todo[~hit & (state != self._EMPTY)]
            probe[todo] = (probe[todo] + 1) & mask
        return found

    def _probing(self, keys: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Linear probing's start for ``keys``: the table's mask, a slot per key (-1 until found), each key's first
        slot to look at, and the keys still looking."""
        mask = len(self.keys) - 1
        return mask, np.full(len(keys), -1, dtype=np.int64), keys & mask, np.arange(len(keys))

    def leading(self, keys: np.ndarray, prompted: bool = False) -> int:
        """How many of ``keys``, from the first, are held (``prompted``: and were held by a prompt)."""
        slots = self.slots(keys)
        held = slots >= 0
        if prompted:
            held[held] = self.prompted[slots[held]]
        missing = np.flatnonzero(~held)
        return int(missing[0]) if len(missing) else len(keys)

    def touch(self, keys: np.ndarray, request: int, prompt_blocks: int = 0) -> None:
        """Hold ``keys`` for ``request`` (key k as its block number k), the last touched first: the first key ends
        most recently used (a key given twice keeps its first number); the first ``prompt_blocks`` keys are marked as
        a prompt's."""
        numbers = np.arange(len(keys), dtype=np.int32)
        unique, first = np.unique(keys, return_index=True)
        if len(unique) < len(keys):  # (chained hashes never repeat in one request; a caller's keys may)
            numbers = np.sort(first).astype(np.int32)
            keys = keys[numbers]
        if (self.used + len(keys)) * 8 > len(self.keys) * 5:  # room for every key first: a rebuild moves the slots
            self._rebuild(len(self.keys), self.count + len(keys))
        slots = self.slots(keys)
        new = slots < 0
        if new.any():
            slots[new] = self._insert(keys[new])
        self.owner[slots], self.number[slots] = request, numbers
        self.prompted[slots[numbers < prompt_blocks]] = True
        self._log(slots[::-1])

    def evict(self, count: int) -> list[tuple[int, int]]:
        """Drop the ``count`` least recently used blocks; their (request, number), oldest first."""
        gone: list[np.ndarray] = []
        while count > 0:
            window = np.arange(self.head, min(self.head + max(count * 2, 64), self.end))
            slots = self.order[window]
            current = window[(self.stamp[slots] == window) & (self.state[slots] == self._HELD)][:count]
            taken = self.order[current]
            self.state[taken], self.stamp[taken] = self._DELETED, -1
            self.count -= len(taken)
            count -= len(taken)
            gone.append(taken)
            self.head = int(current[-1]) + 1 if count == 0 and len(current) else int(window[-1]) + 1
        taken = np.concatenate(gone) if gone else np.zeros(0, dtype=np.int64)
        return list(zip(self.owner[taken].tolist(), self.number[taken].tolist()))

    def _insert(self, keys: np.ndarray) -> np.ndarray:
        """Slots for new keys (none held; the table has room for them)."""
        mask, slots, probe, todo = self._probing(keys)
        while len(todo):
            at = probe[todo]
            free = self.state[at] != self._HELD
            _, first = np.unique(at, return_index=True)  # one new key per free slot a round
            won = np.zeros(len(todo), dtype=bool)
            won[first] = True
            won &= free
            winners = todo[won]
            slots[winners] = at[won]
            self.used += int(np.count_nonzero(self.state[at[won]] == self._EMPTY))
            self.state[at[won]], self.keys[at[won]], self.prompted[at[won]] = self._HELD, keys[winners], False
            todo = todo[~won]
            probe[todo] = np.where(self.state[probe[todo]] == self._HELD, (probe[todo] + 1) & mask, probe[todo])
        self.count += len(keys)
        return slots

    def _rebuild(self, capacity: int, needed: int) -> None:
        """The table with only the blocks held, in a capacity at most a quarter full after ``needed`` blocks; the log
        compacted to its current entries."""
        while needed * 4 > capacity:
            capacity *= 2
        live = self._current()
        keys, owner, number, prompted = self.keys[live], self.owner[live], self.number[live], self.prompted[live]
        self._allocate(capacity)
        self.head = self.end = 0
        self.count = 0
        slots = self._insert(keys)
        self.owner[slots], self.number[slots], self.prompted[slots] = owner, number, prompted
        self.order = np.zeros(max(len(slots) * 2, 1 << 10), dtype=np.int32)
        self._log(slots)

    def _current(self) -> np.ndarray:
        """The held blocks' slots in LRU order (oldest first)."""
        window = np.arange(self.head, self.end)
        slots = self.order[window]
        return slots[(self.stamp[slots] == window) & (self.state[slots] == self._HELD)]

    def _log(self, slots: np.ndarray) -> None:
        """Append touches of ``slots`` (in this order) to the log, compacting or growing it first."""
        if self.end + len(slots) > len(self.order):
            if self.end - self.head > 2 * self.count:
                current = self._current()
                self.order[: len(current)] = current
                self.stamp[current] = np.arange(len(current), dtype=np.int32)
                self.head, self.end = 0, len(current)
            if self.end + len(slots) > len(self.order):
                self.order = np.concatenate([self.order, np.zeros(max(len(self.order), len(slots)), dtype=np.int32)])
        self.order[self.end : self.end + len(slots)] = slots
        self.stamp[slots] = np.arange(self.end, self.end + len(slots), dtype=np.int32)
        self.end += len(slots)


class SlotCache(PrefixCache):
    """llama.cpp's server: a slot per session holding its last prompt; a new request reuses the common prefix with
    its session's slot and, with ``cache_reuse`` N > 0, later chunks of at least N equal tokens shifted into place."""

    name = "llama_cpp"
    owned_by = "llamacpp"

    @classmethod
    def wrote(cls, marks: Collection[str]) -> str | None:
        """llama-server's marks (``tools/server``): the ``timings`` every answer carries, and its ``system_fingerprint``
        (the build, ``b<number>-<commit>``)."""
        found = ["timings"] if "timings" in marks else []
        found += [mark.replace("=", " ", 1) for mark in marks if _LLAMA_BUILD.fullmatch(mark)]
        return f"{' and '.join(found)} (llama-server's)" if found else None

    @classmethod
    def excess_hint(cls, observed: int, usable: int, block: int) -> str | None:
        return "a cache shared across sessions: a llama.cpp slot holds only its own session's last prompt"

    @classmethod
    def fit_grid(cls, working: int) -> list[dict[str, Any]]:
        """The server's own slot choice with its RAM prompt cache (``ServerSlots``) at 4 slots with one KV cache (None)
        or ``-np`` 1, 2, 4, 8; then a slot per session (None) or that many slots, each with ``--cache-reuse`` off or at
        16, 64 or 256 tokens."""
        slots = (None, 1, 2, 4, 8)
        shared = [{"slots": count, "prompt_cache": True, "cache_reuse": 0} for count in slots]
        return shared + [{"slots": count, "prompt_cache": False, "cache_reuse": reuse} for count in slots for reuse in (0, 16, 64, 256)]

    @classmethod
    def fitted(cls, setting: Mapping[str, Any]) -> PrefixCache:
        if setting["prompt_cache"]:
            return ServerSlots(setting["slots"])
        return cls(setting["slots"], setting["cache_reuse"])

    def __init__(self, slots: int | None = None, cache_reuse: int = 0, context: int | None = None):
        self.slots = slots
        self.cache_reuse = cache_reuse
        self.context = context  # tokens a slot holds (its share of -c; None: no bound): the rest of a request is not kept
        self.held: OrderedDict[str | None, np.ndarray] = OrderedDict()  # session -> its slot's tokens, LRU first

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> PrefixCache:
        """A slot per session, or with ``prompt_cache`` the server as a client that pins no slot meets it
        (``ServerSlots``): the registry's one llama.cpp entry, in either mode, with the slots and context of ``budget``."""
        if settings.prompt_cache:
            return ServerSlots.from_settings(settings)
        budget = cls.budget(settings)
        return cls(budget.limit, settings.cache_reuse, budget.each)

    @staticmethod
    def _named_slots(settings: CacheSettings) -> int | None:
        """The slots named: --slots, else the server size's -np; None: the mode's default."""
        return settings.slots if settings.slots is not None or settings.server is None else settings.server.parallel

    @classmethod
    def budget(cls, settings: CacheSettings) -> Budget:
        """The slots' budget (``_slots_budget``), with the server's own slot choice (``prompt_cache``) its RAM prompt
        cache's limit too (``prompt_ram_tokens``)."""
        budget = cls._slots_budget(settings)
        if not settings.prompt_cache:
            return budget
        ram_tokens, words = prompt_ram_tokens(settings.cache_ram_mib, settings.kv_model)
        return dataclasses.replace(budget, source=f"{budget.source}; {words}", ram_tokens=ram_tokens)

    @classmethod
    def _slots_budget(cls, settings: CacheSettings) -> Budget:
        """--slots (or -np) slots, each holding its share of -c (``n_ctx_seq``: -c / -np, or all of -c where the server's
        auto slots share one unified KV cache); without either, the mode's slots and no bound on their tokens."""
        context = None if settings.server is None else settings.server.context
        named = cls._named_slots(settings)
        slots = named if named is not None or not (settings.prompt_cache or context) else LLAMA_AUTO_SLOTS  # a sized server's auto -np
        if slots is None:
            return Budget(cls.name, "slots", None, None, "a slot per session: no --slots or --llama-parallel")
        if context is None:
            named_by = "--slots" if named else "the server default"
            return Budget(cls.name, "slots", slots, None, f"{named_by}; no --llama-ctx-size: no bound on a slot's tokens")
        each = context if named is None else context // slots
        if each < 1:
            raise RequestLogError(f"--llama-ctx-size {context:,} split across {slots} slots leaves a slot no token")
        split = f"all of -c {context:,} in each (auto slots: one unified KV cache)" if named is None else f"-c {context:,} / -np {slots}"
        return Budget(cls.name, "slots", slots, each * slots, f"{slots} slots of {each:,} tokens: {split}", each)

    def match(self, request: CacheRequest) -> int:
        """The tokens the request shares with the slot it would take: its session's, else the least recently used
        one where every slot is taken (with ``cache_reuse``, the chunks shifted into place too)."""
        if request.session in self.held:
            cached = self.held[request.session]
        elif self.slots is not None and len(self.held) >= self.slots:
            cached = next(iter(self.held.values()))
        else:
            cached = np.zeros(0, dtype=np.int32)
        reused = common_prefix(cached, request.ids)
        if self.cache_reuse > 0:
            reused += _shifted_chunks(cached, request.ids, reused, self.cache_reuse)
        return reused

    def insert(self, request: CacheRequest) -> int:
        """The tokens reused from the slot (``match``, less the last token); the slot then holds ``request.tokens``."""
        reused = self.match(request)
        if request.session in self.held:
            del self.held[request.session]
        elif self.slots is not None and len(self.held) >= self.slots:
            self.held.popitem(last=False)
        self.held[request.session] = request.tokens[: self.context]
        return min(reused, len(request.ids) - 1)

    @property
    def held_tokens(self) -> int:
        """The tokens held now, over every slot."""
        return sum(len(tokens) for tokens in self.held.values())

    def hold(self, request: CacheRequest) -> None:
        """The session's slot, where it still has one, now holds ``request.tokens`` (its prompt and reply)."""
        if request.session in self.held:
            self.held[request.session] = request.tokens[: self.context]


class ServerSlots(PrefixCache):
    """llama.cpp's server as a client that pins no slot meets it, with its defaults: ``slots`` slots (4 with one unified
    KV cache where ``-np`` is not given), each request to the idle slot whose tokens share more than ``similarity`` of
    its prompt (the most), else to the least recently used slot; and a RAM prompt cache (``--cache-ram``, ``PromptRam``)
    that the slot saves to when it is about to lose half its tokens or more (or was taken by LRU) and restores from
    where an entry beats it; every other idle slot is saved when a request starts (and cleared, with the unified cache;
    with ``--cache-ram 0`` there is no RAM cache, and idle slots keep their tokens).
    From the pinned build's ``server-context.cpp`` (``get_available_slot``, ``cache_idle_slots``) and
    ``server-task.cpp`` (``server_prompt_cache``)."""

    name = "llama_cpp"

    def __init__(self, slots: int | None = None, similarity: float = 0.1, context: int | None = None, ram_tokens: int | None = None):
        self.unified = slots is None  # the server's -np auto: 4 slots, one KV cache
        self.clears_idle = self.unified and ram_tokens != 0  # --cache-idle-slots, which --cache-ram 0 turns off
        self.context = context  # tokens a slot holds (None: no bound)
        self.tokens = [np.zeros(0, dtype=np.int32) for _ in range(slots or LLAMA_AUTO_SLOTS)]
        self.used = [-1] * len(self.tokens)
        self.similarity = similarity
        self.ram = PromptRam(ram_tokens)
        self.time = 0

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> ServerSlots:
        """The slots named (else the auto 4 on one KV cache), each holding the tokens of ``SlotCache.budget``, with
        its RAM prompt cache's limit."""
        budget = SlotCache.budget(settings)
        return cls(SlotCache._named_slots(settings), context=budget.each, ram_tokens=budget.ram_tokens)

    def match(self, request: CacheRequest) -> int:
        """The tokens the request shares with the slot chosen for it (or the saved entry that slot would restore)."""
        slot, update = self._choose(request.ids)
        tokens = self.tokens[slot]
        if update:
            chosen = self.ram.best(tokens, request.ids, skip=self.ram.would_evict(tokens))
            tokens = tokens if chosen is None else self.ram.entry_tokens(chosen)
        return common_prefix(tokens, request.ids)

    def insert(self, request: CacheRequest) -> int:
        """The tokens reused (the slot chosen, restored from the RAM cache where that wins); the slot then holds
        ``request.tokens``, and the other slots are saved (and cleared, with the unified cache)."""
        ids = request.ids
        self.time += 1
        slot, update = self._choose(ids)
        if update:
            self.ram.save(self.tokens[slot])
            chosen = self.ram.best(self.tokens[slot], ids)
            if chosen is not None:
                self.tokens[slot] = self.ram.restore(chosen)
        reused = min(common_prefix(self.tokens[slot], ids), len(ids) - 1)
        for other in range(len(self.tokens)):
            if other != slot:
                self.ram.save(self.tokens[other])
                if self.clears_idle:
                    self.tokens[other] = np.zeros(0, dtype=np.int32)
        self.tokens[slot], self.used[slot] = request.tokens[: self.context], self.time
        return reused

    @property
    def held_tokens(self) -> int:
        """The tokens held now: the slots' and the RAM prompt cache's."""
        return sum(len(tokens) for tokens in self.tokens) + self.ram.tokens

    def hold(self, request: CacheRequest) -> None:
        """What holds the longest prompt that ``request.tokens`` goes on from (a slot, or its saved copy; a slot among
        equals) now holds it."""
        held = request.tokens[: self.context]
        fits = [n for n, tokens in enumerate(self.tokens) if 0 < len(tokens) < len(held) and np.array_equal(held[: len(tokens)], tokens)]
        best = max(fits, key=lambda n: len(self.tokens[n]), default=None)
        saved = self.ram.prefix_entry(held, len(held))
        if saved is not None and (best is None or self.ram.leaves[saved].depth > len(self.tokens[best])):
            self.ram.replace(saved, held)
        elif best is not None:
            self.tokens[best] = held

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
