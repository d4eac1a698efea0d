"""The causal fast path of the engine's attention against the masked call it replaces: the same numbers, bit for bit,
on every tiny family in float32 and bfloat16, and taken only where the visibility is a plain prefill."""

import pytest
import torch

from kvscope.engine.cache import adapter
from kvscope.engine.models.tiny import TINY_ARCHS, tiny_model

STORED, NEW = 5, 12  # a prefill of 12 tokens continuing 5 stored ones


def _ids(lm, count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(10, lm.model.config.get_text_config().vocab_size - 10, (count,), generator=generator)


def _continued(lm, allowed: torch.Tensor | None = None, **options) -> adapter.ForwardResult:
    """``STORED`` tokens prefilled, then ``NEW`` more over them (causal unless ``allowed`` says otherwise)."""
    ids = _ids(lm, STORED + NEW)
    first = adapter.forward(
        lm.model, [], [], torch.arange(0), ids[:STORED], torch.arange(STORED), torch.ones(STORED, STORED, dtype=torch.bool).tril()
    )
    if allowed is None:
        allowed = torch.ones(NEW, STORED + NEW, dtype=torch.bool).tril(STORED)
    return adapter.forward(
        lm.model,
        first.new_keys,
        first.new_values,
        torch.arange(STORED),
        ids[STORED:],
        torch.arange(STORED, STORED + NEW),
        allowed,
        logit_rows=torch.arange(NEW),
        **options,
    )


def _masked_only(monkeypatch) -> None:
    monkeypatch.setattr(adapter, "_causal_padding", lambda *args: None)


def _padded_calls(monkeypatch) -> list[int]:
    calls, padded = [], adapter._padded_causal_attention
    monkeypatch.setattr(adapter, "_padded_causal_attention", lambda *args: calls.append(args[4]) or padded(*args))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_continued_prefill_gives_the_masked_calls_numbers_bit_for_bit(arch, dtype, monkeypatch):
    lm = tiny_model(arch, dtype=dtype)
    with monkeypatch.context() as patch:
        calls = _padded_calls(patch)
        fast = _continued(lm)
    with monkeypatch.context() as patch:
        _masked_only(patch)
        masked = _continued(lm)
    assert torch.equal(fast.logits, masked.logits)
    assert all(torch.equal(a, b) for a, b in zip(fast.new_keys + fast.new_values, masked.new_keys + masked.new_values, strict=True))
    if lm.model.config._kvscope_use_sdpa and not getattr(lm.model.config.get_text_config(), "sliding_window", None):
        assert STORED in calls  # the fast path ran (windowed and eager families keep the mask)


def test_the_mask_stays_where_the_visibility_is_not_a_plain_prefill(monkeypatch):
    lm = tiny_model("llama")
    calls = _padded_calls(monkeypatch)
    _continued(lm)
    assert calls and set(calls) == {0, STORED}  # the first prefill and its continuation
    calls.clear()
    hidden = torch.ones(NEW, STORED + NEW, dtype=torch.bool).tril(STORED)
    hidden[:, 2] = False  # a stored entry hidden from every query
    _continued(lm, hidden)
    assert calls == [0] * lm.model.config.num_hidden_layers  # only the first prefill
    calls.clear()
    knocked = {1: torch.zeros(1, NEW, STORED + NEW, dtype=torch.bool)}
    _continued(lm, blocked=knocked)
    layers = lm.model.config.num_hidden_layers
    assert calls.count(STORED) == layers - 1  # every layer but the knocked-out one
    calls.clear()
    _continued(lm, capture_rows=torch.tensor([NEW - 1]))
    assert STORED not in calls  # attention weights read: the masked eager path
