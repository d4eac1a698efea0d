"""Images in the cache (M-RoPE): every operation on a context with pictures equals what the model computes from pixels."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvscope.engine.cache import vision
from kvscope.engine.cache.image_table import ImageTable
from kvscope.engine.cache.notebook import Knockout, Notebook
from kvscope.engine.checks.support import TOLERANCE, _picture, _pixel_logits
from kvscope.engine.cli import main
from kvscope.engine.compose.pictures import bundled_images, compare_image, load_picture
from kvscope.engine.compose.skills import SkillFileError, load_block, save_block
from kvscope.engine.errors import KVScopeError, NotebookError
from kvscope.engine.models.tiny import VISION_ARCHS, tiny_model

QUESTION, ANSWERS = [5, 6, 7], {"a": [[8]], "b": [[9, 10]]}


@pytest.fixture(scope="module", params=VISION_ARCHS)
def lm(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def picture(lm):
    return vision.encode_image(lm, _picture(), "picture")


def _ids(count, seed):
    return torch.randint(10, 590, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kv_error(a: Notebook, b: Notebook) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.keys + a.values, b.keys + b.values))


def _logits(notebook: Notebook) -> torch.Tensor:
    return notebook.read(QUESTION, ANSWERS).next_token_logits


def test_a_picture_becomes_its_merged_patches_between_the_vision_markers(lm, picture):
    config = lm.model.config
    assert (picture.rows, picture.cols) == (2, 4)  # 56 × 112 pixels, 14-pixel patches, 2 × 2 merge
    assert picture.token_ids[0] == config.vision_start_token_id and picture.token_ids[-1] == config.vision_end_token_id
    assert all(token >= lm.images.first_id for token in picture.token_ids[1:-1])
    assert vision.encode_image(lm, _picture(), "picture") is picture  # encoded once per content and name
    labels = Notebook.prefill(lm, list(picture.token_ids)).token_texts()
    assert labels[1] == "<picture r0 c0>" and labels[8] == "<picture r1 c3>"


def test_rope_positions_are_the_models_own_rope_index(lm, picture):
    """Two pictures of different shapes among text: the same (3, T) positions as Qwen2-VL's get_rope_index."""
    tall = vision.encode_image(lm, np.ascontiguousarray(_picture().transpose(1, 0, 2)), "tall")
    ids = _ids(3, 1) + list(picture.token_ids) + _ids(2, 2) + list(tall.token_ids) + _ids(4, 3)
    patches = {**{t: 1 for t in picture.token_ids[1:-1]}, **{t: 1 for t in tall.token_ids[1:-1]}}
    placeholder = [lm.model.config.image_token_id if t in patches else t for t in ids]
    grids = torch.tensor([[1, 4, 8], [1, 8, 4]])
    expected, _ = lm.model.model.get_rope_index(torch.tensor([placeholder]), torch.tensor([[patches.get(t, 0) for t in ids]]), grids)
    assert torch.equal(Notebook.prefill(lm, ids).rope_positions, expected[:, 0])


def test_read_with_a_picture_equals_the_models_forward_over_pixels(lm, picture):
    context = _ids(5, 3) + list(picture.token_ids) + _ids(6, 4)
    reference = _pixel_logits(lm, context + QUESTION, picture, _picture())
    for notebook in (Notebook.prefill(lm, context), Notebook.prefill(lm, context, chunk_size=4)):
        assert float((_logits(notebook) - reference).abs().max()) <= TOLERANCE
    whole, chunked = Notebook.prefill(lm, context), Notebook.prefill(lm, context, chunk_size=4)
    assert _kv_error(whole, chunked) <= TOLERANCE  # chunk boundaries fall inside the picture


def test_a_picture_block_moved_161_positions_has_the_keys_of_the_picture_prefilled_there(lm, picture):
    block = Notebook.prefill(lm, list(picture.token_ids), "picture").block("picture")
    relocated = Notebook.prefill(lm, _ids(161, 5), "prefix").splice(block).block("picture")
    target = Notebook.prefill(lm, list(picture.token_ids), "picture", start_position=161)
    assert _kv_error(relocated, target) <= TOLERANCE
    assert torch.equal(relocated.rope_offsets, target.rope_offsets)
    moved_keys = relocated.keys[0][0, :, 1:-1]
    assert float((moved_keys - block.keys[0][0, :, 1:-1]).abs().max()) > 0.1  # the keys did rotate


def test_splice_in_the_middle_moves_later_text_by_the_pictures_rope_span(lm, picture):
    """A 10-token picture block spans 6 rope positions: text after it moves by 10 positions but 6 rope steps."""
    pre, post = _ids(4, 6), _ids(5, 7)
    block = Notebook.prefill(lm, list(picture.token_ids), "picture").block("picture")
    assert (len(block), block.rope_span) == (10, 6)
    prefill = Notebook.prefill(lm, pre + list(picture.token_ids) + post)
    spliced = Notebook.prefill(lm, pre + post).splice(block, at=4, seam=len(block))
    repaired = spliced.recompute(range(4 + len(block), 4 + len(block) + len(post)))
    assert torch.equal(repaired.rope_positions[:, repaired.order], prefill.rope_positions)
    assert float((_logits(repaired) - _logits(prefill)).abs().max()) <= TOLERANCE
    composed = Notebook.prefill(lm, pre, "pre").splice(prefill.block(positions=range(4, 14))).append(post).compact()
    assert _kv_error(composed, prefill) <= TOLERANCE  # a picture block spliced back at its own position


def test_editing_text_after_a_picture_equals_a_clean_prefill(lm, picture):
    pre, field, post = _ids(3, 8), _ids(3, 9), _ids(6, 10)
    new = _ids(2, 11)
    context = pre + list(picture.token_ids) + field + post
    start = len(pre) + len(picture.token_ids)
    edited = Notebook.prefill(lm, context).replace(range(start, start + 3), new)
    repaired = edited.recompute([p for p in edited.visible_positions() if p >= start + 2])
    oracle = Notebook.prefill(lm, pre + list(picture.token_ids) + new + post)
    assert torch.equal(repaired.rope_positions[:, repaired.order], oracle.rope_positions)
    assert float((_logits(repaired) - _logits(oracle)).abs().max()) <= TOLERANCE


def test_knocking_out_the_picture_equals_hiding_it(lm, picture):
    context = _ids(4, 12) + list(picture.token_ids) + _ids(4, 13)
    notebook = Notebook.prefill(lm, context)
    patches = tuple(range(5, 13))
    hidden = notebook.materialized()
    visible = hidden.visible.clone()
    visible[list(patches)] = False
    reference = replace(hidden, visible=visible).read(QUESTION, ANSWERS).next_token_logits
    knocked = notebook.read(QUESTION, ANSWERS, knockout=Knockout(patches)).next_token_logits
    assert float((knocked - reference).abs().max()) <= TOLERANCE


def test_images_are_refused_by_name_where_they_cannot_work(lm, picture):
    with pytest.raises(vision.ImageError, match="no vision tower"):
        vision.encode_image(tiny_model("qwen2"), _picture(), "x")
    with pytest.raises(vision.ImageError, match="height × width × 3"):
        vision.encode_image(lm, np.zeros((56, 56), dtype=np.uint8), "grey")
    with pytest.raises(vision.ImageError, match="cut"):
        Notebook.prefill(lm, list(picture.token_ids[:4]))
    with pytest.raises(vision.ImageError, match="without the patches before it"):
        Notebook.prefill(lm, list(picture.token_ids[3:]))
    with pytest.raises(vision.ImageError, match="is cut"):  # a replace must take a picture whole or leave it
        Notebook.prefill(lm, _ids(2, 16) + list(picture.token_ids)).replace(range(0, 5), _ids(2, 17))
    block = Notebook.prefill(lm, list(picture.token_ids), "picture").block("picture")
    with pytest.raises(SkillFileError, match="holds image patches"):
        save_block(block, "/nonexistent/x.safetensors", "x")
    assert issubclass(vision.ImageError, NotebookError) and issubclass(vision.ImageError, KVScopeError)


def test_a_picture_is_never_cut_by_a_splice_a_block_or_a_patch(lm, picture):
    """Operations that would leave a token sequence the model cannot produce are refused, naming the picture."""
    context = _ids(5, 18) + list(picture.token_ids) + _ids(3, 19)
    notebook = Notebook.prefill(lm, context)
    text = Notebook.prefill(lm, [11, 12], "t").block("t")
    with pytest.raises(vision.ImageError, match="position 9 is patch 3 of picture 'picture'"):
        notebook.splice(text, at=9)
    assert notebook.splice(text, at=6).rope_positions.shape == (3, len(context) + 2)  # before the first patch: fine
    with pytest.raises(vision.ImageError, match="is cut"):
        notebook.block(positions=range(5, 9))
    plain = Notebook.prefill(lm, _ids(5, 18) + _ids(10, 20) + _ids(3, 19))
    with pytest.raises(NotebookError, match="rotated for other rope positions"):
        plain.patch(notebook, range(15, 18))


def test_text_after_a_picture_is_stored_as_a_skill_file_with_its_rope_positions(lm, picture, tmp_path):
    context = _ids(2, 21) + list(picture.token_ids) + _ids(6, 22)
    notebook = Notebook.prefill(lm, context)
    after = notebook.block(positions=range(12, 18))
    assert int(after.rope_offsets[0, 0]) == -4  # 10 picture tokens over 6 rope positions
    loaded = load_block(save_block(after, tmp_path / "after.safetensors", "after"), lm)
    host = Notebook.prefill(lm, _ids(30, 23))
    spliced, reloaded = host.splice(after), host.splice(loaded)
    assert _kv_error(spliced, reloaded) == 0.0 and torch.equal(spliced.rope_positions, reloaded.rope_positions)


def test_the_image_table_drops_the_oldest_picture_beyond_its_budget_and_says_so(lm):
    table = ImageTable(first_id=1000, budget_bytes=8 * 64 * 4)  # one 8-patch picture of 64 floats
    first = table.add("a", "first", torch.ones(8, 64), 2, 4, (1, 2))
    second = table.add("b", "second", torch.zeros(8, 64), 2, 4, (1, 2))
    assert second.token_ids[1] == first.token_ids[-2] + 1  # ids are never reused
    assert table.locate(second.token_ids[3]) == (second, 2)
    with pytest.raises(vision.ImageError, match="no longer held"):
        table.locate(first.token_ids[1])


def test_a_picture_spliced_at_its_own_position_reads_as_the_recompute_and_moved_it_stays_close(lm):
    pixels = load_picture(bundled_images()["shipping_label"])
    own = compare_image(lm, pixels, "label")
    assert own.shift == 0 and own.agreement["cosine"] > 1 - 1e-6 and abs(own.match.margin_error) < 1e-4
    moved = compare_image(lm, pixels, "label", before="Order 48213 was placed on Monday.", after="Read the status line.")
    repaired = compare_image(
        lm, pixels, "label", before="Order 48213 was placed on Monday.", after="Read the status line.", seam=own.image_tokens
    )
    assert moved.shift > 0 and moved.agreement["cosine"] < 1 - 1e-6
    assert repaired.agreement["cosine"] > 1 - 1e-6 and abs(repaired.match.margin_error) < 1e-4
    assert (own.image_tokens, own.rope_span) == (14, 6)  # 3 × 4 merged patches between the markers


def test_cli_image_prints_one_json_object_and_refuses_a_text_model(capsys):
    assert main(["image", "--model", "tiny-qwen2_vl", "--before", "Order 48213.", "--seam", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "tiny-qwen2_vl" and result["seam"] == 2 and result["image"] == "shipping_label"
    assert set(result["ttft_ms"]) == {"splice", "full"} and 0.9 < result["cosine"] <= 1 + 1e-6
    assert main(["image", "--model", "tiny-llama", "--json"]) == 2
    assert "no vision tower" in json.loads(capsys.readouterr().out)["error"]
    assert main(["image", "--model", "tiny-qwen2_vl", "--image", "/etc/hostname", "--json"]) == 2
    assert "cannot read image" in json.loads(capsys.readouterr().out)["error"]


def test_a_one_layer_prefill_of_a_picture_has_the_full_prefills_keys(lm, picture):
    """CacheBlend's cheap check runs the first layers only: with a picture it must place patches as the prefill does."""
    context = _ids(3, 14) + list(picture.token_ids) + _ids(3, 15)
    keys, values = Notebook.prefill_layer(lm, context, 1)
    whole = Notebook.prefill(lm, context)
    assert float((keys - whole.keys[1]).abs().max()) <= TOLERANCE and float((values - whole.values[1]).abs().max()) <= TOLERANCE
