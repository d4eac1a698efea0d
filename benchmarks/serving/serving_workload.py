"""The serving benchmark's workload: a calibrated scenario over long shared text, and each variant's prompt.

``edit``: the scenario's context (the field, then its rule), the handbook (the bundled skills) and the question, with
the request's value written into the context (``in_prefix``) or appended as an erratum (``erratum``); ``composed``:
the skills as blocks in a different order in every request (``chunk_reuse`` vs ``prefix_only``). ``Engine`` is what the
workload and the runs need of a server (benchmarks/serving/serving_servers.py holds them). benchmarks/serving/serving.py
describes the benchmark.
"""

from __future__ import annotations

import enum
import itertools
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from benchmarks.serving.loadgen import CacheCounters
from kvscope.engine.edit.erratum import erratum_text
from kvscope.engine.scenario import Scenario, bundled_scenarios, bundled_skills, context_text, unescape_braces


class Variant(str, enum.Enum):
    """How a request's state reaches the engine's cache."""

    ERRATUM = "erratum"  # edit: the prefix stays byte-identical; a state-update line is appended
    IN_PREFIX = "in_prefix"  # edit: the value is written into the prefix near its start
    CHUNK_REUSE = "chunk_reuse"  # composed: cached blocks are reused wherever they now sit (llama.cpp, LMCache)
    PREFIX_ONLY = "prefix_only"  # composed: only the longest cached prefix is reused (exact)


class WorkloadError(RuntimeError):
    """The workload cannot measure accuracy on this engine; the message says why."""


class Engine(Protocol):
    """An OpenAI-compatible completions server on loopback that reports its prefix-cache reuse."""

    name: str
    model: str
    base_url: str

    def count_tokens(self, text: str) -> int: ...

    def composed_variants(self) -> tuple[Variant, ...]: ...

    def request_options(self, variant: Variant) -> dict[str, Any]: ...

    def clean_options(self) -> dict[str, Any]: ...

    def reset_cache(self) -> None: ...

    def cache_counters(self) -> CacheCounters | None: ...

    def cache_hit_rate_gauge(self) -> float | None: ...

    def settings(self) -> dict[str, Any]: ...


def policy_sources() -> list[str]:
    """Texts of the bundled skills without fields, long_policy first (``{{``/``}}`` unescaped)."""
    paths = sorted(bundled_skills().values(), key=lambda path: (path.stem != "long_policy", path.stem))
    skills = [tomllib.loads(path.read_text()) for path in paths]
    return [unescape_braces(s["text"].strip()) for s in skills if "fields" not in s]


def build_policy(count_tokens: Callable[[str], int], target_tokens: int) -> str:
    """The skill texts, repeated as needed, cut at a line so the policy has at most ``target_tokens``."""
    sources, text, index = policy_sources(), "", 0
    while count_tokens(text) < target_tokens:
        text = f"{text}\n\n{sources[index % len(sources)]}" if text else sources[0]
        index += 1
    lines = text.split("\n")
    low, high = 1, len(lines)  # the longest cut that fits: count(lines[:low]) <= target
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens("\n".join(lines[:middle])) <= target_tokens:
            low = middle
        else:
            high = middle - 1
    return "\n".join(lines[:low]).rstrip()


def load_scenario(name_or_path: str) -> Scenario:
    """A bundled scenario by name, or a scenario file."""
    bundled = bundled_scenarios()
    return Scenario.load(bundled[name_or_path] if name_or_path in bundled else name_or_path)


def nth_permutation(count: int, index: int) -> tuple[int, ...]:
    """Permutation ``index`` (0 ≤ index < count!) of ``range(count)`` in lexicographic order."""
    left, order = list(range(count)), []
    for size in range(count, 0, -1):
        position, index = divmod(index, math.factorial(size - 1))
        order.append(left.pop(position))
    return tuple(order)


@dataclass(frozen=True)
class Workload:
    """A scenario's first field over long shared text; the prompt of each variant (ChatML frame).

    ``edit``: the scenario's context (field, then rule), a ``REQUEST n`` line, the handbook, the question;
    ``composed``: the chat head, then the handbook's blocks in a per-request rotation, then the context and the
    question, all joined by ``separator`` (LMCache's CacheBlend splits segments at its tokens and stops looking
    up at the first miss), so that the blocks are cached but, after the first request, never as a prefix.
    """

    scenario: Scenario
    policy: str
    policy_tokens: int
    kind: str = "edit"
    blocks: tuple[str, ...] = ()
    separator: str = "\n\n"

    @property
    def field(self) -> str:
        return self.scenario.field().name

    @property
    def values(self) -> tuple[str, str]:
        """The two values requests alternate between; the erratum's shared prefix states the first."""
        field = self.scenario.field()
        return field.old, field.new

    @property
    def variants(self) -> tuple[Variant, ...]:
        """The cheap variant first, its exact reference second."""
        return (Variant.ERRATUM, Variant.IN_PREFIX) if self.kind == "edit" else (Variant.CHUNK_REUSE, Variant.PREFIX_ONLY)

    def order(self, request: int) -> tuple[int, ...]:
        """Composed: the block order of request ``request``: a different permutation for each of n! consecutive
        request numbers (they step through the permutations by the smallest prime above n and (n-1)!, which is
        coprime with n! and moves the first block on almost every step)."""
        count = len(self.blocks)
        floor = max(count, math.factorial(count - 1))
        step = next(k for k in itertools.count(floor + 1) if all(k % d for d in range(2, k)))
        return nth_permutation(count, request * step % math.factorial(count))

    def prompt(self, variant: Variant, value: str, request: int) -> str:
        system = f"<|im_start|>system\n{self.scenario.system}<|im_end|>\n" if self.scenario.system else ""
        if self.kind == "composed":
            blocks = self.separator.join(self.blocks[index] for index in self.order(request))
            context = context_text(self.scenario, {self.field: value}).rstrip()
            body = f"{self.separator}{blocks}{self.separator}{context}\n\n"  # the chat head is a segment of its own
        else:
            shown = value if variant is Variant.IN_PREFIX else self.values[0]
            context = context_text(self.scenario, {self.field: shown}).rstrip()
            tag = f"REQUEST {request}\n"
            head = f"{context}\n{tag}" if variant is Variant.IN_PREFIX else f"{context}\n"
            tail = f"{tag}{erratum_text(self.field, value)}\n" if variant is Variant.ERRATUM else ""
            body = f"{head}\nHANDBOOK\n{self.policy}\n\n{tail}"
        return f"{system}<|im_start|>user\n{body}{self.scenario.question}<|im_end|>\n<|im_start|>assistant\n"

    def clean_key(self, value: str, request: int) -> str:
        """Which clean-prefill answer a request is compared with: its value (and its block order, if composed)."""
        return value if self.kind == "edit" else f"{value} @ {'-'.join(map(str, self.order(request)))}"

    def clean_prompt(self, value: str, request: int) -> str:
        """The clean-prefill prompt for a request: its value in place, nothing appended (request 0's number)."""
        return self.prompt(self.variants[1], value, request if self.kind == "composed" else 0)

    def request_values(self, count: int, first: int) -> list[str]:
        """``count`` values alternating between the two, starting with value ``first`` (0 or 1)."""
        return [self.values[(first + index) % 2] for index in range(count)]

    def expected(self, value: str) -> str | None:
        """The scenario's expected answer label for ``value`` ([expect]), if it states one."""
        return self.scenario.expect.get(value)

    def label(self, text: str) -> str:
        """The scenario answer label whose surface form starts the answer (case-insensitive), else the first word."""
        answer = text.strip().lower()
        for label, surfaces in self.scenario.answers.items():
            if any(answer.startswith(surface.strip().lower()) for surface in surfaces):
                return label
        match = re.search(r"[A-Za-z]+", text)
        return match.group(0).lower() if match else ""


def build_workload(engine: Engine, scenario: Scenario, kind: str, policy_tokens: int, separator: str) -> Workload:
    """``edit``: the handbook cut to ``policy_tokens`` on the engine's tokenizer; ``composed``: the bundled
    skills other than the long policy as blocks."""
    if kind == "composed":
        blocks = tuple(policy_sources()[1:])
        return Workload(scenario, separator.join(blocks), engine.count_tokens(separator.join(blocks)), kind, blocks, separator)
    policy = build_policy(engine.count_tokens, policy_tokens)
    return Workload(scenario, policy, engine.count_tokens(policy))
