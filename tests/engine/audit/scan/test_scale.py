"""The token pass at scale, checked against the slow ways: line-cut tokenization gives exactly the ids and offsets of
tokenizing each rendered text whole, for every request of a varied log (and switches itself off where it would not);
the SGLang heap evicts as a walk of every leaf would; matching under a budget only finds what the tree still holds."""

import heapq
import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import kvscope.engine.audit.logs.render as render_module
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.render import TextEncoder, render_batch
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.radix import RadixTree
from kvscope.engine.models.tiny import tiny_tokenizer
from tests.engine.audit.measure.test_traffic import AGENT_MESSAGES, QWEN_TEMPLATE, TOOLS, _chat, _lcp


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = QWEN_TEMPLATE
    return tok


def _varied_log(seed=0, sessions=5, requests=60):
    """Interleaved agent sessions whose texts hold what tokenizers treat specially at line starts: blank lines,
    indented code, trailing spaces, tabs, unicode, JSON, digits, and a clock that changes."""
    rng = random.Random(seed)
    pieces = [
        "def f(x):\n    return x  \n\n\tdone",
        "Ünïcödé straße 東京\n中文\n\n\n-- a list\n- item",
        '{"order": 12, "items": [1, 2]}\n  {"nested": true}',
        "12345\n67\n 89\n'single'\n\"double\"",
        "line one.\r\nline two\n\n",
    ]
    state: dict[int, list[dict]] = {s: [] for s in range(sessions)}
    lines = []
    for minute in range(requests):
        s = rng.randrange(sessions)
        if not state[s] or rng.random() < 0.2:
            state[s] = [{"role": "user", "content": rng.choice(pieces)}]
        else:
            state[s] += [AGENT_MESSAGES[2], AGENT_MESSAGES[3], {"role": "user", "content": rng.choice(pieces) + f"\nturn {minute}"}]
        system = f"You are Forge.\nThe current time is 2026-05-12 09:{minute % 60:02d}.\n\n  Indented rule.\nRule: be brief."
        record = {"messages": [{"role": "system", "content": system}, *state[s]], "user": f"s{s}"}
        if s % 2:
            record["tools"] = TOOLS
        lines.append(json.dumps(record))
    return "\n".join(lines)


def _whole(tokenizer, text):
    encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    return encoding.ids, [list(pair) for pair in encoding.offsets]


def test_line_cut_tokenization_equals_whole_texts_for_every_request(tokenizer):
    log = read_log(_varied_log())
    assert TextEncoder(tokenizer).by_lines  # the fast path is the one under test
    rendered = render_batch(tokenizer, log.requests, 100_000)
    assert len(rendered) == 60 and not any(isinstance(item, Exception) for item in rendered)
    for item in rendered:
        ids, offsets = _whole(tokenizer, item.text)
        assert item.token_ids.tolist() == ids and item.offsets.tolist() == offsets, item.request.where


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer: a word at the start of a text gets "▁", so a line cut alone is not exact."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["hello world\nWord x y", "the time is now\nRule: be brief", "You are Forge."]
    tok.train_from_iterator(corpus * 3, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_tokenizer_that_merges_across_line_starts_is_tokenized_whole(monkeypatch):
    tokenizer = _metaspace_tokenizer()
    texts = ["hello world\nWord x y", "the time is now\nRule: be brief\nWord"]
    expected = [_whole(tokenizer, text) for text in texts]
    assert tokenizer.backend_tokenizer.encode("x\nWord").ids != [
        *tokenizer.backend_tokenizer.encode("x\n").ids,
        *tokenizer.backend_tokenizer.encode("Word").ids,
    ]
    encoder = TextEncoder(tokenizer)
    assert not encoder.by_lines  # refused by the probes
    assert [(ids.tolist(), offsets.tolist()) for ids, offsets in encoder.encode(texts)] == expected
    monkeypatch.setattr(render_module, "_splits_at_line_starts", lambda tokenizer: True)  # probes fooled
    fooled = TextEncoder(tokenizer)
    assert fooled.by_lines
    assert [(ids.tolist(), offsets.tolist()) for ids, offsets in fooled.encode(texts)] == expected
    assert not fooled.by_lines  # the batch's whole-text check switched it off


class _WalkingRadix(RadixTree):
    """The reference eviction: every leaf of the tree collected and ordered by last access at each eviction."""

    def _evict(self):
        if self.budget is None or self.tokens <= self.budget:
            return
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self.root:
                leaves.append((node.access, id(node), node))
        heapq.heapify(leaves)
        while self.tokens > self.budget and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[int(leaf.key[0])]
            self.tokens -= len(leaf.key)
            self.evicted.append((leaf.latest, len(leaf.key)))
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.access, id(parent), parent))


def _workload(seed, count):
    """Sequences that share heads (a few prompts) and grow (turns), like a log's requests."""
    rng = random.Random(seed)
    heads = [list(rng.choices(range(50), k=rng.randrange(3, 12))) for _ in range(4)]
    grown: list[list[int]] = []
    for _ in range(count):
        if grown and rng.random() < 0.5:
            base = rng.choice(grown)
            grown.append(base + rng.choices(range(50), k=rng.randrange(1, 6)))
        else:
            grown.append(rng.choice(heads) + rng.choices(range(50), k=rng.randrange(1, 8)))
    return grown


@pytest.mark.parametrize("budget", [8, 25, 60])
def test_the_radix_heap_evicts_as_a_walk_of_every_leaf(budget):
    fast, walking = RadixTree(budget), _WalkingRadix(budget)
    for time, seq in enumerate(_workload(budget, 300), 1):
        ids = np.array(seq, dtype=np.int32)
        assert fast.match(ids, None) == walking.match(ids, None), time
        assert fast.insert(ids, time, None, time) == walking.insert(ids, time, None, time), time
        assert fast.tokens == walking.tokens <= budget
    assert list(fast.evicted) == list(walking.evicted) and len(fast.evicted) > 50


def test_matching_under_a_budget_finds_only_what_the_tree_holds(tokenizer):
    cache = RadixTree(budget_tokens=5)
    first, second = np.array([1, 2, 3, 4], dtype=np.int32), np.array([1, 2, 9, 9], dtype=np.int32)
    cache.insert(first, 1, "a", 1)
    cache.insert(second, 2, "b", 2)  # 6 tokens > 5: request 1's tail [3, 4] goes, its head [1, 2] stays
    assert list(cache.evicted) == [(1, 2)]
    assert cache.match(np.array([1, 2, 3, 4, 5], dtype=np.int32), "a") == (2, 1)  # matched by its head only
    cache.insert(np.array([7, 7, 7, 7, 7], dtype=np.int32), 3, "c", 3)  # both earlier requests go
    assert list(cache.evicted) == [(1, 2), (2, 2), (2, 2)]  # [3, 4], then [9, 9], then the head [1, 2] once a leaf
    assert cache.match(np.array([1, 2, 3], dtype=np.int32), "a") == (0, None)
    log = read_log(_varied_log(requests=30))
    bounded = scan_log(tokenizer, log, ScanSettings(CacheSettings(budget_tokens=1)))
    assert all(row.matched_request is None and row.reused_tokens["sglang"] == 0 for row in bounded.requests)


def test_a_match_that_is_another_prompt_is_a_new_prefix_without_a_diff(tokenizer):
    system = "You are the help desk.\nBe brief."
    ours = [("user", "Where is my parcel?"), ("assistant", "On its way."), ("user", "When?"), ("assistant", "Friday.")]
    theirs = [("user", "Can I return it?"), ("assistant", "Yes."), ("user", "How?"), ("assistant", "By post."), ("user", "Ok")]
    other = [("user", "Cancel it."), ("assistant", "Done."), ("user", "Thanks"), ("assistant", "Bye."), ("user", "Hm?")]
    lines = [_chat(system, *theirs), _chat(system, *ours, ("user", "And then?")), _chat(system, *other)]
    log = read_log("\n".join(lines))
    scan = scan_log(tokenizer, log)
    ids = [item.token_ids.tolist() for item in render_batch(tokenizer, log.requests, 100_000)]
    row = scan.requests[2]  # five of its messages differ from request 1's and request 2's
    shared = max(_lcp(ids[0], ids[2]), _lcp(ids[1], ids[2]))
    assert row.matched_request is not None and row.common_prefix_tokens == shared > 0
    ((cause,),) = [row.causes]
    assert cause.name == "other_conversation" and cause.tokens == len(ids[2]) - shared and "differs in 5 messages" in cause.detail
    assert row.fields == () and 3 not in scan.diffs
