"""Every probe by name: the causal probes, the linear probe, captum attribution and the cost–quality frontier.

Each takes an :class:`~engine.edit.strategies.EditExperiment` first, plus ``progress`` and its own options,
and returns a result with ``as_dict()``.
"""
from __future__ import annotations

from collections.abc import Callable

from engine.probes import PROBES
from engine.probes.attribution import captum_attribution
from engine.probes.frontier import probe_frontier
from engine.probes.linear import probe_linear

ALL_PROBES: dict[str, Callable] = {**PROBES, "linear": probe_linear, "attribution": captum_attribution, "frontier": probe_frontier}
