"""Every probe by name: the causal probes, the linear probe, captum attribution and the cost–quality frontier.

Each takes an :class:`~engine.strategies.EditExperiment` first, plus ``progress`` and its own options,
and returns a result with ``as_dict()``.
"""
from __future__ import annotations

from collections.abc import Callable

from engine.attribution import captum_attribution
from engine.frontier import probe_frontier
from engine.linear_probe import probe_linear
from engine.probes import PROBES

ALL_PROBES: dict[str, Callable] = {**PROBES, "linear": probe_linear, "attribution": captum_attribution, "frontier": probe_frontier}
