"""Pictures in the cache (Qwen2-VL / Qwen2.5-VL): image patches as tokens, and M-RoPE's three position axes.

A vision-language model's decoder reads an image as a run of placeholder tokens whose input embeddings come
from the vision tower, not from the vocabulary. KVScope gives every merged patch of an encoded image its own
*virtual token id* past the vocabulary (:class:`ImageTable`, one per loaded model), so a notebook entry stays
fully described by its token id and positions: recomputing a patch (seam repair, a recompute around it) feeds
the same embedding again, and a forward turns ids into embeddings with :func:`input_embeddings`.

M-RoPE rotates three sections of each key's channels by three positions (temporal, height, width). A text
token has the same position on all three; an image's patches share the temporal position of its first patch
and spread over rows (height) and columns (width); the text after it continues at the image's start +
max(rows, columns). That is what the model's own ``get_rope_index`` computes, and :func:`rope_positions`
reproduces it. Moving a block, image included, shifts all three axes by the same delta: one ordinary rotation
of every channel, so ``kvscope.engine.cache.rope`` needs nothing more.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedModel

from kvscope.engine.cache.image_table import EncodedImage, ImageError
from kvscope.engine.cache.loaded import LoadedModel


def uses_mrope(model: PreTrainedModel) -> bool:
    """Whether the text decoder rotates keys by three position axes (Qwen2-VL's ``mrope_section``)."""
    params = getattr(model.config.get_text_config(), "rope_parameters", None) or {}
    return isinstance(params, dict) and "mrope_section" in params


def check_vision_model(lm: LoadedModel) -> None:
    """Raise :class:`ImageError`, saying why, unless the model can take pictures (vision tower, M-RoPE, processor)."""
    config = lm.model.config
    if not hasattr(lm.model, "get_image_features") or getattr(config, "image_token_id", None) is None:
        raise ImageError(f"{lm.name} has no vision tower: images need a vision-language model such as Qwen2-VL or Qwen2.5-VL")
    if not uses_mrope(lm.model):
        raise ImageError(
            f"{lm.name} ({config.model_type}) places image tokens without M-RoPE; KVScope supports images only in "
            "M-RoPE models (Qwen2-VL, Qwen2.5-VL), whose image positions it can reproduce and move"
        )
    if lm.image_processor is None:
        raise ImageError(f"{lm.name} was loaded without an image processor (no preprocessor_config.json next to its weights)")


def encode_image(lm: LoadedModel, image: Image.Image | np.ndarray, name: str) -> EncodedImage:
    """Run one picture through the model's own processor and vision tower; its tokens, ready to prefill."""
    check_vision_model(lm)
    pixels = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
    if pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ImageError(f"image {name!r} must be height × width × 3 (RGB), got shape {pixels.shape}")
    processed = lm.image_processor(images=[pixels], return_tensors="pt")
    grid = processed["image_grid_thw"]
    frames, height, width = (int(v) for v in grid[0])
    if frames != 1:
        raise ImageError(f"image {name!r} became {frames} frames; KVScope places still images only")
    merge = lm.model.config.vision_config.spatial_merge_size
    pixel_values = processed["pixel_values"].to(lm.device, lm.dtype)
    with torch.no_grad():
        embeddings = lm.model.get_image_features(pixel_values, grid.to(lm.device)).pooler_output[0]
    digest = hashlib.sha256(processed["pixel_values"].numpy().tobytes() + grid.numpy().tobytes()).hexdigest()[:16]
    config = lm.model.config
    wrap = (config.vision_start_token_id, config.vision_end_token_id)
    return lm.images.add(digest, name, embeddings.detach(), height // merge, width // merge, wrap)


def image_positions(lm: LoadedModel, token_ids: Sequence[int]) -> list[int]:
    """Indices of the virtual patch tokens among ``token_ids``."""
    table = lm.images
    return [] if table is None else [i for i, token in enumerate(token_ids) if token >= table.first_id]


def rope_positions(lm: LoadedModel, token_ids: Sequence[int], first: int) -> torch.Tensor:
    """(3, T) M-RoPE positions (temporal, height, width) of tokens whose first one sits at rope position ``first``.

    Text advances all three axes by one; an image's patches share its start on the temporal axis and add their
    row and column on the other two; the text after it resumes at start + max(rows, cols). Images must be whole.
    """
    count = len(token_ids)
    if not image_positions(lm, token_ids):
        return torch.arange(first, first + count).expand(3, count).clone()
    table, columns, position = lm.images, [], first
    current: tuple[EncodedImage, int, int] | None = None  # image, next patch expected, its start position
    for index, token in enumerate(token_ids):
        found = table.locate(token)
        if current is not None and (found is None or found[0] is not current[0] or found[1] != current[1]):
            raise ImageError(
                f"image {current[0].name!r} is cut at token {index}: an image is placed with all its {current[0].patches} patches"
            )
        if found is None:
            columns.append((position, position, position))
            position += 1
            continue
        image, patch = found
        if patch == 0:
            current = (image, 0, position)
        elif current is None:
            raise ImageError(
                f"token {index} is patch {patch} of image {image.name!r} without the patches before it: an image is placed whole"
            )
        start = current[2]
        row, col = divmod(patch, image.cols)
        columns.append((start, start + row, start + col))
        current = (image, patch + 1, start) if patch + 1 < image.patches else None
        if current is None:
            position = start + max(image.rows, image.cols)
    if current is not None:
        raise ImageError(f"image {current[0].name!r} is cut after {current[1]} of its {current[0].patches} patches")
    return torch.tensor(columns, dtype=torch.long).T.contiguous()


def input_embeddings(lm: LoadedModel, token_ids: torch.Tensor) -> torch.Tensor | None:
    """Input embeddings (T, hidden) of a forward's tokens when some are image patches; None when all are text."""
    table = lm.images
    if table is None:
        return None
    patches = token_ids >= table.first_id
    if not bool(patches.any()):
        return None
    embeddings = lm.model.get_input_embeddings()(token_ids.masked_fill(patches, 0))
    embeddings[patches] = table.embedding_rows(token_ids[patches]).to(embeddings.dtype)
    return embeddings


def check_boundary(lm: LoadedModel, token_id: int, position: int) -> None:
    """Refuse to insert before ``token_id`` (at ``position``) when it is a picture's patch other than its first."""
    found = lm.images.locate(token_id) if lm.images is not None else None
    if found is not None and found[1] > 0:
        image, patch = found
        raise ImageError(
            f"position {position} is patch {patch} of picture {image.name!r} ({image.patches} patches): "
            "insert before its first patch or after its last"
        )


def token_label(lm: LoadedModel, token_id: int) -> str | None:
    """A readable name for an image patch token (``<photo r1 c2>``), None for a vocabulary token."""
    found = lm.images.locate(token_id) if lm.images is not None else None
    if found is None:
        return None
    image, patch = found
    row, col = divmod(patch, image.cols)
    return f"<{image.name} r{row} c{col}>"
