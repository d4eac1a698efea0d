"""The support matrix: every family green against ground truth or refused by name, and the traits behind it."""

import json
import re

import pytest
import torch

from kvscope.engine.cache.adapter import CacheUnsupported
from kvscope.engine.cache.notebook import Knockout, Notebook
from kvscope.engine.cache.rope import KEYS, VALUES, Rotary
from kvscope.engine.checks.support import (
    OPERATIONS,
    TOLERANCE,
    check_model,
    markdown_table,
    support_matrix,
)
from kvscope.engine.cli import main
from kvscope.engine.models import load_model
from kvscope.engine.models.tiny import (
    FAMILIES,
    HYBRID_ARCHS,
    TINY_ARCHS,
    VISION_ARCHS,
    tiny_model,
)
from tests.shared import make_tiny_model_dir

MOVING = ("move keys", "splice", "seam repair")
# A hybrid reads (and prefills in chunks) through its own append-only cache; everything else rewrites entries.
IN_PLACE = tuple(operation for operation in OPERATIONS if operation not in ("read", "chunked prefill", "images"))
# Ground truth for the matrix: which operations each family must refuse, and a phrase of the reason.
REFUSED = {
    "gpt2": (MOVING, "no rotary position embedding"),
    "llama4": (MOVING, "chunked attention"),
    "dynamic_ntk": (MOVING, "dynamic RoPE scaling"),
    "longrope": (MOVING, "longrope RoPE scaling"),
    "bamba": (IN_PLACE, "hybrid: layers \\[0, 2\\] keep a recurrent"),
    "qwen3_next": (IN_PLACE, "hybrid: layers \\[0, 2\\] keep a recurrent"),
}


@pytest.fixture(scope="module")
def matrix():
    return {row.model.removeprefix("tiny-"): row for row in support_matrix()}


@pytest.mark.parametrize("arch", TINY_ARCHS + HYBRID_ARCHS)
def test_every_family_is_exact_or_refused_by_name(matrix, arch):
    row = matrix[arch]
    assert [v.operation for v in row.verdicts] == list(OPERATIONS)
    refused, reason = REFUSED.get(arch, ((), ""))
    assert set(row.refused) == set(refused)
    for operation, message in row.refused.items():
        assert message and re.search(reason, message), (operation, message)
    for verdict in row.verdicts:
        if verdict.supported:
            assert verdict.max_error is not None and verdict.max_error <= TOLERANCE, (verdict.operation, verdict.max_error)
    assert row.verdict("images").applicable == (arch in VISION_ARCHS)  # pictures are checked where there is a vision tower
    assert row.family == FAMILIES[arch]


def test_markdown_table_has_a_row_per_family_and_numbered_reasons(matrix):
    table = markdown_table(list(matrix.values()))
    lines = table.splitlines()
    assert lines[0].count("|") == len(OPERATIONS) + 2
    assert sum(line.startswith("| ") for line in lines[2:]) == len(matrix)
    assert "refused [1]" in table and "\n1. " in table and "chunked attention" in table


def _ids(count, seed=0):
    return torch.randint(10, 590, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_latent_attention_rotates_only_the_rope_slot(arch):
    """MLA caches the latent (position-free) in the key slot and the decoupled rope key in the value slot."""
    lm = tiny_model(arch)
    rotary = Rotary.for_model(lm.model)
    assert rotary.slot == VALUES and rotary.tables[0].rotary_dim == lm.model.config.qk_rope_head_dim
    notebook = Notebook.prefill(lm, _ids(12))
    deltas = torch.full((12,), 21)
    keys, values = rotary.move(notebook.keys, notebook.values, deltas)
    assert all(torch.equal(a, b) for a, b in zip(keys, notebook.keys))  # latents never move
    at_target = Notebook.prefill(lm, _ids(12), start_position=21)
    assert max(float((a - b).abs().max()) for a, b in zip(values, at_target.values)) < 1e-5


def test_latent_attention_knocks_out_per_query_head():
    """Every query head has its own expanded K/V under MLA: a knockout hides the entries from those heads only."""
    lm = tiny_model("deepseek_v3")
    notebook = Notebook.prefill(lm, _ids(20))
    attention = notebook.read(
        [5, 6], {"a": [[8]], "b": [[9]]}, knockout=Knockout((3, 11), layers=(1,), heads=(2,)), capture_attention=True
    ).attention
    assert float(attention[1, 2][..., [3, 11]].abs().max()) == 0.0
    assert float(attention[1, [0, 1, 3]][..., [3, 11]].min()) > 0.0


def test_gemma3_uses_the_layer_types_own_table():
    lm = tiny_model("gemma3")
    rotary = Rotary.for_model(lm.model)
    assert rotary.slot == KEYS
    assert [t.layer_type for t in rotary.tables] == ["sliding_attention", "full_attention", "sliding_attention"]
    keys, deltas = torch.randn(1, 2, 4, 16), torch.full((4,), 9)
    assert not torch.allclose(rotary.rotate(keys, deltas, 0), rotary.rotate(keys, deltas, 1), atol=1e-3)


def test_nope_layers_keep_their_keys_when_moved():
    lm = tiny_model("llama4_nope")
    rotary = Rotary.for_model(lm.model)
    assert rotary.tables[2] is None and rotary.tables[0].interleaved  # complex freqs_cis pair adjacent channels
    keys = torch.randn(1, 2, 3, 16)
    assert torch.equal(rotary.rotate(keys, torch.full((3,), 5), 2), keys)


def test_llama4_temperature_follows_positions_not_storage_order():
    """An edited field sits at the end of storage; its NoPE-layer query temperature must follow its position."""
    lm = tiny_model("llama4")
    ids, new = _ids(40), _ids(3, seed=2)
    edited = Notebook.prefill(lm, ids).replace(range(20, 23), new)
    assert edited.entries_at([20]).item() >= 40  # stored after the stale context
    repaired = edited.recompute([p for p in edited.visible_positions() if p >= 23])
    oracle = Notebook.prefill(lm, ids[:20] + new + ids[23:])
    question = ([5, 6], {"a": [[8]], "b": [[9]]})
    assert torch.allclose(repaired.read(*question).next_token_logits, oracle.read(*question).next_token_logits, atol=TOLERANCE)


def test_hybrid_is_refused_at_its_first_forward():
    with pytest.raises(CacheUnsupported, match="Mamba / linear-attention"):
        Notebook.prefill(tiny_model("bamba"), _ids(8)).materialized()


def test_cli_support_checks_the_loaded_model(capsys):
    code = main(["support", "--json", "--loaded", "--model", "tiny-gemma3", "--families", "gemma3,gpt2"])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out)
    assert [row["model"] for row in result["families"]] == ["tiny-gemma3", "tiny-gpt2"]
    assert result["loaded"]["model_type"] == "gemma3_text"
    assert all(v["supported"] for v in result["loaded"]["verdicts"].values() if v["applicable"])
    assert result["families"][1]["verdicts"]["splice"]["reason"].startswith("cannot splice")


def test_vision_language_checkpoint_loads_and_its_text_decoder_is_exact(tmp_path):
    """Qwen2-VL is not an AutoModelForCausalLM: it loads as image-text-to-text with its own image processor; text
    contexts use M-RoPE with three equal axes, pictures spread over them, and every operation is exact."""
    lm = load_model(str(make_tiny_model_dir("qwen2_vl", tmp_path / "vl")), dtype="float32")
    assert type(lm.model).__name__ == "Qwen2VLForConditionalGeneration"
    assert lm.model.config.get_text_config().rope_parameters["mrope_section"] == [2, 3, 3]
    row = check_model(lm)
    assert not row.refused and all(v.max_error <= TOLERANCE for v in row.verdicts)
    assert row.verdict("images").applicable  # the saved image processor came back with the checkpoint
    assert row.family == FAMILIES["qwen2_vl"]
