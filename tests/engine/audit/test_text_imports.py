"""The audit's stages that read text only (docs/architecture.md) read requests with the tokenizer alone: importing any
of their modules loads neither torch nor transformers (a token pass, a template, an endpoint's audit start in about a
second, not the model stack's eight); the model's half of the repairs keeps the text half's names."""

import pkgutil
import subprocess
import sys

import kvscope.engine.audit

TEXT_STAGES = ("logs", "changes", "simulate", "scan", "prompts", "rewrite", "policy", "endpoint", "report")


def _modules(stage: str) -> list[str]:
    package = __import__(f"kvscope.engine.audit.{stage}", fromlist=["__path__"])
    return [module.name for module in pkgutil.walk_packages(package.__path__, f"kvscope.engine.audit.{stage}.")]


def test_every_text_stage_module_imports_no_torch():
    modules = ["kvscope.engine.audit.paged_blocks", *(module for stage in TEXT_STAGES for module in _modules(stage))]
    assert len(modules) > 25 and all(module.split(".")[3] in kvscope.engine.audit.__doc__ for module in modules)
    code = f"import sys, {', '.join(modules)}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_model_half_summarises_every_repair_of_the_text_half():
    from kvscope.engine.audit.measure import repairs
    from kvscope.engine.audit.prompts import repair_requests

    assert list(repairs.REPAIR_SUMMARIES) == list(repair_requests.REPAIRS)


def test_what_the_model_pass_runs_imports_no_torch():
    # one MeasureSettings travels to the endpoint's audit too, which reads text only
    code = "import sys, kvscope.engine.audit.measure.settings; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
