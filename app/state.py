"""Server-side state: loaded models shared by all sessions, and per-session results kept by id.

A browser session holds only an opaque id in ``gr.State``; its notebooks and reports live here, under a
lock and a byte budget (least recently used sessions are dropped first). No session can reach another's
entries: every read and write is keyed by the session's own id.
"""
from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from engine.models import LoadedModel, load_model
from engine.runs import ScenarioRun, run_scenario
from engine.scenario import Scenario
from engine.selftest import SelfTestReport, run_selftest
from engine.skills import SkillStore

DEFAULT_SESSION_BUDGET = 2 * 2**30
BASELINE_CAPACITY = 8


class ModelRegistry:
    """Models by spec, at most ``capacity`` loaded at once; loads are serialized."""

    def __init__(self, default_spec: str = "embedded", capacity: int = 2, device: str = "auto", dtype: str = "auto",
                 loader: Callable[..., LoadedModel] = load_model) -> None:
        self.default_spec, self.capacity, self.device, self.dtype = default_spec, capacity, device, dtype
        self._loader = loader
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._selftests: dict[str, SelfTestReport] = {}
        self._skills: dict[str, SkillStore] = {}
        self._baselines: OrderedDict[tuple[str, str], ScenarioRun] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, spec: str, lm: LoadedModel) -> None:
        """Register an already loaded model under ``spec``."""
        with self._lock:
            self._models[spec] = lm
            self._evict()

    def get(self, spec: str | None = None, progress: Callable[[str], None] | None = None) -> LoadedModel:
        """The model for ``spec`` (default spec when None), loading it on first use."""
        spec = spec or self.default_spec
        with self._lock:
            if spec not in self._models:
                self._models[spec] = self._loader(spec, device=self.device, dtype=self.dtype, progress=progress)
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
        with self._lock:
            cached = self._baselines.get(key)
            if cached is not None:
                self._baselines.move_to_end(key)
                return cached
        run = run_scenario(self.get(spec), scenario, capture_attention=True)
        with self._lock:
            self._baselines[key] = run
            while len(self._baselines) > BASELINE_CAPACITY:
                self._baselines.popitem(last=False)
        return run

    def _evict(self) -> None:
        while len(self._models) > self.capacity:
            spec, _ = self._models.popitem(last=False)
            self._selftests.pop(spec, None)
            self._skills.pop(spec, None)
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
