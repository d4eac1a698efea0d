"""Server-side state: loaded models shared by all sessions, and per-session results kept by id.

A browser session holds only an opaque id in ``gr.State``; its notebooks and reports live here, under a
lock and a byte budget (least recently used sessions are dropped first). No session can reach another's
entries: every read and write is keyed by the session's own id.
"""
from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from engine.compose import Recomputed
from engine.models import LoadedModel, load_model
from engine.progress import MessageProgress
from engine.runs import ScenarioRun, run_scenario
from engine.scenario import Scenario
from engine.selftest import SelfTestReport, run_selftest
from engine.skills import SkillStore

DEFAULT_SESSION_BUDGET = 2 * 2**30
BASELINE_CAPACITY = 8  # scenarios prepared at their old values, per registry
REFERENCE_CAPACITY = 8  # composer prompts with a recomputed side kept, per model


class LRUCache(MutableMapping):
    """A mapping that keeps its ``capacity`` most recently used entries (thread-safe)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __getitem__(self, key):
        with self._lock:
            self._items.move_to_end(key)
            return self._items[key]

    def __setitem__(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def __delitem__(self, key) -> None:
        with self._lock:
            del self._items[key]

    def __iter__(self) -> Iterator:
        with self._lock:
            return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)


class ModelRegistry:
    """Models by spec, at most ``capacity`` loaded at once; loads are serialized."""

    def __init__(self, default_spec: str = "embedded", capacity: int = 2, device: str = "auto", dtype: str = "auto",
                 loader: Callable[..., LoadedModel] = load_model) -> None:
        self.default_spec, self.capacity, self.device, self.dtype = default_spec, capacity, device, dtype
        self._loader = loader
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._dtypes: dict[str, str] = {}  # the dtype each spec was loaded with ("auto" or a name)
        self._selftests: dict[str, SelfTestReport] = {}
        self._skills: dict[str, SkillStore] = {}
        self._baselines: LRUCache = LRUCache(BASELINE_CAPACITY)  # (spec, scenario text) -> ScenarioRun
        self._references: dict[str, LRUCache] = {}
        self._lock = threading.Lock()

    def add(self, spec: str, lm: LoadedModel) -> None:
        """Register an already loaded model under ``spec``."""
        with self._lock:
            self._models[spec] = lm
            self._dtypes[spec] = self.dtype
            self._evict()

    def get(self, spec: str | None = None, progress: MessageProgress | None = None, dtype: str | None = None) -> LoadedModel:
        """The model for ``spec`` (default spec when None), loading it on first use; a ``dtype`` other than the
        one it was loaded with ("auto", "float32", "bfloat16", …) reloads it in that dtype."""
        spec = spec or self.default_spec
        with self._lock:
            if dtype is not None and spec in self._models and self._dtypes[spec] != dtype:
                self._drop(spec)
            if spec not in self._models:
                chosen = dtype or self._dtypes.get(spec, self.dtype)
                self._models[spec] = self._loader(spec, device=self.device, dtype=chosen, progress=progress)
                self._dtypes[spec] = chosen
                self._evict()
            self._models.move_to_end(spec)
            return self._models[spec]

    def selftest(self, spec: str | None = None) -> SelfTestReport:
        """The RoPE/splice self-test of a model, run once per model."""
        spec = spec or self.default_spec
        if spec not in self._selftests:
            self._selftests[spec] = run_selftest(self.get(spec))
        return self._selftests[spec]

    def skills(self, spec: str | None = None) -> SkillStore:
        """The compiled-skill store of a model (shared by sessions: blocks are immutable)."""
        return self._skills.setdefault(spec or self.default_spec, SkillStore())

    def baseline(self, spec: str | None, scenario_text: str, scenario: Scenario) -> ScenarioRun:
        """The scenario prefilled at its old values, with the decision's attention (kept for the next edits;
        shared by sessions: runs are immutable and keyed by the exact scenario text)."""
        key = (spec or self.default_spec, scenario_text)
        if key not in self._baselines:
            self._baselines[key] = run_scenario(self.get(spec), scenario, capture_attention=True)
        return self._baselines[key]

    def references(self, spec: str | None = None) -> MutableMapping[tuple, Recomputed]:
        """Recomputed sides of the composer's comparisons for a model (reused when only seam or blend change)."""
        return self._references.setdefault(spec or self.default_spec, LRUCache(REFERENCE_CAPACITY))

    def _evict(self) -> None:
        while len(self._models) > self.capacity:
            self._drop(next(iter(self._models)))

    def _drop(self, spec: str) -> None:
        """Forget a model and everything computed with it."""
        self._models.pop(spec, None)
        self._selftests.pop(spec, None)
        self._skills.pop(spec, None)
        self._references.pop(spec, None)
        for key in [key for key in self._baselines if key[0] == spec]:
            del self._baselines[key]


class SessionStore:
    """Per-session objects by (session id, key), with a total byte budget (LRU over sessions)."""

    def __init__(self, budget_bytes: int = DEFAULT_SESSION_BUDGET) -> None:
        self.budget_bytes = budget_bytes
        self._sessions: OrderedDict[str, dict[str, tuple[Any, int]]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    def put(self, session: str, key: str, value: Any, nbytes: int = 0) -> None:
        """Keep ``value`` for this session (``nbytes`` counts against the budget)."""
        with self._lock:
            entries = self._sessions.setdefault(session, {})
            entries[key] = (value, nbytes)
            self._sessions.move_to_end(session)
            while len(self._sessions) > 1 and self._total() > self.budget_bytes:
                self._sessions.popitem(last=False)

    def get(self, session: str, key: str) -> Any | None:
        """This session's value for ``key``, or None."""
        with self._lock:
            entry = self._sessions.get(session, {}).get(key)
            if entry is not None:
                self._sessions.move_to_end(session)
            return None if entry is None else entry[0]

    def _total(self) -> int:
        return sum(size for entries in self._sessions.values() for _, size in entries.values())
