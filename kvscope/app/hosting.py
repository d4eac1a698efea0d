"""Hosting profiles: what one server allows its visitors, and the memory it may keep for them.

``local`` (``python app.py``) keeps today's freedom: any alias, HF id or local directory, any context the model takes, no
time limit. ``public`` (``python app.py --public``, and automatically on a Hugging Face Space, where ``SPACE_ID`` is set)
is for a Space or a shared classroom machine: models from an allowlist only (the offline aliases, except the large
``qwen-1.5b``, plus the models the host names in ``KVSCOPE_ALLOWED_MODELS``), no local paths, bounded context, strategies,
turns and model time per request. Both bound memory alike, with budgets scaled to the machine's RAM. Every limit can be
overridden by the host (see ``from_env``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import psutil

from kvscope.engine import HOST_OPT_IN_ALIASES, STRATEGIES, KVScopeError, WorkBudget, offline_aliases

# Shares of the machine's RAM kept for results, per kind (the rest is for models and the work itself).
SESSION_SHARE, BASELINE_SHARE = 0.06, 0.03
# Parameter bytes of the models in memory: two Qwen2.5-Coder-1.5B copies in float32 (2 × 7.1 GB, lm_head untied) fit a 24 GB machine.
MODEL_SHARE = 0.6


class HostingError(KVScopeError):
    """A request this server's profile does not allow; the message names the limit and what to do."""


@dataclass(frozen=True)
class HostingProfile:
    """The limits one server applies to every visitor."""

    name: str  # "local" or "public"
    allowed_models: tuple[str, ...] | None  # None: any alias, HF id or local directory
    max_context_tokens: int | None
    forward_tokens: int | None  # new tokens per forward; longer work runs in exact chunks, other requests between
    request_seconds: float | None  # model time per request
    max_scenario_chars: int | None
    max_strategies: int
    max_agent_turns: int
    session_budget_bytes: int
    baseline_budget_bytes: int
    model_budget_bytes: int  # parameter bytes of the models in memory (least recently used dropped first)
    session_ttl_s: float  # idle sessions are dropped after this long
    export_max_bytes: int
    export_keep: int  # export folders kept on disk (oldest removed first)
    model_capacity: int  # models loaded at once
    pin_default_model: bool  # never evict the default model (a public server's visitors all use it)
    concurrency: int  # model-bound requests in flight (their forwards take turns, least model time first)
    max_audit_requests: int | None = None  # requests per audited log (None: any); each request's tokens: max_context_tokens
    max_audit_tokens: int | None = None  # greedy tokens generated per state in an audit (None: any)
    calibrate_remedies: bool = True  # whether the composer's "auto" may calibrate a model (minutes of model time)
    measure_on_server: bool = True  # whether an audit may be measured on a server URL the visitor types

    def check_measure_on_server(self) -> None:
        """Refuse measuring on a visitor's URL where the server is shared: it would make requests on their behalf."""
        if not self.measure_on_server:
            raise HostingError(
                f"{self.label} makes no request to a URL a visitor typed: run KVScope on your own machine "
                "(python -m kvscope.app, or kvscope audit LOG --endpoint URL) to measure on your server"
            )

    @property
    def label(self) -> str:
        """How refusals name this server's limits."""
        return f"this server ({self.name} profile)"

    @property
    def work_budget(self) -> WorkBudget:
        """The per-request budget the engine enforces."""
        return WorkBudget(self.request_seconds, self.max_context_tokens, self.forward_tokens, self.label)

    def check_model(self, spec: str) -> None:
        """Refuse a model spec outside the allowlist, without saying anything about the server's files."""
        if self.allowed_models is not None and spec not in self.allowed_models:
            raise HostingError(f"model {spec!r} is not offered by {self.label}; choose one of: {', '.join(self.allowed_models)}")

    def check_scenario_text(self, text: str) -> None:
        """Refuse an over-long scenario before parsing it."""
        if self.max_scenario_chars is not None and len(text) > self.max_scenario_chars:
            raise HostingError(
                f"the scenario has {len(text):,} characters; {self.label} accepts at most {self.max_scenario_chars:,}: shorten its context"
            )

    def checked_strategies(self, names: Sequence[str]) -> list[str]:
        """The strategy names once each, in order, within the per-request maximum."""
        unique = list(dict.fromkeys(names))
        if len(unique) > self.max_strategies:
            raise HostingError(f"{len(unique)} strategies asked; {self.label} runs at most {self.max_strategies} per request")
        return unique

    def check_audit(self, requests: int, tokens: int) -> None:
        """Refuse an audit of more requests, or more greedy tokens per state, than this server runs."""
        if self.max_audit_requests is not None and requests > self.max_audit_requests:
            raise HostingError(
                f"the log has {requests} requests; {self.label} audits at most {self.max_audit_requests}: keep the requests you care about"
            )
        if self.max_audit_tokens is not None and tokens > self.max_audit_tokens:
            raise HostingError(f"{tokens} greedy tokens per state asked; {self.label} generates at most {self.max_audit_tokens}")

    def check_turns(self, turns: int) -> None:
        """Refuse an agent episode longer than the maximum."""
        if turns > self.max_agent_turns:
            raise HostingError(f"{turns} agent turns asked; {self.label} runs at most {self.max_agent_turns}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def machine_memory_bytes() -> int:
    """Total RAM of this machine."""
    return psutil.virtual_memory().total


def _budgets(memory_bytes: int) -> dict[str, int]:
    return {
        "session_budget_bytes": int(memory_bytes * SESSION_SHARE),
        "baseline_budget_bytes": int(memory_bytes * BASELINE_SHARE),
        "model_budget_bytes": int(memory_bytes * MODEL_SHARE),
    }


def local_profile(memory_bytes: int | None = None) -> HostingProfile:
    """One user on their own machine: everything allowed, memory still bounded."""
    return HostingProfile(
        name="local",
        allowed_models=None,
        max_context_tokens=None,
        forward_tokens=None,
        request_seconds=None,
        max_scenario_chars=None,
        max_strategies=len(STRATEGIES),
        max_agent_turns=64,
        session_ttl_s=6 * 3600.0,
        export_max_bytes=20 * 2**20,
        export_keep=64,
        model_capacity=2,
        pin_default_model=False,
        concurrency=4,  # requests in flight: their forwards take turns at the gate, so a calibration never blocks an edit
        **_budgets(memory_bytes or machine_memory_bytes()),
    )


def public_profile(extra_models: Sequence[str] = (), memory_bytes: int | None = None) -> HostingProfile:
    """A public Space or a shared classroom server: the local profile's memory and concurrency, the offline aliases except
    those a host opts into (``HOST_OPT_IN_ALIASES``: the 1.5B model) plus ``extra_models``, and bounded work."""
    allowed = (*(alias for alias in offline_aliases() if alias not in HOST_OPT_IN_ALIASES), *extra_models)
    return replace(
        local_profile(memory_bytes),
        name="public",
        allowed_models=tuple(dict.fromkeys(allowed)),
        max_context_tokens=1024,
        forward_tokens=128,  # new tokens per forward: ~1 s for the embedded model on 2 CPU cores
        request_seconds=30.0,
        max_scenario_chars=12_000,
        max_agent_turns=8,
        session_ttl_s=15 * 60.0,
        export_max_bytes=2 * 2**20,
        export_keep=32,
        pin_default_model=True,
        max_audit_requests=8,  # requests of one audited log (the Your prompt tab)
        max_audit_tokens=32,  # greedy tokens generated per state in an audit
        calibrate_remedies=False,
        measure_on_server=False,
    )


OVERRIDES = {  # environment variable -> profile field (a host's settings)
    "KVSCOPE_MAX_CONTEXT_TOKENS": ("max_context_tokens", int),
    "KVSCOPE_FORWARD_TOKENS": ("forward_tokens", int),
    "KVSCOPE_REQUEST_SECONDS": ("request_seconds", float),
    "KVSCOPE_MAX_SCENARIO_CHARS": ("max_scenario_chars", int),
    "KVSCOPE_MAX_AGENT_TURNS": ("max_agent_turns", int),
    "KVSCOPE_SESSION_TTL_S": ("session_ttl_s", float),
    "KVSCOPE_CONCURRENCY": ("concurrency", int),
    "KVSCOPE_MODEL_BUDGET_BYTES": ("model_budget_bytes", int),
    "KVSCOPE_MAX_AUDIT_REQUESTS": ("max_audit_requests", int),
    "KVSCOPE_MAX_AUDIT_TOKENS": ("max_audit_tokens", int),
}


def from_env(public: bool, environ: Mapping[str, str] | None = None) -> HostingProfile:
    """The profile for this process: public when asked or on a Space (``SPACE_ID``), with the host's overrides."""
    environ = os.environ if environ is None else environ
    extra = tuple(name.strip() for name in environ.get("KVSCOPE_ALLOWED_MODELS", "").split(",") if name.strip())
    profile = public_profile(extra) if public or environ.get("SPACE_ID") else local_profile()
    changes = {}
    for variable, (name, kind) in OVERRIDES.items():
        if environ.get(variable):
            try:
                changes[name] = kind(environ[variable])
            except ValueError as error:
                raise HostingError(f"{variable}={environ[variable]!r} is not a valid {kind.__name__}") from error
    return replace(profile, **changes)


_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") and ctypes.util.find_library("c") else None
_M_ARENA_MAX = -8  # glibc mallopt parameter


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas: each of Gradio's worker threads would otherwise keep its own arena of freed
    tensor memory, and the server's RSS would grow with every thread that ever ran a request (glibc only)."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_ARENA_MAX, arenas)


def return_freed_memory_every(seconds: float = 10.0) -> threading.Thread | None:
    """A daemon thread handing memory freed by dropped results back to the system every ``seconds`` (glibc
    only), so that no request waits for it."""
    if _LIBC is None:
        return None

    def trim_forever() -> None:
        while True:
            time.sleep(seconds)
            _LIBC.malloc_trim(0)

    thread = threading.Thread(target=trim_forever, name="kvscope-malloc-trim", daemon=True)
    thread.start()
    return thread
