"""The block arithmetic of a paged KV cache: whole-block prefixes, chained block hashes that name a block by its
tokens and everything before it, alike in every process, and the block size a paged server's counts were served with."""

import subprocess
import sys

import numpy as np

from kvscope.engine.audit.paged_blocks import BLOCK_TOKENS, MIN_BLOCK_COUNTS, block_hashes, block_of_counts, block_prefix


def test_whole_blocks_cover_a_prefix_rounded_down():
    assert BLOCK_TOKENS == 16 and [block_prefix(n, BLOCK_TOKENS) for n in (0, 15, 16, 47, 48)] == [0, 0, 16, 32, 48]
    assert block_prefix(47, block=32) == 32


def test_the_block_size_is_the_largest_dividing_every_nonzero_count_when_there_are_enough():
    assert MIN_BLOCK_COUNTS == 4
    assert block_of_counts([0, None, 32, 64, 96, 224, 0]) == 32  # zeros and unreported counts say nothing
    assert block_of_counts([128, 256, 128, 128]) == 128
    assert block_of_counts([32, 64, 96]) is None  # three counts: too few to tell a block from a coincidence
    assert block_of_counts([0] * 10 + [None] * 3) is None
    assert block_of_counts([32, 64, 96, 48]) == 16  # 48 is no multiple of 32: the largest size dividing all
    assert block_of_counts([47, 46, 82, 30]) is None  # no whole blocks: a token cache's counts (llama.cpp's), none read


def test_a_block_hash_names_its_tokens_and_every_block_before_it():
    ids = np.arange(100, dtype=np.int32)
    whole = block_hashes(ids, 16)
    assert len(whole) == 6 and len(set(whole.tolist())) == 6  # the 4 tokens past the last whole block are not hashed
    assert np.array_equal(block_hashes(ids[:50], 16), whole[:3])  # a prefix's blocks hash alike
    changed = ids.copy()
    changed[40] = 7  # inside block 2: blocks 0 and 1 keep their hashes, every later block changes
    moved = block_hashes(changed, 16)
    assert np.array_equal(moved[:2], whole[:2]) and not np.any(moved[2:] == whole[2:])
    repeated = np.tile(np.arange(16, dtype=np.int32), 2)  # equal tokens in two places: different blocks (chained)
    first, second = block_hashes(repeated, 16)
    assert first != second


def test_every_process_hashes_alike():
    code = "import numpy as np; from kvscope.engine.audit.paged_blocks import block_hashes; print(block_hashes(np.arange(64), 16).tolist())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(block_hashes(np.arange(64), 16).tolist())


def test_the_block_cache_and_the_fit_key_blocks_with_the_one_block_hash():
    from kvscope.engine.audit.simulate.caches import BlockCache

    ids = np.arange(100) % 37
    assert BlockCache(16).keys(ids).tolist() == block_hashes(ids, 16).tolist()
    assert BlockCache(32).keys(ids[:95]).tolist() == block_hashes(ids, 32).tolist()[:2]
