"""What a kept result really costs: the bytes of every tensor reachable from it, shared storage counted once.

Walks engine result objects (dataclasses and plain objects of ``engine.*`` classes, their cached
properties included), dicts, lists and tuples. Model weights are never counted: the walk stops at a
:class:`LoadedModel`, at ``torch.nn.Module``s and at objects from other libraries (tokenizers, figures).
"""

from __future__ import annotations

from typing import Any

import torch

from kvscope.engine.cache.loaded import LoadedModel

_CONTAINERS = (dict, list, tuple, set, frozenset)


def tensor_bytes(*objects: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``objects``."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = list(objects)
    while stack:
        item = stack.pop()
        if id(item) in seen or item is None or isinstance(item, (LoadedModel, torch.nn.Module, str, bytes, int, float, bool)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            for tensor in (item, item.grad):
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, _CONTAINERS):
            stack.extend(item)
        elif type(item).__module__.startswith("kvscope.engine.") and hasattr(item, "__dict__"):
            stack.extend(vars(item).values())
    return sum(storages.values())
