"""Test data shared across test packages."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.scenario import Scenario, bundled_scenarios

# Debian's chromium, driven by Playwright in every browser test (never a downloaded browser), and its flags.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# A line the tiny tokenizer knows well (from its training corpus): about 20 tokens.
FILLER = "Ticket 7 says the package is late. Ticket 8 says the item arrived damaged and asks for a refund.\n"


def long_scenario(tokenizer, tokens: int, name: str = "request_id_control") -> Scenario:
    """A bundled scenario padded to about ``tokens`` context tokens: filler lines before and after its context
    (so its field sits in the middle, with prefix and notes on both sides)."""
    scenario = Scenario.load(bundled_scenarios()[name])
    lines = tokens // len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    half = FILLER * (lines // 2)
    return replace(scenario, context=half + scenario.context + half)


# A scenario whose field values are one token each in the tiny tokenizer, so in-place edits apply.
SAME_LENGTH_SCENARIO = '''
name = "Refund test"
description = "Order status decides the refund."
context = """
SESSION
order_status: {order_status}
POLICY
Refunds are approved only when order_status is pending.
"""
question = "Should the refund be approved? Answer yes or no."

[fields.order_status]
old = "shipped"
new = "pending"

[answers]
yes = ["yes", "Yes"]
no = ["no", "No"]
'''


def make_tiny_model_dir(arch: str, path: str | Path, *, seed: int = 0) -> Path:
    """Save a tiny model and its tokenizer to `path` with `save_pretrained` (safetensors); returns the path."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    loaded = tiny_model(arch, seed=seed)
    loaded.model.save_pretrained(out, safe_serialization=True)
    loaded.tokenizer.save_pretrained(out)
    if loaded.image_processor is not None:
        loaded.image_processor.save_pretrained(out)
    # transformers reloads qwen2 directories through Qwen2Tokenizer, whose default unk_token "<|endoftext|>"
    # would be added as token 600, past the embedding: record that there is no unk token.
    config_file = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["unk_token"] = None
    config_file.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return out


def assert_valid_report(report: dict) -> None:
    """An audit's JSON holds to the published schema (docs/audit-report.schema.json, generated from the report's
    declarations: ``kvscope.engine.audit.ci.report``): every required key, no unnamed one, each value of its type."""
    import jsonschema

    from kvscope.engine.audit.ci.report import report_schema

    jsonschema.validate(report, report_schema(), cls=jsonschema.Draft202012Validator)
