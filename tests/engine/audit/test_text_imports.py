"""The audit's text-only modules read requests with the tokenizer alone: importing them loads neither torch nor
transformers (a token pass, a template, an endpoint's audit start in about a second, not the model stack's eight)."""

import subprocess
import sys

TEXT_MODULES = (
    "engine.audit.repair_requests",
    "engine.audit.template",
    "engine.audit.spans",
    "engine.audit.rewrite",
    "engine.audit.endpoint",
    "engine.audit.endpoint_audit",
    "engine.audit.scan",
)


def test_the_text_only_audit_modules_import_no_torch():
    code = f"import sys, {', '.join(TEXT_MODULES)}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_model_half_keeps_the_text_half_s_names():
    from engine.audit import repair_requests, repairs

    for name in ("GRAINS", "REPAIRS", "PROMPT_REPAIRS", "REPAIR_LEVELS", "Level", "OutputFidelity", "coarse", "repaired_request"):
        assert getattr(repairs, name) is getattr(repair_requests, name)
    assert list(repairs.REPAIR_SUMMARIES) == list(repair_requests.REPAIRS)
