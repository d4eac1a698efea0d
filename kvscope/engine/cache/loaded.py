"""What a load produces, and what every loader (``kvscope.engine.models`` and ``kvscope.engine.models.tiny``) shares.

`LoadedModel` (a causal LM with its tokenizer, device, dtype and provenance), its `ModelFingerprint`,
`ModelLoadError`, `config_hash`, `rope_summary`, the dtype names (`DTYPES`, `dtype_name`). Nothing here loads
anything, so the modules that build models import it without importing the loader.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from kvscope.engine.cache import adapter
from kvscope.engine.cache.image_table import ImageTable
from kvscope.engine.errors import KVScopeError
from kvscope.engine.jsonable import JsonFields
from kvscope.engine.once import SingleFlight

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Config keys that change between loads of the same weights and so must not enter the fingerprint.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        "_commit_hash",
    }
)


class ModelLoadError(KVScopeError):
    """A model could not be loaded; the message says why and what to do."""


@dataclass(frozen=True)
class ModelFingerprint(JsonFields):
    """Identifies the exact weights and numeric format that produced a K/V tensor."""

    name: str
    config_hash: str
    dtype: str


class SpliceVerdict(Protocol):
    """What the gate reads of a self-test report (``kvscope.engine.cache.selftest.SelfTestReport``)."""

    ok: bool
    rope_supported: bool

    def summary(self) -> str: ...


class SpliceLocked(KVScopeError):
    """Splicing re-rotated K/V is refused: this model failed its cache self-test (the numbers are in the message)."""


class SpliceGate:
    """Whether a loaded model may splice re-rotated K/V, from its numeric self-test (like LMCache's rope check,
    which hands out no fused rope once its self-test fails).

    The self-test runs once, on first use, single-flight (concurrent first callers wait for the one run); the
    loader may record a report it already has. The self-test's own splices pass (:meth:`measuring`).
    """

    def __init__(self, verify: Callable[["LoadedModel"], SpliceVerdict] | None = None) -> None:
        self._verify = verify
        self._report: SpliceVerdict | None = None
        self._flight: SingleFlight[SpliceVerdict] = SingleFlight()
        self._verifying = threading.local()

    def record(self, report: SpliceVerdict) -> None:
        """Keep a self-test report computed elsewhere (the loader's dtype choice runs one)."""
        self._report = report

    def report(self, lm: "LoadedModel") -> SpliceVerdict:
        """The model's self-test report, run once."""
        if self._report is None:
            if self._verify is None:
                raise SpliceLocked(
                    f"{lm.name} was built without a cache self-test, so splicing stays locked; load it with kvscope.engine.load_model"
                )
            self._report = self._flight.run("selftest", lambda: self._run(lm))
        return self._report

    def require(self, lm: "LoadedModel") -> None:
        """Refuse (:class:`SpliceLocked`) when the self-test failed; where RoPE is unsupported the rotation
        itself refuses, naming why."""
        if getattr(self._verifying, "active", False):
            return
        report = self.report(lm)
        if report.rope_supported and not report.ok:
            raise SpliceLocked(f"splicing stays locked on {lm.name}: its cache self-test failed ({report.summary()})")

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Splices in this thread pass the gate: the self-test measures splicing, so its own splices run ungated."""
        self._verifying.active = True
        try:
            yield
        finally:
            self._verifying.active = False

    def _run(self, lm: "LoadedModel") -> SpliceVerdict:
        with self.measuring():
            return self._verify(lm)


@dataclass
class LoadedModel:
    """A causal LM ready for the engine, with where it came from."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    source: str
    fingerprint: ModelFingerprint
    dtype_reason: str = "requested"
    image_processor: Any = None  # a vision-language model's own image processor (None: text only)
    images: ImageTable | None = None  # a vision-language model's picture ids (made here when it has a processor)
    splice_gate: SpliceGate = field(default_factory=SpliceGate)  # splicing allowed once the self-test passes

    def __post_init__(self) -> None:
        if self.image_processor is not None and self.images is None:
            vocabulary = max(self.model.config.get_text_config().vocab_size, len(self.tokenizer))
            self.images = ImageTable(vocabulary)

    @cached_property
    def recurrent_layers(self) -> list[int]:
        """Layers whose cache is a running state (Mamba, linear attention): non-empty on a hybrid."""
        return adapter.recurrent_layers(self.model)

    @cached_property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end a generation: the tokenizer's EOS and every EOS id of the generation config (they can
        differ, e.g. a chat model's end-of-turn token), once each."""
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids = [self.tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def cache_layout(self) -> str:
        """What one token's cache entry holds per layer, in words."""
        return adapter.cache_layout(self.model.config)

    def info(self) -> dict[str, Any]:
        """Architecture, attention geometry, RoPE, size and provenance, for display."""
        cfg = self.model.config.get_text_config()
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        params = {id(p): p for p in self.model.parameters()}.values()
        return {
            "architecture": f"{cfg.model_type} ({type(self.model).__name__})",
            "model_type": cfg.model_type,
            "class_name": type(self.model).__name__,
            "layers": cfg.num_hidden_layers,
            "attention_heads": heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
            "head_dim": head_dim,
            "vocab_size": cfg.vocab_size,
            "max_positions": getattr(cfg, "max_position_embeddings", None),
            "rope": rope_summary(cfg),
            "parameters": sum(p.numel() for p in params),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "dtype_reason": self.dtype_reason,
            "source": self.source,
            "fingerprint": self.fingerprint.as_dict(),
        }


NO_WEIGHTS = "none (tokenizer only)"  # the dtype a tokenizer-only load reports


@dataclass(frozen=True)
class LoadedTokenizer:
    """A model's tokenizer and config without its weights: all a token pass needs (``audit --sample 0``). It has no
    ``model``, so nothing that runs one accepts it."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig
    source: str

    @property
    def fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint(self.name, config_hash(self.config), NO_WEIGHTS)

    def info(self) -> dict[str, Any]:
        """What a token pass reads: the context length and where the tokenizer came from."""
        cfg = self.config.get_text_config()
        return {"max_positions": getattr(cfg, "max_position_embeddings", None), "source": self.source, "dtype": NO_WEIGHTS}


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" for torch.float32, and so on."""
    return str(dtype).removeprefix("torch.")


def config_hash(config: PretrainedConfig) -> str:
    """First 16 hex of the sha256 of the config JSON, without keys that vary between loads."""
    data = _drop_volatile(json.loads(config.to_json_string(use_diff=False)))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def rope_summary(config: PretrainedConfig) -> dict[str, Any] | None:
    """RoPE type and theta (per layer type where they differ); None for models without RoPE."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        return None
    if all(isinstance(value, dict) for value in params.values()):
        return {layer_type: _rope_entry(entry) for layer_type, entry in params.items()}
    return _rope_entry(params)


def _drop_volatile(data: Any) -> Any:
    """The config without what varies between loads of the same weights: versions, dtypes, the attention routing, and
    KVScope's own marks (``adapter.install`` sets ``_kvscope_*`` keys, so a model hashes the same before and after)."""
    if isinstance(data, dict):
        return {k: _drop_volatile(v) for k, v in data.items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_kvscope")}
    if isinstance(data, list):
        return [_drop_volatile(v) for v in data]
    return data


def _rope_entry(params: dict[str, Any]) -> dict[str, Any]:
    entry = {"rope_type": params.get("rope_type", "default"), "rope_theta": params.get("rope_theta")}
    extras = ("partial_rotary_factor", "factor")
    entry.update({key: params[key] for key in extras if params.get(key) not in (None, 1.0)})
    return entry
