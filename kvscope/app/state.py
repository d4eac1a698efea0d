"""Server-side state: loaded models shared by all sessions, per-session results kept by id, exports.

A browser session holds only an opaque id in ``gr.State``; its notebooks and reports live here. Memory is
accounted in bytes of every tensor kept (:func:`kvscope.engine.tensor_bytes`), bounded by the hosting
profile's budgets (least recently used first) and reclaimed: idle sessions expire, and dropping a model
drops every result computed with it, so no evicted copy stays alive. No session can reach another's
entries: every read and write is keyed by the session's own id.
"""

from __future__ import annotations

import atexit
import gc
import json
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import psutil
import torch

from kvscope.app.hosting import HostingError, HostingProfile, local_profile
from kvscope.engine import (
    DTYPES,
    BudgetedLRU,
    ComputeGate,
    KVScopeError,
    LoadedModel,
    LoadedTokenizer,
    MessageProgress,
    Scenario,
    ScenarioRun,
    SelfTestReport,
    SingleFlight,
    SkillStore,
    SupportRow,
    accelerator_dtype,
    check_model,
    dtype_name,
    expected_parameter_bytes,
    load_model,
    load_tokenizer,
    run_scenario,
    tensor_bytes,
)
from kvscope.viz.common import figures_html, plotly_js


def _gb(count: int) -> str:
    return f"{count / 1e9:.1f} GB"


@dataclass(frozen=True)
class DevicePreparation:
    """What making a staged model (:meth:`ModelRegistry.stage`) ready on its device took, kept per model: a GPU
    task's duration adds it."""

    spec: str
    dtype: str  # the dtype it computes in (on a staged model: once chosen in a GPU task)
    reason: str  # why that dtype
    load_s: float  # loading its weights (the first start includes the embedded model's conversion)
    selftest_s: float | None = None  # its cache self-test in a GPU task (None: not measured yet)
    selftest: SelfTestReport | None = None  # that self-test's report (None where not run, or refused)


class ModelRegistry:
    """Models by spec, at most ``profile.model_capacity`` loaded at once and their parameter bytes within
    ``profile.model_budget_bytes`` (least recently used dropped first; the default pinned on a public server);
    the one owner of loaded models and of everything shared that was computed with them. Every drop is stated
    (:meth:`drops_since`)."""

    KEPT_DROPS = 32  # drop messages remembered

    def __init__(
        self,
        default_spec: str = "embedded",
        profile: HostingProfile | None = None,
        device: str = "auto",
        dtype: str = "auto",
        loader: Callable[..., LoadedModel] = load_model,
        estimate: Callable[[str, str], int | None] = expected_parameter_bytes,
    ) -> None:
        """``estimate(spec, dtype)``: a model's parameter bytes before it loads (None when unknown), so room is made
        first; once loaded, its own ``info()["parameter_bytes"]`` counts."""
        self.default_spec, self.device, self.dtype = default_spec, device, dtype
        self.profile = profile or local_profile()
        self.gate = ComputeGate()  # forwards of concurrent requests take turns, least model time first
        self._loader = loader
        self._estimate = estimate
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._tokenizers: dict[str, LoadedTokenizer] = {}  # tokenizer-only loads (a token pass), by spec
        self._bytes: dict[str, int] = {}  # parameter bytes of each loaded model
        self._drops: deque[tuple[int, str]] = deque(maxlen=self.KEPT_DROPS)  # (serial, message)
        self.drop_serial = 0  # how many models were dropped so far
        self._dtypes: dict[str, str] = {}  # the dtype each spec was loaded with ("auto" or a name)
        self._support: dict[str, SupportRow] = {}
        self._skills: dict[str, SkillStore] = {}
        self._baselines = BudgetedLRU(self.profile.baseline_budget_bytes, weigh=tensor_bytes)  # (spec, scenario text) -> ScenarioRun
        self._drop_listeners: list[Callable[[str], None]] = []
        self._lock = threading.RLock()
        self._once = SingleFlight()  # computed-once entries: one computation, every concurrent caller waits for it
        self._staged: set[str] = set()  # models in this process whose device setup waits for a GPU task
        self._preparations: dict[str, DevicePreparation] = {}
        self.device_label: str | None = None  # how the Model card names the device (None: the torch device)

    def resolve(self, spec: str | None) -> str:
        """The spec a request means (the default when empty), checked against the profile's allowlist."""
        spec = (spec or "").strip() or self.default_spec
        if spec != self.default_spec:
            self.profile.check_model(spec)
        return spec

    def on_drop(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(spec)`` whenever a model is dropped (e.g. to forget sessions computed with it)."""
        self._drop_listeners.append(listener)

    def add(self, spec: str, lm: LoadedModel) -> None:
        """Register an already loaded model under ``spec``."""
        with self._lock:
            self._models[spec] = lm
            self._dtypes[spec] = self.dtype
            self._bytes[spec] = _parameter_bytes(lm)
            self._evict(spec)

    def get(self, spec: str | None = None, progress: MessageProgress | None = None, dtype: str | None = None) -> LoadedModel:
        """The model for ``spec`` (default spec when None), loading it on first use; a ``dtype`` other than the
        one it was loaded with ("auto", "float32", "bfloat16", …) reloads it in that dtype."""
        spec = self.resolve(spec)
        with self._lock:
            if dtype is not None and spec in self._models and self._dtypes[spec] != dtype:
                self._drop(spec, f"to reload it in {dtype}")
            if spec not in self._models:
                chosen = dtype or self._dtypes.get(spec, self.dtype)
                self._make_room(spec, self._estimate(spec, chosen))
                self._models[spec] = self._loader(spec, device=self.device, dtype=chosen, progress=progress)
                self._dtypes[spec] = chosen
                self._bytes[spec] = _parameter_bytes(self._models[spec])
                self._evict(spec)
            self._models.move_to_end(spec)
            return self._models[spec]

    def stage(self, device: torch.device, progress: MessageProgress | None = None) -> LoadedModel:
        """ZeroGPU start-up: the default model loaded on the CPU (float32 unless a dtype was asked, so that no CPU
        measurement runs) and its weights moved to ``device`` outside any GPU task, the way ZeroGPU asks (it keeps
        them and hands them to every task). Its dtype choice and self-test wait for the first GPU task
        (:meth:`prepare_staged`)."""
        spec = self.default_spec
        with self._lock:
            started = time.perf_counter()
            lm = self._loader(spec, device="cpu", dtype="float32" if self.dtype == "auto" else self.dtype, progress=progress)
            lm.model.to(device)
            lm.device = device
            load_s = time.perf_counter() - started
            if self.dtype == "auto":
                lm.dtype_reason = "auto: chosen on the device in the first GPU task"
            self.add(spec, lm)
            self._staged.add(spec)
            self._preparations[spec] = DevicePreparation(spec, dtype_name(lm.dtype), lm.dtype_reason, load_s)
            return lm

    def prepare_staged(self) -> dict[str, DevicePreparation]:
        """Inside a GPU task: finish the device setup of the staged models of this process (once per process),
        and return every model's preparation. A model keeps its dtype choice and self-test report once made
        (:meth:`record_preparations` hands them to a process forked before they were): otherwise its dtype is
        chosen on the device ("auto": what the GPU computes natively; float32 on a CPU) and its self-test runs."""
        with self._lock:
            for spec in sorted(self._staged):
                self._preparations[spec] = self._prepare(self._models[spec], self._preparations[spec])
            self._staged.clear()
            return dict(self._preparations)

    def record_preparations(self, preparations: Mapping[str, DevicePreparation]) -> None:
        """Keep preparations made in another process (a GPU task's worker)."""
        with self._lock:
            self._preparations.update(preparations)

    def preparations(self) -> dict[str, DevicePreparation]:
        """Each staged model's preparation, as far as this process knows it."""
        with self._lock:
            return dict(self._preparations)

    def _prepare(self, lm: LoadedModel, kept: DevicePreparation) -> DevicePreparation:
        """A staged model's dtype set (the kept choice, else chosen on its device) and its self-test run or recorded."""
        if kept.selftest_s is not None or self.dtype != "auto":
            dtype, reason = DTYPES[kept.dtype], kept.reason
        else:
            dtype = torch.float32 if lm.device.type == "cpu" else accelerator_dtype(lm.device)
            reason = f"auto on {lm.device.type}: {dtype_name(dtype)}, chosen on the device in the first GPU task"
        if dtype != lm.dtype:
            lm.model.to(dtype)
            lm.dtype, lm.fingerprint = dtype, replace(lm.fingerprint, dtype=dtype_name(dtype))
        lm.dtype_reason = reason
        self._bytes[kept.spec] = _parameter_bytes(lm)
        if kept.selftest is not None:
            lm.splice_gate.record(kept.selftest)
            return replace(kept, dtype=dtype_name(dtype), reason=reason)
        started = time.perf_counter()
        try:
            report = lm.splice_gate.report(lm)
        except KVScopeError:
            report = None  # a refusal (e.g. no RoPE): the support row names it
        return replace(kept, dtype=dtype_name(dtype), reason=reason, selftest_s=time.perf_counter() - started, selftest=report)

    def model_info(self, lm: LoadedModel) -> dict[str, Any]:
        """``lm.info()``, its device named as this server hosts it (``device_label``)."""
        info = lm.info()
        return info | {"device": self.device_label} if self.device_label else info

    def in_memory(self, spec: str) -> LoadedModel | None:
        """The model ``spec`` names where it is in memory (nothing is loaded)."""
        with self._lock:
            return self._models.get(spec)

    def token_model(self, spec: str | None = None, progress: MessageProgress | None = None) -> LoadedModel | LoadedTokenizer:
        """What a token pass reads (no forward): the model where it is in memory, else its tokenizer alone, loaded
        once without the weights."""
        spec = self.resolve(spec)
        with self._lock:
            if spec in self._models:
                self._models.move_to_end(spec)
                return self._models[spec]
            if spec not in self._tokenizers:
                self._tokenizers[spec] = load_tokenizer(spec, progress=progress)
            return self._tokenizers[spec]

    def loaded(self) -> list[str]:
        """Specs of the models in memory, least recently used first."""
        with self._lock:
            return list(self._models)

    def model_bytes(self) -> dict[str, int]:
        """Parameter bytes of each model in memory, least recently used first."""
        with self._lock:
            return {spec: self._bytes[spec] for spec in self._models}

    def drops_since(self, serial: int) -> list[str]:
        """What was dropped after ``drop_serial`` was ``serial``, oldest first, one sentence each (the latest
        ``KEPT_DROPS`` kept)."""
        with self._lock:
            return [message for number, message in self._drops if number > serial]

    def selftest(self, spec: str | None = None) -> SelfTestReport:
        """The RoPE/splice self-test of a model: the one its splice gate runs once (``kvscope.engine.cache.loaded.SpliceGate``)."""
        lm = self.get(spec)
        return lm.splice_gate.report(lm)

    def support(self, spec: str | None = None) -> SupportRow:
        """Every cache operation on this model against its own forward, refusals named (once per model)."""
        spec = self.resolve(spec)

        def check() -> SupportRow:
            try:
                report = self.selftest(spec)
            except KVScopeError:
                report = None  # the row's self-test verdict carries the refusal
            return check_model(self.get(spec), selftest=report)

        return self._once.cached(self._support, spec, check, keep=lambda: spec in self._models)

    def skills(self, spec: str | None = None) -> SkillStore:
        """The compiled-skill store of a model (shared by sessions: blocks are immutable)."""
        return self._skills.setdefault(self.resolve(spec), SkillStore())

    def baseline(self, spec: str | None, scenario_text: str, scenario: Scenario) -> ScenarioRun:
        """The scenario prefilled at its old values, with the decision's attention (kept for the next edits;
        shared by sessions: runs are immutable and keyed by the exact scenario text)."""
        key = (self.resolve(spec), scenario_text)
        return self._once.cached(
            self._baselines,
            key,
            lambda: run_scenario(self.get(spec), scenario, capture_attention=True),
            keep=lambda: key[0] in self._models,
        )

    def memory(self) -> dict[str, int]:
        """Bytes of shared results kept, by kind (model weights excluded)."""
        with self._lock:
            return {
                "baselines": self._baselines.nbytes,
                "skills": sum(store.memory_bytes() for store in self._skills.values()),
            }

    def _evictable(self) -> list[str]:
        return [spec for spec in self._models if not (self.profile.pin_default_model and spec == self.default_spec)]

    def _budget_words(self) -> str:
        return f"the {_gb(self.profile.model_budget_bytes)} model budget ({self.profile.name} profile)"

    def _make_room(self, spec: str, estimate: int | None) -> None:
        """Drop models before loading ``spec`` (about ``estimate`` bytes), so the copies in memory never go beyond
        the capacity or, as far as the estimate tells, the byte budget."""
        while len(self._models) >= self.profile.model_capacity and self._evictable():
            self._drop(self._evictable()[0], f"to load {spec}: at most {self.profile.model_capacity} models are kept in memory")
        size = estimate or 0
        while size and sum(self._bytes.values()) + size > self.profile.model_budget_bytes and self._evictable():
            self._drop(self._evictable()[0], f"to load {spec} ({_gb(size)}) within {self._budget_words()}")

    def _evict(self, newest: str) -> None:
        """Drop the least recently used models (never ``newest``) beyond the capacity or the byte budget."""
        others = lambda: [spec for spec in self._evictable() if spec != newest]  # noqa: E731
        while len(self._models) > self.profile.model_capacity and others():
            self._drop(others()[0], f"after loading {newest}: at most {self.profile.model_capacity} models are kept in memory")
        while sum(self._bytes.values()) > self.profile.model_budget_bytes and others():
            size = _gb(self._bytes[newest])
            self._drop(others()[0], f"after loading {newest} ({size}) to stay within {self._budget_words()}")

    def _drop(self, spec: str, reason: str | None = None) -> None:
        """Forget a model and everything computed with it, then return its memory; ``reason`` is stated."""
        size = self._bytes.pop(spec, 0)
        if reason is not None and spec in self._models:
            self.drop_serial += 1
            self._drops.append((self.drop_serial, f"dropped {spec} ({_gb(size)}) {reason}"))
        self._models.pop(spec, None)
        self._staged.discard(spec)
        self._support.pop(spec, None)
        self._skills.pop(spec, None)
        self._baselines.drop_where(lambda key: key[0] == spec)
        for listener in self._drop_listeners:
            listener(spec)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class SessionStore:
    """Per-session results by (session id, key), each tagged with the model spec it was computed with: every tensor
    weighed, least recently used sessions dropped beyond the byte budget, idle ones expired after ``ttl_s``, the results
    of a dropped model forgotten."""

    def __init__(self, budget_bytes: int | None = None, ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        defaults = local_profile()
        self.budget_bytes = defaults.session_budget_bytes if budget_bytes is None else budget_bytes
        self.ttl_s = defaults.session_ttl_s if ttl_s is None else ttl_s
        self._sessions = BudgetedLRU(self.budget_bytes, weigh=self._weigh, ttl_s=self.ttl_s, clock=clock)

    @classmethod
    def for_profile(cls, profile: HostingProfile) -> "SessionStore":
        """A store with the profile's budget and idle TTL."""
        return cls(profile.session_budget_bytes, profile.session_ttl_s)

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    @staticmethod
    def _weigh(entries: dict[str, tuple[Any, str | None]]) -> int:
        return tensor_bytes([value for value, _ in entries.values()])

    def put(self, session: str, key: str, value: Any, model: str | None = None) -> None:
        """Keep ``value`` for this session; ``model`` is the spec it was computed with (forgotten with it)."""
        entries = dict(self._sessions.get(session) or {})
        entries[key] = (value, model)
        self._sessions[session] = entries

    def get(self, session: str, key: str) -> Any | None:
        """This session's value for ``key``, or None."""
        entries = self._sessions.get(session)
        entry = entries.get(key) if entries else None
        return None if entry is None else entry[0]

    def model_of(self, session: str, key: str) -> str | None:
        """The model spec this session's value for ``key`` was computed with (None: none, or no value)."""
        entries = self._sessions.get(session)
        entry = entries.get(key) if entries else None
        return None if entry is None else entry[1]

    def forget_model(self, spec: str) -> None:
        """Drop every session entry computed with model ``spec``."""
        for session in list(self._sessions):
            entries = self._sessions.get(session) or {}
            kept = {key: entry for key, entry in entries.items() if entry[1] != spec}
            if len(kept) != len(entries):
                self._sessions[session] = kept

    def stats(self) -> dict[str, float]:
        """Sessions kept, their bytes, the budget and the idle TTL."""
        self._sessions.sweep()
        return {"sessions": len(self._sessions), "bytes": self._sessions.nbytes, "budget_bytes": self.budget_bytes, "ttl_s": self.ttl_s}


class ExportFolder:
    """Exports written under one folder owned by this server: size-capped (what the session wrote: the plotly.js embedded
    in every figure page is not counted), only the newest ``keep`` kept."""

    def __init__(self, max_bytes: int, keep: int, root: Path | None = None) -> None:
        self.max_bytes, self.keep = max_bytes, keep
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="kvscope-exports-"))
            atexit.register(shutil.rmtree, root, True)  # the server's own folder goes with it
        self.root = root
        self._lock = threading.Lock()

    def write(
        self, result: dict, figures: Sequence[go.Figure], stem: str, html_parts: Sequence[str] = (), extra: Mapping[str, str] | None = None
    ) -> list[Path]:
        """The result as JSON and every figure (and HTML view) in one HTML file, in a new folder; ``extra`` files
        (name -> text, e.g. the script and notebook that rerun the result) beside them."""
        extra = dict(extra or {})
        if any(Path(name).name != name or name in (f"{stem}.json", f"{stem}-figures.html") for name in extra):
            raise ValueError(f"extra export files must be plain names other than the JSON's and the figures', got {sorted(extra)}")
        text = json.dumps(result, indent=2, ensure_ascii=False)
        page = figures_html(figures, html_parts)  # plotly.js embedded: it opens offline
        library = len(plotly_js().encode()) if figures else 0  # the same 4.6 MB in every export: not counted against the cap
        size = len(text.encode()) + len(page.encode()) - library + sum(len(body.encode()) for body in extra.values())
        if size > self.max_bytes:
            raise HostingError(
                f"this export would be {size / 2**20:.1f} MB; the server writes at most {self.max_bytes / 2**20:.0f} MB per export"
            )
        with self._lock:
            folder = Path(tempfile.mkdtemp(prefix="export-", dir=self.root))
            (folder / f"{stem}.json").write_text(text, encoding="utf-8")
            (folder / f"{stem}-figures.html").write_text(page, encoding="utf-8")
            for name, body in extra.items():
                (folder / name).write_text(body, encoding="utf-8")
            self._prune()
        return [folder / f"{stem}.json", folder / f"{stem}-figures.html", *(folder / name for name in extra)]

    def folders(self) -> list[Path]:
        """Export folders on disk, oldest first."""
        return sorted((p for p in self.root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime_ns)

    def _prune(self) -> None:
        for folder in self.folders()[: -self.keep]:
            shutil.rmtree(folder, ignore_errors=True)


def _parameter_bytes(lm: LoadedModel) -> int:
    """A loaded model's parameter bytes (``LoadedModel.info()``)."""
    return int(lm.info()["parameter_bytes"])


def process_rss_bytes() -> int:
    """Resident memory of this server process."""
    return psutil.Process().memory_info().rss
