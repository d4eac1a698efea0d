"""What a model dtype's rounding leaves in a decision margin, per bundled scenario: bfloat16's margins against float32's.

    python -m benchmarks.studies.readout_noise [--model embedded] [--scenarios a,b] [--dtype bfloat16]

Each bundled scenario's edit (its own field, old → new) is read as every page reads it
(:meth:`EditExperiment.read_references`): the stale, oracle and field_only margins, and the effect oracle − stale.
The model runs once in float32 (the reference) and once in ``--dtype``, read two ways:

- ``float32_readout``: the engine's readout (the final norm and the LM head in float32 on the dtype's hidden state);
- ``model_dtype_readout``: the norm and head in the model's dtype, as before (logits rounded to its steps: 0.125
  between 16 and 32 in bfloat16).

Per scenario and margin it writes |dtype − float32|; ``noise_floor`` is the largest of them over every scenario with
the engine's readout, the number :data:`kvscope.engine.cache.decision.MARGIN_NOISE` states.
Writes results/readout_noise-<model>-<device>.json.
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks import common
from kvscope.engine.cache import adapter
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.edit.experiment import NOTES_REFERENCE, EditExperiment
from kvscope.engine.models import load_model
from kvscope.engine.scenario import Scenario, bundled_scenarios

MARGINS = ("stale", "oracle", NOTES_REFERENCE, "effect")


def margins(lm: LoadedModel, scenario: Scenario) -> dict[str, float | None]:
    """The scenario's stale, oracle and field_only margins (None where field_only does not apply) and the effect
    (oracle − stale), as the pages read them."""
    experiment = EditExperiment(lm, scenario)
    experiment.read_references()
    stale, oracle, field_only = experiment.stale.decision.margin, experiment.oracle.decision.margin, experiment.run(NOTES_REFERENCE)
    return {
        "stale": stale,
        "oracle": oracle,
        NOTES_REFERENCE: field_only.decision.margin if field_only.applicable else None,
        "effect": oracle - stale,
    }


def readout(lm: LoadedModel, float32: bool) -> None:
    """The engine's float32 readout, or (``float32=False``) the norm's and head's own forwards in the model's dtype: the
    path the float32 readout replaced."""
    adapter.install(lm.model)
    modules = [module for module in (adapter.final_norm(lm.model), lm.model.get_output_embeddings()) if module is not None]
    for module in modules:
        module.__dict__.pop("forward", None)
    modules[-1].__dict__.pop(adapter.FLOAT32_READOUT, None)
    if float32:
        adapter.install_float32_readout(lm.model)


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--scenarios", help="comma-separated bundled scenario names (default: every one)")
    parser.add_argument("--out", default=str(common.results_dir(__file__)), help="folder for the JSON")
    parser.set_defaults(dtype="bfloat16")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.scenarios.split(",")] if args.scenarios else sorted(bundled_scenarios())
    load_before, reads = os.getloadavg()[0], {"float32": {}, "float32_readout": {}, "model_dtype_readout": {}}
    reference = load_model(args.model, device=args.device, dtype="float32", progress=print)
    lm = load_model(args.model, device=args.device, dtype=args.dtype, progress=print)
    for name in names:  # one scenario at a time, the JSON rewritten after each: a run cut short keeps what it measured
        scenario = Scenario.load(bundled_scenarios()[name])
        reads["float32"][name] = margins(reference, scenario)
        for read in ("float32_readout", "model_dtype_readout"):
            readout(lm, read == "float32_readout")
            reads[read][name] = margins(lm, scenario)
        readout(lm, True)
        rows = {done: _row(reads, done) for done in reads["float32"]}
        print(f"{name:>26}: |Δ| {rows[name]['float32_readout']} (model-dtype readout {rows[name]['model_dtype_readout']})", flush=True)
        data = {
            "dtype": args.dtype,
            "margins": list(MARGINS),
            "noise_floor": _largest(rows, "float32_readout"),
            "noise_floor_model_dtype_readout": _largest(rows, "model_dtype_readout"),
            "scenarios_measured": len(rows),
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "scenarios": rows,
        }
        path = common.write_result("readout_noise", lm, data, Path(args.out))
    print(f"noise floor {data['noise_floor']} (model-dtype readout {data['noise_floor_model_dtype_readout']}); wrote {path}")


def _largest(rows: dict, read: str) -> float:
    """The largest |read − float32| over every scenario and margin measured."""
    return max(value for row in rows.values() for value in row[read].values() if value is not None)


def _row(reads: dict, name: str) -> dict:
    """One scenario's margins per read and |read − float32| per margin."""
    full = reads["float32"][name]
    rounded = lambda value: None if value is None else round(value, 4)  # noqa: E731
    row = {read: {m: rounded(values[name][m]) for m in MARGINS} for read, values in reads.items()}
    deltas = {
        read: {
            m: None if full[m] is None or reads[read][name][m] is None else rounded(abs(reads[read][name][m] - full[m])) for m in MARGINS
        }
        for read in ("float32_readout", "model_dtype_readout")
    }
    return {"margins": row, **deltas}


if __name__ == "__main__":
    main()
