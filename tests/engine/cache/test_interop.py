"""A notebook's cache in safetensors and in transformers: the round trip is bit-exact, and a ``DynamicCache`` of an
edited or spliced notebook continues generation as KVScope's own read does."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvscope.engine import Scenario, bundled_scenarios, load_cache, run_scenario, save_cache, to_dynamic_cache
from kvscope.engine.cache import vision
from kvscope.engine.cache.interop import CacheFileError, SavedCache
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.checks.support import _picture
from kvscope.engine.errors import NotebookError
from kvscope.engine.models.tiny import tiny_model

ATOL = 2e-5


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def run(lm):
    return run_scenario(lm, Scenario.load(bundled_scenarios()["refund_gate"]))


@pytest.fixture(scope="module")
def edited(lm, run):
    """A field-only edit: the new value's entries are appended after the context, the stale ones hidden."""
    span = run.prompt.field_spans["refund_eligible"]
    return run.notebook.replace(range(span.start, span.end), lm.tokenizer(" true", add_special_tokens=False).input_ids)


@pytest.fixture(scope="module")
def spliced(lm):
    """A block prefilled elsewhere, spliced in the middle with a seam (later entries moved, keys re-rotated)."""
    ids = torch.randint(10, 590, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    block = Notebook.prefill(lm, ids[:12], "skill:<b>").block("skill:<b>")
    return Notebook.prefill(lm, ids[12:], "context").materialized().splice(block, at=5, seam=2)


def _same(a: Notebook, b: Notebook) -> None:
    a, b = a.materialized(), b.materialized()
    assert all(
        torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a.computed_keys + a.computed_values, b.computed_keys + b.computed_values)
    )
    assert len(a.computed_keys) == len(b.computed_keys) == a.lm.model.config.get_text_config().num_hidden_layers
    for name in ("token_ids", "positions", "visible", "rope_offsets"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.segments == b.segments and a.log == b.log and b.pending == ()


@pytest.mark.parametrize("which", ["edited", "spliced"])
def test_the_round_trip_is_exact(request, lm, run, tmp_path, which):
    notebook = request.getfixturevalue(which)
    path = save_cache(notebook, tmp_path / "cache.safetensors")
    loaded = load_cache(path, lm)
    _same(notebook, loaded)
    assert bool((~notebook.materialized().visible).any())  # hidden entries travel too (the old value, the seam's first K/V)
    first, again = notebook.read_prompt(run.prompt), loaded.read_prompt(run.prompt)
    assert first.scores == again.scores and first.label == again.label and torch.equal(first.next_token_logits, again.next_token_logits)


def test_the_file_holds_transformers_layout_in_storage_order(lm, edited, tmp_path):
    path = save_cache(edited, tmp_path / "cache.safetensors")
    config = lm.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    with safe_open(str(path), framework="pt") as file:
        metadata, names = file.metadata(), set(file.keys())
        keys = file.get_tensor("layers.0.keys")
        positions = file.get_tensor("positions")
    entries = len(edited.materialized().positions)
    assert keys.shape == (1, config.num_key_value_heads, entries, head_dim) and positions.tolist() == edited.positions.tolist()
    assert {f"layers.{i}.{kind}" for i in range(config.num_hidden_layers) for kind in ("keys", "values")} <= names
    assert "rope_offsets" not in names  # text only: no M-RoPE offsets to keep
    assert json.loads(metadata["fingerprint"]) == lm.fingerprint.as_dict() and metadata["format"] == "kvscope-cache"
    assert sum(count for _, count in json.loads(metadata["segments"])) == entries


def test_m_rope_offsets_travel_with_a_picture(tmp_path):
    lm = tiny_model("qwen2_vl")
    picture = vision.encode_image(lm, _picture(), "picture")
    notebook = Notebook.prefill(lm, [11, 12, 13, *picture.token_ids, 14, 15], "context")
    assert bool(notebook.rope_offsets.any())
    loaded = load_cache(save_cache(notebook, tmp_path / "picture.safetensors"), lm)
    _same(notebook, loaded)
    decode, answers = [5, 6, 7], {"a": [[8]], "b": [[9, 10]]}
    assert torch.equal(notebook.read(decode, answers).next_token_logits, loaded.read(decode, answers).next_token_logits)
    with pytest.raises(NotebookError, match="M-RoPE offsets"):
        to_dynamic_cache(loaded)


def test_another_model_or_a_foreign_file_is_refused(lm, edited, tmp_path):
    path = save_cache(edited, tmp_path / "cache.safetensors")
    with pytest.raises(CacheFileError, match="not by the loaded"):
        load_cache(path, tiny_model("qwen2", seed=1))
    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(2)}, str(foreign))
    with pytest.raises(CacheFileError, match="not a KVScope cache file"):
        load_cache(foreign, lm)
    (tmp_path / "garbage.safetensors").write_bytes(b"\x80\x04not a safetensors file")
    with pytest.raises(CacheFileError, match="cannot read"):
        SavedCache.read(tmp_path / "garbage.safetensors")


def _generate_with_transformers(lm, notebook: Notebook, decode_ids, new_tokens: int) -> list[int]:
    ids = torch.tensor([notebook.visible_token_ids() + list(decode_ids)])
    out = lm.model.generate(input_ids=ids, cache=to_dynamic_cache(notebook), max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("which", ["edited", "spliced"])
def test_a_dynamic_cache_continues_as_kvscope_reads(request, lm, run, which):
    notebook = request.getfixturevalue(which)
    decode = list(run.prompt.decode_ids)
    cache = to_dynamic_cache(notebook)
    assert cache.get_seq_length() == len(notebook)  # the visible entries only, hidden stale ones left out
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([decode]), cache=cache, use_cache=True).logits[0, -1].float()
    assert torch.allclose(logits, notebook.read(decode, run.prompt.answer_ids).next_token_logits, atol=ATOL)
    _, kvscope_tokens = notebook.generate(decode, 8)
    assert _generate_with_transformers(lm, notebook, decode, 8) == kvscope_tokens


def test_a_dynamic_cache_of_a_loaded_file_continues_the_same(lm, run, edited, tmp_path):
    loaded = load_cache(save_cache(edited, tmp_path / "cache.safetensors"), lm)
    decode = list(run.prompt.decode_ids)
    assert _generate_with_transformers(lm, loaded, decode, 6) == _generate_with_transformers(lm, edited, decode, 6)


def test_positions_other_than_0_to_n_are_refused_with_the_reason(lm):
    late = Notebook.prefill(lm, [11, 12, 13, 14], start_position=5)
    with pytest.raises(NotebookError, match=r"entry i at position i.*5\.\.8"):
        to_dynamic_cache(late)
