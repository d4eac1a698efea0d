"""Stage 3 of the audit on Ray: the sampled turns measured by actors that each hold the model.

``ray_measure_turns`` is a ``traffic.MeasureTurns``: ``audit_traffic`` hands it the sampled turns and builds the report
from what it returns, as for one process (``traffic.measure_in_process``, which each actor runs on its share).

- **The model**: each of ``workers`` actors (fewer where there are fewer lanes) loads it from its spec
  (:class:`ModelSpec`: the name or path ``load_model`` takes, with the device and dtype the driver resolved), with
  torch threads = its node's cores / actors (at least 1), and must hold the driver's model: its fingerprint (name,
  config hash, dtype; a tiny model's hash includes its seed) is checked before any turn is sent. A model built in
  memory (a test's tiny model of another seed) cannot be re-loaded by name and is refused by that check
  (``ModelLoadError``), not shipped through the object store (its self-test gate does not travel, and every actor
  would hold a copy of the driver's weights anyway); a spec an actor cannot load (a directory its node lacks) is
  refused by name too. Weights changed in place under the same config are not detected: give such a model no ``--ray``.
- **The split**: turns by lane (``TurnWork.lane``: a session, else a conversation's first request), so the turns
  that share a prefix go to one actor, whose store of computed states (``kv_store.ComputedStates``, one per actor for the
  run) reuses them as one process does; lanes go to the least loaded actor by tokens, largest first. One call per
  lane, so progress moves as lanes finish.
- **Faults**: a lost actor is restarted (it loads the model again, its store empty) and its call retried (``RETRIES``,
  as the token pass's actors).

Numbers: a turn's KL and agreement are the in-process ones up to float rounding where an actor's store reused a
different prefix than the one process did (a shared system prompt across lanes); its timings are its actor's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.audit.distributed.ray_setup import RETRIES
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.measure.kv_store import ComputedStates
from kvscope.engine.audit.measure.settings import MeasureSettings
from kvscope.engine.audit.measure.traffic import TurnWork, measure_in_process
from kvscope.engine.audit.measure.turn import AuditTurn
from kvscope.engine.cache.loaded import LoadedModel, ModelFingerprint, ModelLoadError, dtype_name
from kvscope.engine.progress import Tick


@dataclass(frozen=True)
class ModelSpec:
    """What an actor loads (``load_model``'s spec, device and dtype) and the fingerprint it must then have."""

    model: str
    device: str
    dtype: str
    fingerprint: ModelFingerprint

    @classmethod
    def of(cls, spec: str, lm: LoadedModel) -> ModelSpec:
        """``lm`` as loaded from ``spec``: its resolved device and dtype (so no actor re-decides an "auto" dtype)."""
        return cls(spec, str(lm.device), dtype_name(lm.dtype), lm.fingerprint)


class _TurnActor:
    """One actor: the model loaded from its spec, and the run's store of computed states."""

    def __init__(self, spec: ModelSpec, actors: int, tokens: int):
        import torch

        from kvscope.engine.models import load_model

        torch.set_num_threads(max((os.cpu_count() or 1) // actors, 1))
        self.lm = load_model(spec.model, device=spec.device, dtype=spec.dtype)
        self.store = ComputedStates(self.lm, tokens)

    def fingerprint(self) -> ModelFingerprint:
        return self.lm.fingerprint

    def measure(self, work: Sequence[TurnWork], measure: MeasureSettings) -> dict[int, AuditTurn]:
        return measure_in_process(self.lm, work, measure, store=self.store)


def assign_lanes(work: Sequence[TurnWork], workers: int) -> list[list[list[TurnWork]]]:
    """Per actor, its lanes (each a lane's turns, in order): whole lanes, each to the actor with the fewest tokens so
    far, the lane with the most tokens first (ties: the earlier lane, the lower actor)."""
    lanes: dict[str | int, list[TurnWork]] = {}
    for item in work:
        lanes.setdefault(item.lane, []).append(item)
    load, shares = [0] * workers, [[] for _ in range(workers)]
    for turns in sorted(lanes.values(), key=lambda turns: -sum(len(t.new) for t in turns)):
        actor = load.index(min(load))
        load[actor] += sum(len(t.new) for t in turns)
        shares[actor].append(turns)
    for share in shares:
        share.sort(key=lambda turns: turns[0].request)
    return shares


def ray_measure_turns(
    spec: ModelSpec, workers: int, work: Sequence[TurnWork], measure: MeasureSettings, tick: Tick
) -> dict[int, AuditTurn]:
    """The turns measured by up to ``workers`` actors on the Ray cluster already started (``ray_setup.start_ray``),
    one tick per step as each lane comes back; bind ``spec`` and ``workers`` (``functools.partial``) for
    ``audit_traffic``'s ``measure_turns``."""
    if workers < 1:
        raise RequestLogError(f"--workers must be at least 1, got {workers}")
    shares = [share for share in assign_lanes(work, workers) if share]
    if not shares:
        return {}
    import ray

    actor_class = ray.remote(num_cpus=1, max_restarts=RETRIES, max_task_retries=RETRIES)(_TurnActor)
    actors = [actor_class.remote(spec, len(shares), measure.tokens) for _ in shares]
    try:
        try:
            found = ray.get([actor.fingerprint.remote() for actor in actors])
        except ray.exceptions.RayActorError as error:  # its creation failed: the error's last line names why
            raise ModelLoadError(f"a Ray actor could not load {spec.model!r}: {str(error).strip().splitlines()[-1]}") from None
        _check_fingerprints(spec, found)
        calls = {actor.measure.remote(lane, measure): len(lane) for actor, share in zip(actors, shares) for lane in share}
        turns: dict[int, AuditTurn] = {}
        pending = list(calls)
        while pending:
            (done,), pending = ray.wait(pending)
            turns |= ray.get(done)
            for _ in range(calls[done] * (len(measure.repairs) + 1)):
                tick()
        return dict(sorted(turns.items()))
    finally:
        for actor in actors:
            ray.kill(actor)


def _check_fingerprints(spec: ModelSpec, found: Sequence[ModelFingerprint]) -> None:
    """Refuse actors whose model is not the driver's (a model built in memory, or another one under the same spec)."""
    for fingerprint in found:
        if fingerprint != spec.fingerprint:
            raise ModelLoadError(
                f"the Ray actors loaded {spec.model!r} as {fingerprint.as_dict()}, not the driver's model "
                f"{spec.fingerprint.as_dict()}: a model built in memory cannot be re-loaded by name; measure it without "
                "--ray, or load it from a name or directory the actors can load too"
            )
