"""The virtual token ids of a loaded model's pictures, each with its patch embedding (owned by the loaded model)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvscope.engine.cache.lru import BudgetedLRU
from kvscope.engine.errors import NotebookError


class ImageError(NotebookError):
    """An image cannot be encoded or placed; the message says which image and why."""


@dataclass(frozen=True)
class EncodedImage:
    """One picture as the decoder reads it: vision start, one virtual id per merged patch, vision end."""

    name: str
    token_ids: tuple[int, ...]
    rows: int  # merged patches per column (the height axis)
    cols: int  # merged patches per row (the width axis)

    @property
    def patches(self) -> int:
        return self.rows * self.cols


class ImageTable:
    """The virtual patch ids of one loaded model (from past the vocabulary up), each with its embedding.

    Ids are never reused; beyond ``budget_bytes`` of embeddings the least recently used images are dropped,
    and a notebook still holding their ids is refused by name at its next forward.
    """

    def __init__(self, first_id: int, budget_bytes: int = 256 * 2**20) -> None:
        self.first_id = first_id
        self.budget_bytes = budget_bytes
        self._next_id = first_id
        # first id -> (image, (patches, hidden) embeddings)
        self._images: BudgetedLRU = BudgetedLRU(budget_bytes, weigh=lambda entry: entry[1].numel() * entry[1].element_size())
        self._by_key: dict[str, int] = {}
        self._lengths: dict[int, int] = {}  # first id -> patches, for every image ever added (ids are never reused)
        self._lock = threading.Lock()

    def add(self, digest: str, name: str, embeddings: torch.Tensor, rows: int, cols: int, wrap: tuple[int, int]) -> EncodedImage:
        """Register an image's patch embeddings (once per content and name); returns its tokens."""
        with self._lock:
            key = f"{digest}:{name}"
            known = self._images.get(self._by_key.get(key))
            if known is not None:
                return known[0]
            start, self._next_id = self._next_id, self._next_id + len(embeddings)
            image = EncodedImage(name=name, token_ids=(wrap[0], *range(start, self._next_id), wrap[1]), rows=rows, cols=cols)
            self._images[start] = (image, embeddings)
            self._by_key[key], self._lengths[start] = start, len(embeddings)
            return image

    def locate(self, token_id: int) -> tuple[EncodedImage, int] | None:
        """The image a virtual id belongs to and its patch index (row-major), or None for a vocabulary token."""
        if token_id < self.first_id:
            return None
        start = next((first for first, count in self._lengths.items() if first <= token_id < first + count), None)
        entry = None if start is None else self._images.get(start)
        if entry is not None:
            return entry[0], token_id - start
        raise ImageError(
            f"token id {token_id} is an image patch no longer held by this model (or never encoded with it): encode the image again"
        )

    def embedding_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings (T, hidden) of virtual ids."""
        rows = []
        for token in token_ids.tolist():
            image, patch = self.locate(token)
            rows.append(self._images[image.token_ids[1]][1][patch])
        return torch.stack(rows)
