"""Precompiled skills: a skill's K/V computed once in isolation, stored as safetensors, kept hot in memory.

A skill is compiled after a *canonical prefix* — the chat template's header with no system prompt (or the
BOS token for plain models), or with the target's own system prompt when the caller knows it (``system``) —
and only the skill's own tokens are kept, with the positions their keys were rotated for. Files hold the
tensors plus JSON metadata (model fingerprint, token ids, segments, source positions, dtype, a sha256 of the
tensor bytes); loading checks all of it and never unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvscope.engine.cache.adapter import cache_entry_shapes
from kvscope.engine.cache.blocks import KVBlock
from kvscope.engine.cache.loaded import LoadedModel, ModelFingerprint
from kvscope.engine.cache.lru import BudgetedLRU
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.errors import KVScopeError
from kvscope.engine.once import SingleFlight
from kvscope.engine.scenario import Scenario, Skill, render

FORMAT_VERSION = 1
DEFAULT_BUDGET_BYTES = 512 * 2**20


class SkillFileError(KVScopeError):
    """A stored skill file that cannot be used with this model; the message says why."""


def _compile_scenario(skill: Skill, system: str | None) -> Scenario:
    """A scenario holding only the skill after the canonical prefix (with ``system`` as its system prompt)."""
    return Scenario(
        name=f"skill:{skill.id}",
        description="",
        system=system or None,
        context=f"{{skill:{skill.id}}}",
        question="?",
        fields=dict(skill.fields),
        answers={"a": ("a",), "b": ("b",)},
        expect={},
        skills={skill.id: skill},
    )


def _compile_prompt(lm: LoadedModel, skill: Skill, values: Mapping[str, str] | None, system: str | None):
    prompt = render(_compile_scenario(skill, system), lm.tokenizer, values)
    return prompt, prompt.skill_spans[skill.id]


def skill_tokens(
    lm: LoadedModel, skill: Skill, values: Mapping[str, str] | None = None, system: str | None = None
) -> tuple[list[int], list[str]]:
    """The skill's token ids and segments as placed after the canonical prefix."""
    prompt, span = _compile_prompt(lm, skill, values, system)
    return list(prompt.context_ids[span.start : span.end]), list(prompt.context_segments[span.start : span.end])


def compile_skill(lm: LoadedModel, skill: Skill, values: Mapping[str, str] | None = None, system: str | None = None) -> KVBlock:
    """Compute the skill's K/V once, in isolation after the canonical prefix (with ``system`` as its system prompt)."""
    prompt, span = _compile_prompt(lm, skill, values, system)
    return Notebook.from_prompt(lm, prompt).block(positions=range(span.start, span.end))


def _tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_block(block: KVBlock, path: str | Path, skill_id: str) -> Path:
    """Write a compiled block as one safetensors file with its metadata (text blocks only)."""
    if not bool((block.rope_offsets == block.rope_offsets[:, :1]).all()):
        raise SkillFileError(
            f"block {block.name!r} holds image patches: their token ids and embeddings live with this load of the "
            "model only, so it cannot be stored as a skill file; keep it in memory or re-encode the image"
        )
    tensors = {f"keys.{i}": k[0].detach().contiguous().cpu() for i, k in enumerate(block.keys)}
    tensors |= {f"values.{i}": v[0].detach().contiguous().cpu() for i, v in enumerate(block.values)}
    meta = {
        "format": FORMAT_VERSION,
        "skill": skill_id,
        "fingerprint": block.fingerprint.as_dict(),
        "token_ids": block.token_ids.tolist(),
        "segments": list(block.segments),
        "start_position": block.rope_start,  # text after a picture: its rope positions, the offset folded in
        "layers": len(block.keys),
        "sha256": _tensor_digest(tensors),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"kvscope": json.dumps(meta)})
    return path


def _expected_shapes(lm: LoadedModel, length: int) -> dict[str, tuple[int, int, int]]:
    """Shape of each stored tensor kind ("keys", "values") for a block of ``length`` tokens."""
    key, value = cache_entry_shapes(lm.model.config)
    return {"keys": (key[0], length, key[1]), "values": (value[0], length, value[1])}


def load_block(path: str | Path, lm: LoadedModel) -> KVBlock:
    """Read a compiled block, refusing another model's file, wrong shapes or altered bytes."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = json.loads((handle.metadata() or {})["kvscope"])
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (OSError, KeyError, ValueError, SafetensorError) as error:
        raise SkillFileError(f"{path} is not a KVScope skill file: {error}") from error
    if meta.get("format") != FORMAT_VERSION:
        raise SkillFileError(f"{path} has format {meta.get('format')!r}, expected {FORMAT_VERSION}")
    fingerprint = ModelFingerprint(**meta["fingerprint"])
    if fingerprint != lm.fingerprint:
        raise SkillFileError(
            f"{path} was compiled by {fingerprint.name} ({fingerprint.dtype}, config {fingerprint.config_hash}), "
            f"not by the loaded {lm.fingerprint.name} ({lm.fingerprint.dtype}, config {lm.fingerprint.config_hash})"
        )
    if _tensor_digest(tensors) != meta["sha256"]:
        raise SkillFileError(f"{path}: tensor bytes do not match their recorded sha256 (file altered or corrupt)")
    layers, length = meta["layers"], len(meta["token_ids"])
    shapes = _expected_shapes(lm, length)
    for name, tensor in tensors.items():
        shape = shapes.get(name.partition(".")[0])
        if shape is None:
            raise SkillFileError(f"{path}: unexpected tensor {name!r} (a block holds keys.N and values.N)")
        if tuple(tensor.shape) != shape:
            raise SkillFileError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model needs {shape}")
    if len(tensors) != 2 * layers or layers != lm.model.config.get_text_config().num_hidden_layers or len(meta["segments"]) != length:
        raise SkillFileError(
            f"{path}: holds {layers} layers and {len(tensors)} tensors; the model has "
            f"{lm.model.config.get_text_config().num_hidden_layers} layers"
        )
    device = lm.device
    return KVBlock(
        token_ids=torch.tensor(meta["token_ids"], dtype=torch.long),
        keys=tuple(tensors[f"keys.{i}"][None].to(device) for i in range(layers)),
        values=tuple(tensors[f"values.{i}"][None].to(device) for i in range(layers)),
        start_position=int(meta["start_position"]),
        segments=tuple(meta["segments"]),
        fingerprint=fingerprint,
    )


class SkillStore:
    """Compiled blocks by (model, token ids): memory (LRU within a byte budget) → directory → compile."""

    def __init__(self, directory: str | Path | None = None, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.directory = Path(directory) if directory else None
        self.budget_bytes = budget_bytes
        self._hot = BudgetedLRU(budget_bytes, weigh=KVBlock.memory_bytes)  # key -> block
        self._flight: SingleFlight[KVBlock] = SingleFlight()  # concurrent requests for one block compile it once
        self.compiled = 0  # how many blocks this store had to compute

    @staticmethod
    def key(lm: LoadedModel, ids: list[int], segments: list[str], system: str | None = None) -> str:
        """Content address of a compiled block (the compile prefix's system prompt included)."""
        text = json.dumps([lm.fingerprint.as_dict(), ids, segments] + ([system] if system else []))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def memory_bytes(self) -> int:
        return self._hot.nbytes

    def get(self, lm: LoadedModel, skill: Skill, values: Mapping[str, str] | None = None, system: str | None = None) -> KVBlock:
        """The skill's block for these field values (compiled after ``system`` when given), compiled at most once
        per store (and directory)."""
        ids, segments = skill_tokens(lm, skill, values, system)
        key = self.key(lm, ids, segments, system)
        path = self.directory / f"{skill.id}-{key}.safetensors" if self.directory else None

        def load_or_compile() -> KVBlock:
            if path is not None and path.exists():
                return load_block(path, lm)
            block = compile_skill(lm, skill, values, system)
            self.compiled += 1
            if path is not None:
                save_block(block, path, skill.id)
            return block

        return self._flight.cached(self._hot, key, load_or_compile)
