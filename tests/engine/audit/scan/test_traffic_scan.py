"""``audit --sample 0`` is a token pass: it loads the model's tokenizer and config, never its weights, and reports the
same token pass as a load with weights does."""

import contextlib
import io
import json

import pytest
import transformers

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.measure.traffic import audit_traffic
from kvscope.engine.cache.loaded import NO_WEIGHTS
from kvscope.engine.cli import main
from kvscope.engine.models import load_tokenizer, tiny
from kvscope.engine.models.tiny import tiny_model

SYSTEM = "You are the help desk.\nSession started: 2026-05-12 09:{m}\nBe brief."
LOG = "\n".join(
    json.dumps({"messages": [{"role": "system", "content": SYSTEM.format(m=m)}, {"role": "user", "content": "Where is my parcel?"}]})
    for m in ("41", "42", "43")
)


def _no_weights(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("weights were loaded for a token pass")

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        monkeypatch.setattr(auto, "from_pretrained", refused)
        monkeypatch.setattr(auto, "from_config", refused)
    monkeypatch.setattr(tiny, "tiny_model", refused)


def test_the_cli_token_pass_loads_no_weights_and_reports_what_a_loaded_model_reports(tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    log.write_text(LOG)
    with_weights = audit_traffic(tiny_model("qwen2"), read_log(LOG), sample=0).as_dict()
    _no_weights(monkeypatch)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["audit", str(log), "--sample", "0", "--model", "tiny-qwen2", "--json"]) == 0
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    assert result["dtype"] == NO_WEIGHTS and len(result["requests"]) == 3 and all(not turn["repairs"] for turn in result["turns"])
    for key in ("requests", "engines", "groups", "turns"):
        assert result[key] == with_weights[key], key


def test_the_embedded_models_tokenizer_loads_without_its_weights(monkeypatch):
    _no_weights(monkeypatch)
    loaded = load_tokenizer("embedded")
    assert not hasattr(loaded, "model") and loaded.info()["max_positions"] == 32768
    assert loaded.tokenizer("Where is my parcel?").input_ids  # it tokenizes


def test_measuring_turns_with_a_tokenizer_only_is_refused_by_name():
    with pytest.raises(RequestLogError, match="--sample 1 measures turns with the model, and only the tokenizer of tiny-qwen2"):
        audit_traffic(load_tokenizer("tiny-qwen2"), read_log(LOG), sample=1)
