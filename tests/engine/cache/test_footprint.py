"""tensor_bytes counts every kept tensor once and never the model's weights."""

from __future__ import annotations

import torch

from kvscope.engine.cache.footprint import tensor_bytes
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.scenario import Scenario
from tests.shared import SAME_LENGTH_SCENARIO


def test_notebook_bytes_match_its_own_accounting_and_shared_storage_counts_once():
    lm = tiny_model("llama")
    notebook = Notebook.prefill(lm, list(range(5, 45))).materialized()
    # token ids and positions (int64), visibility and spliced provenance (bool each), M-RoPE offsets (3 × int64)
    metadata = 40 * 8 * 2 + 40 * 2 + 3 * 40 * 8
    assert tensor_bytes(notebook) == notebook.memory_bytes() + metadata
    fork = notebook.append([7])  # shares the computed tensors: only its per-entry metadata and its step's mask are new
    assert tensor_bytes(notebook, fork) - tensor_bytes(notebook) == 41 * (8 + 8 + 1 + 1 + 3 * 8) + 40
    assert tensor_bytes(lm) == 0 and tensor_bytes({"model": lm, "notebook": notebook}) == tensor_bytes(notebook)


def test_an_experiment_counts_stale_oracle_strategies_and_gradients():
    lm = tiny_model("llama")
    experiment = EditExperiment(lm, Scenario.from_toml(SAME_LENGTH_SCENARIO))
    before = tensor_bytes(experiment)
    experiment.report(["field_only", "full_downstream"], fused=True)
    gradients = experiment.stale.gradients
    after = tensor_bytes(experiment)
    grad_bytes = sum(t.numel() * t.element_size() for t in (*gradients.keys, *gradients.values))
    assert after >= before + grad_bytes
    assert after >= experiment.stale.notebook.memory_bytes() + experiment.oracle.notebook.memory_bytes()
    assert tensor_bytes([torch.zeros(10), torch.zeros(3)]) == 52
