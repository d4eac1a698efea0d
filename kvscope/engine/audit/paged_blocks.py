"""The block arithmetic of a paged KV cache, apart from any cache that holds blocks (vLLM keeps its block hashing
apart from its pool the same way): the default block size, the part of a prefix whole blocks cover, and the chained
block hashes every process computes alike. The audit's lowest layer: the diff (``changes``) counts blocks with it, the
simulated block cache (``simulate.caches.BlockCache``) and the token pass's workers hash with it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

BLOCK_TOKENS = 16  # vLLM's default KV block size
BLOCK_SIZES = (1, 16, 32, 64, 128, 256)  # the block sizes a log's counts are read against (``--fit-observed``, the gap causes)
# nonzero counts a block size is read from (``block_of_counts``): a block-b server's count is a multiple of 2b about half
# the time, so 4 counts read a block twice too large by coincidence about 1 time in 16, four times too large 1 in 256
MIN_BLOCK_COUNTS = 4


def block_prefix(tokens: int, block: int) -> int:
    """The part of a common prefix that whole blocks cover."""
    return tokens // block * block


def block_of_counts(counts: Iterable[int | None]) -> int | None:
    """The block size a paged server's reported cached counts were served with (it caches whole blocks, so each is a
    multiple of its block): the largest of ``BLOCK_SIZES`` above 1 dividing every nonzero count, where at least
    ``MIN_BLOCK_COUNTS`` are nonzero; else None (too few to tell a block from a coincidence, or counts that are not
    whole blocks: a token cache's, or counts some other cause moved)."""
    nonzero = [count for count in counts if count]
    if len(nonzero) < MIN_BLOCK_COUNTS:
        return None
    return max((size for size in BLOCK_SIZES if size > 1 and all(count % size == 0 for count in nonzero)), default=None)


def block_hashes(ids: np.ndarray, block: int) -> np.ndarray:
    """The chained hashes of ``ids``'s whole blocks (each of its tokens and the hash before it), the same in every
    process (BLAKE2b, 8 bytes; Python's ``hash`` of bytes is salted per process): what the token pass's workers send."""
    data = np.ascontiguousarray(ids, dtype=np.int32)
    out, parent = np.zeros(len(data) // block, dtype=np.int64), b""
    for number in range(len(out)):
        parent = hashlib.blake2b(parent + data[number * block : (number + 1) * block].tobytes(), digest_size=8).digest()
        out[number] = int.from_bytes(parent, "little", signed=True)
    return out
