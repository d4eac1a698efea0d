"""A notebook's cache as a safetensors file, and as a transformers ``DynamicCache`` to continue generation.

:func:`save_cache` writes every entry (storage order, the notebook's dtype) with its token id, position, visibility and
segments; :func:`load_cache` reads it back into an exact twin on the model whose fingerprint it carries. Only
safetensors is read or written: nothing is unpickled. The file's tensors and metadata: docs/engine.md, "Open a KVScope
cache in transformers". :func:`to_dynamic_cache` refuses a notebook whose visible positions are not 0..N-1, or whose
keys carry M-RoPE offsets, saying why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvscope.engine.cache import adapter
from kvscope.engine.cache.loaded import LoadedModel, ModelFingerprint
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.errors import NotebookError

FORMAT = "kvscope-cache"
VERSION = 1


class CacheFileError(NotebookError):
    """A cache file cannot be read, or does not belong to the model it is loaded into."""


@dataclass(frozen=True)
class SavedCache:
    """What a cache file holds (see the module docstring), on the CPU."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    token_ids: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor
    rope_offsets: torch.Tensor
    segments: tuple[str, ...]
    log: tuple[str, ...]
    fingerprint: ModelFingerprint

    @classmethod
    def of(cls, notebook: Notebook) -> "SavedCache":
        """A notebook's cache, pending steps computed first; tensors copied to the CPU."""
        done = notebook.materialized()
        copy = lambda tensor: tensor.detach().to("cpu", copy=True).contiguous()  # noqa: E731
        return cls(
            keys=tuple(copy(k) for k in done.computed_keys),
            values=tuple(copy(v) for v in done.computed_values),
            token_ids=copy(done.token_ids),
            positions=copy(done.positions),
            visible=copy(done.visible),
            rope_offsets=copy(done.rope_offsets),
            segments=tuple(done.segments),
            log=tuple(done.log),
            fingerprint=done.lm.fingerprint,
        )

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file (parent folders are made); returns its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"token_ids": self.token_ids, "positions": self.positions, "visible": self.visible}
        for layer, (key, value) in enumerate(zip(self.keys, self.values)):
            tensors[f"layers.{layer}.keys"], tensors[f"layers.{layer}.values"] = key, value
        if bool(self.rope_offsets.any()):
            tensors["rope_offsets"] = self.rope_offsets
        metadata = {
            "format": FORMAT,
            "version": str(VERSION),
            "fingerprint": json.dumps(self.fingerprint.as_dict()),
            "segments": json.dumps(_runs(self.segments), ensure_ascii=False),
            "log": json.dumps(list(self.log), ensure_ascii=False),
            "layers": str(len(self.keys)),
            "entries": str(len(self.positions)),
        }
        save_file(tensors, str(path), metadata=metadata)
        return path

    @classmethod
    def read(cls, path: str | Path) -> "SavedCache":
        """Read a file written by :meth:`save` (safetensors only; a file of another kind is refused)."""
        path = Path(path)
        if not path.is_file():
            raise CacheFileError(f"no cache file at {path}")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as file:
                metadata, names = file.metadata() or {}, set(file.keys())
                if metadata.get("format") != FORMAT:
                    raise CacheFileError(f"{path.name} is not a KVScope cache file (its metadata names no format {FORMAT!r})")
                if int(metadata.get("version", 0)) > VERSION:
                    raise CacheFileError(f"{path.name} is a version {metadata['version']} cache file; this KVScope reads up to {VERSION}")
                layers, entries = int(metadata["layers"]), int(metadata["entries"])
                tensor = file.get_tensor
                keys = tuple(tensor(f"layers.{i}.keys") for i in range(layers))
                values = tuple(tensor(f"layers.{i}.values") for i in range(layers))
                token_ids, positions, visible = tensor("token_ids"), tensor("positions"), tensor("visible")
                offsets = tensor("rope_offsets") if "rope_offsets" in names else torch.zeros(3, entries, dtype=torch.long)
        except CacheFileError:
            raise
        except (OSError, KeyError, ValueError, SafetensorError) as error:  # a truncated or foreign file
            raise CacheFileError(f"cannot read {path.name} as a KVScope cache file: {error}") from error
        segments = tuple(label for label, count in json.loads(metadata["segments"]) for _ in range(count))
        saved = cls(
            keys=keys,
            values=values,
            token_ids=token_ids,
            positions=positions,
            visible=visible,
            rope_offsets=offsets,
            segments=segments,
            log=tuple(json.loads(metadata.get("log", "[]"))),
            fingerprint=ModelFingerprint(**json.loads(metadata["fingerprint"])),
        )
        saved._check(path.name, entries)
        return saved

    def _check(self, name: str, entries: int) -> None:
        per_entry = (self.token_ids, self.positions, self.visible, self.segments)
        if any(len(item) != entries for item in per_entry) or tuple(self.rope_offsets.shape) != (3, entries):
            raise CacheFileError(f"{name}: token ids, positions, visibility, segments and rope offsets disagree on {entries} entries")
        if any(t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != entries for t in (*self.keys, *self.values)):
            raise CacheFileError(f"{name}: every layer's keys and values must be [1, heads, {entries}, dim]")

    def notebook(self, lm: LoadedModel) -> Notebook:
        """The notebook on ``lm``, which must be the model (and dtype) that computed it."""
        if self.fingerprint != lm.fingerprint:
            saved, loaded = self.fingerprint, lm.fingerprint
            raise CacheFileError(
                f"this cache was computed by {saved.name} ({saved.dtype}, config {saved.config_hash}), not by the loaded "
                f"{loaded.name} ({loaded.dtype}, config {loaded.config_hash}): K/V only mean something to the model that made them"
            )
        (key_heads, key_dim), (value_heads, value_dim) = adapter.cache_entry_shapes(lm.model.config)
        layers = lm.model.config.get_text_config().num_hidden_layers
        shapes_ok = all(
            k.shape[1::2] == (key_heads, key_dim) and v.shape[1::2] == (value_heads, value_dim) for k, v in zip(self.keys, self.values)
        )
        if (self.keys and len(self.keys) != layers) or not shapes_ok:
            raise CacheFileError(f"the file's K/V shapes do not fit {lm.name} ({layers} layers, {adapter.cache_layout(lm.model.config)})")
        move = lambda tensor: tensor.to(lm.device)  # noqa: E731
        return Notebook(
            lm=lm,
            computed_keys=tuple(move(k) for k in self.keys),
            computed_values=tuple(move(v) for v in self.values),
            token_ids=self.token_ids,
            positions=self.positions,
            segments=self.segments,
            visible=self.visible,
            log=self.log,
            rope_offsets=self.rope_offsets,
        )


def _runs(labels: tuple[str, ...]) -> list[list]:
    """Consecutive equal labels as ``[label, count]`` runs."""
    runs: list[list] = []
    for label in labels:
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    return runs


def save_cache(notebook: Notebook, path: str | Path) -> Path:
    """Write a notebook's cache (pending steps computed first) to a safetensors file; see the module docstring."""
    return SavedCache.of(notebook).save(path)


def load_cache(path: str | Path, lm: LoadedModel) -> Notebook:
    """The notebook saved at ``path``, on ``lm`` (refused unless ``lm`` is the model and dtype that computed it)."""
    return SavedCache.read(path).notebook(lm)


def to_dynamic_cache(notebook: Notebook):
    """A transformers ``DynamicCache`` of the notebook's visible entries in position order.

    Continue with the model's own forward or ``model.generate``: its input ids are
    ``notebook.visible_token_ids()`` followed by the new tokens (``generate`` skips the cached ones). A
    ``DynamicCache`` has no positions of its own (its entry i is at position i) and no mask beyond causality, so
    this needs the visible positions to be exactly 0..N-1, and text positions (no M-RoPE offsets); otherwise it
    is refused with the reason. Hidden entries are left out: they are what a field edit or recompute replaced.
    """
    done = notebook.materialized()
    order = done.order
    positions = done.positions[order]
    if not torch.equal(positions, torch.arange(len(order))):
        gaps = f"{int(positions[0])}..{int(positions[-1])} for {len(order)} entries" if len(order) else "none"
        raise NotebookError(
            f"a DynamicCache places entry i at position i, but this notebook's visible positions are {gaps}: "
            "transformers would read its keys at the wrong positions (prefill from position 0 to open it in transformers)"
        )
    if bool(done.rope_offsets[:, order].any()):
        raise NotebookError(
            "this notebook's keys carry M-RoPE offsets (a picture's patches share rope positions): transformers derives "
            "rope positions from the pixels given to generate, not from a cache, so its continuation would be misplaced"
        )
    index = order.to(done.lm.device)
    keys = [k.index_select(2, index) for k in done.computed_keys]
    values = [v.index_select(2, index) for v in done.computed_values]
    return adapter.dynamic_cache(keys, values)
