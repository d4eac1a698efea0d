"""Calibration and splice fidelity across models: does the notes effect, and splicing, change with scale?

    python -m benchmarks.studies.compare_models [--models embedded,qwen-1.5b,smollm2] [--dtype float32]
        [--scenarios all|refund_gate,...] [--study-scenario refund_gate] [--skills refund_policy,tone_guide]
        [--remedies splice,prefix+seam:1+blend:0.7] [--out DIR] [--resume]

For each model, loaded one after another (each released before the next): the calibration of the bundled
scenarios (``kvscope.engine.edit.calibrate``: which decisions flip under a clean prefill, which are notes demos, every
field-only recovery) and a small N-skill study (``kvscope.engine.compose.study``: the first 1..N skills spliced before the
study scenario at both values of its first field, each remedy against a full recompute) with its tie-aware
fidelity summary. Writes benchmarks/studies/results/compare_models-<dtype>-<device>.json with the dtype, the CPU's flags
(/proc/cpuinfo: avx2, avx512_bf16, ...), the repetitions (every number is one run) and each stage's wall time;
the Benchmarks tab draws it. ``--resume`` keeps the rows of models a run with the same settings already wrote (the file
is rewritten after each model), so an interrupted run goes on where it stopped; ``total_s`` counts this run only.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
from pathlib import Path

import torch

from benchmarks.common import cpu_info, results_dir
from kvscope.engine.compose.remedy import Remedy, split_remedies
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.compose.study import first_field_values, run_study, skill_prefixes
from kvscope.engine.edit.calibrate import calibrate
from kvscope.engine.models import load_model
from kvscope.engine.scenario import Scenario, bundled_scenarios
from kvscope.engine.timing import Stopwatch

DEFAULT_MODELS = "embedded,qwen-1.5b,smollm2"
REPS = 1  # every number below is one run (calibration and the study read decisions, not timings)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated model specs (loaded one after another)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--scenarios", default="all", help="'all' bundled scenarios, or comma-separated names to calibrate")
    parser.add_argument("--study-scenario", default="refund_gate", help="the scenario the N-skill study splices skills before")
    parser.add_argument("--skills", default="refund_policy,tone_guide", help="the study's skills: N = 1..len, first N in order")
    parser.add_argument("--remedies", default="splice,prefix+seam:1+blend:0.7", help="comma-separated remedies of the study")
    parser.add_argument("--out", default=str(results_dir(__file__)), help="folder for the JSON")
    parser.add_argument(
        "--resume", action="store_true", help="keep the rows of models already in the JSON when it was run with the same settings"
    )
    return parser


def _settings(args: argparse.Namespace, names: list[str], remedies: list[Remedy]) -> dict:
    """What a stored row depends on besides its model: a resumed run reuses rows only when these match."""
    return {
        "dtype": args.dtype,
        "scenarios": names,
        "study_scenario": args.study_scenario,
        "skills": args.skills,
        "remedies": [remedy.name for remedy in remedies],
    }


def _resumed_rows(path: Path, settings: dict) -> dict[str, dict]:
    """Rows of an earlier run with the same settings, by model spec (none when the file is absent or differs)."""
    if not path.exists():
        return {}
    stored = json.loads(path.read_text())
    if {key: stored.get("settings", {}).get(key) for key in settings} != settings:
        print(f"{path}: written with other settings; not resumed", flush=True)
        return {}
    return {row["spec"]: row for row in stored["models"]}


def run_model(spec: str, args: argparse.Namespace, files: list[Path], remedies: list[Remedy]) -> dict:
    """Load one model, calibrate the scenarios and run the study; the model is released on return."""
    watch = Stopwatch()
    lm = load_model(spec, device=args.device, dtype=args.dtype, progress=lambda message: print(f"  {spec}: {message}", flush=True))
    load_s = watch.ms / 1000
    info = lm.info()
    print(f"{spec}: loaded {lm.fingerprint.name} in {load_s:.1f} s ({info['parameters'] / 1e6:.0f} M parameters)", flush=True)
    watch = Stopwatch()
    calibrations = calibrate(lm, files, progress=lambda done, total: print(f"  {spec}: calibrated {done}/{total}", flush=True))
    calibrate_s = watch.ms / 1000
    scenario = Scenario.load(bundled_scenarios()[args.study_scenario])
    skills = [skill.strip() for skill in args.skills.split(",") if skill.strip()]
    watch = Stopwatch()
    study = run_study(
        lm,
        scenario,
        skill_prefixes(skills),
        SkillStore(),
        remedies=remedies,
        values=first_field_values(scenario),
        progress=lambda done, total: print(f"  {spec}: study {done}/{total}", flush=True),
    )
    study_s = watch.ms / 1000
    recoveries = [c.field_only_recovery for c in calibrations if c.flips and c.field_only_recovery is not None]
    row = {
        "spec": spec,
        "model": lm.fingerprint.name,
        "source": lm.source,
        "parameters": info["parameters"],
        "parameter_bytes": info["parameter_bytes"],
        "layers": info["layers"],
        "dtype": info["dtype"],
        "device": lm.device.type,
        "load_s": round(load_s, 1),
        "calibrate": {
            "s": round(calibrate_s, 1),
            "total": len(calibrations),
            "flipping": sum(c.flips for c in calibrations),
            "notes_demos": sum(c.notes_demo for c in calibrations),
            "field_only_recovery_of_flipping": {"min": min(recoveries), "max": max(recoveries)} if recoveries else None,
            "scenarios": [c.as_dict() for c in calibrations],
        },
        "study": {
            "s": round(study_s, 1),
            "scenario": scenario.name,
            "skills": skills,
            "cases": len(study.cases),
            "summary": study.summary(),
            "best": study.best(),
        },
    }
    del lm, study
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    names = sorted(bundled_scenarios()) if args.scenarios == "all" else [name.strip() for name in args.scenarios.split(",")]
    files = [bundled_scenarios()[name] for name in names]
    remedies = [Remedy.parse(text) for text in split_remedies(args.remedies)]
    specs = [spec.strip() for spec in args.models.split(",") if spec.strip()]
    watch, rows = Stopwatch(), []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(args, names, remedies)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    path = out / f"compare_models-{args.dtype}-{device}.json"
    earlier = _resumed_rows(path, settings) if args.resume else {}
    for spec in specs:  # the file is rewritten after each model, "complete" once every model is in
        if spec in earlier:
            print(f"{spec}: kept from {path}", flush=True)
        rows.append(earlier.get(spec) or run_model(spec, args, files, remedies))
        data = {
            "settings": settings,
            "dtype": args.dtype,
            "device": rows[0]["device"],
            "cpu": cpu_info(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "reps": REPS,
            "scenarios": names,
            "remedies": [remedy.name for remedy in remedies],
            "total_s": round(watch.ms / 1000, 1),
            "resumed": sorted(spec for spec in earlier if spec in specs),
            "complete": len(rows) == len(specs),
            "models": rows,
        }
        path.write_text(json.dumps(data, indent=2))
    for row in rows:
        cal, summary = row["calibrate"], row["study"]["summary"]
        fidelity = "  ".join(
            f"{name}: agree {s['agree_decisive']}/{s['decisive']} cos {s['cosine']['median']:.4f}"
            for name, s in summary.items()
            if s["cosine"]
        )
        print(f"{row['model']:48s} flips {cal['flipping']}/{cal['total']}  notes demos {cal['notes_demos']}  {fidelity}")
    print("→", path)
    return data


if __name__ == "__main__":
    main()
