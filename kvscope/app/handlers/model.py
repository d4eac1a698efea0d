"""The Model tab's handlers: load a model (in a dtype), its card and self-test, and what the server keeps in memory."""

from __future__ import annotations

from kvscope.app.handlers.common import guarded
from kvscope.app.state import ModelRegistry, SessionStore, process_rss_bytes
from kvscope.engine import MessageProgress, available_offline, is_offline_alias
from kvscope.viz import models as model_figures
from kvscope.viz import text as panels


@guarded
def load_model_card(
    registry: ModelRegistry, spec: str | None, *, progress: MessageProgress | None = None, dtype: str | None = None
) -> tuple[str, dict]:
    """Load (or reuse) a model, in ``dtype`` when given (else as loaded, or auto), run its self-test once, and describe it."""
    spec = (spec or "").strip() or registry.default_spec
    mark = registry.drop_serial
    lm = registry.get(spec, progress=progress, dtype=dtype or None)
    support = registry.support(spec)
    report = registry.selftest(spec) if support.verdict("self-test").supported else None
    info = registry.model_info(lm)
    card = panels.model_card_markdown(info, lm.cache_layout(), report, support) + model_figures.dropped_markdown(registry.drops_since(mark))
    return card, {
        "model": info | {"fingerprint": lm.fingerprint.as_dict()},
        "selftest": report.as_dict() if report else None,
        "support": support.as_dict(),
        "hosting": registry.profile.as_dict(),
    }


def offered_models(registry: ModelRegistry) -> list[str]:
    """Model specs to offer: those that load without the hub, within the profile's allowlist (plus the
    HF ids its host named)."""
    allowed, found = registry.profile.allowed_models, available_offline()
    if allowed is None:
        return found
    return [spec for spec in allowed if spec in found or not is_offline_alias(spec)]


def memory_markdown(registry: ModelRegistry, sessions: SessionStore) -> str:
    """What this server keeps in memory against its budgets, as Markdown."""
    text = panels.memory_markdown(registry.profile.as_dict(), registry.loaded(), process_rss_bytes(), registry.memory(), sessions.stats())
    return text + model_figures.model_memory_markdown(registry.model_bytes(), registry.profile.model_budget_bytes)
