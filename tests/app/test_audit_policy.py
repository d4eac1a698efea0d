"""Download policy after an audit: the policy file (what ``audit --policy-out`` writes for the same turns) and the
LiteLLM proxy's config, with the fields, the repairs and their measured cost in words (escaped)."""

from pathlib import Path

import pytest

from kvscope.app.handlers.audit_kept import download_policy
from kvscope.app.handlers.common import AppError
from kvscope.app.handlers.your_prompt import run_audit
from kvscope.app.state import ExportFolder
from kvscope.engine.audit.policy.build import policy_from_report
from kvscope.engine.audit.policy.document import load_policy
from kvscope.engine.audit.policy.gateway import hook_config
from tests.app.test_audit_tab import LOG, OPTIONS


def test_download_policy_gives_the_policy_the_config_and_their_words(registry, sessions, tmp_path):
    folder = ExportFolder(2**22, 4, root=tmp_path)
    with pytest.raises(AppError, match="run an audit first"):
        download_policy(folder, sessions, session="p")
    run_audit(registry, sessions, LOG, session="p", **OPTIONS)
    paths, words = download_policy(folder, sessions, session="p")
    files = {Path(path).name: Path(path).read_text(encoding="utf-8") for path in paths}
    assert sorted(files) == ["config.yaml", "kvscope-policy.json"] and files["config.yaml"] == hook_config()
    policy = load_policy(files["kvscope-policy.json"])
    assert policy.as_dict() == policy_from_report(sessions.get("p", "audit"), "the audit in the app").as_dict()
    # on the tiny model erratum and hoist miss the bars (test_audit_tab): none is applied, field_only is named only
    (entry,) = policy.fields
    assert (entry.field, entry.pattern, entry.repair, entry.needs_cache_editing) == (
        "session_started", "Session started: {session_started}", None, ("field_only",)
    )  # fmt: skip
    assert words.startswith(r"**Policy:** 0 of 1 field repaired at the gateway, as measured on")
    assert r"session\_started" in words and "passes unchanged" in words and "needs a cache\\-editing engine" in words
    assert "KVSCOPE_POLICY=kvscope-policy.json" in words
