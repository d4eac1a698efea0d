"""Every probe by name: the causal probes, the linear probe, captum attribution and the cost–quality frontier.

Each takes an :class:`~kvscope.engine.edit.experiment.EditExperiment` first, plus ``progress`` and its own options,
and returns a result with ``as_dict()``. The CLI and the app read :data:`PROBES`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvscope.engine.probes.attention import probe_attention
from kvscope.engine.probes.attribution import captum_attribution
from kvscope.engine.probes.false_note import probe_false_note
from kvscope.engine.probes.frontier import probe_frontier
from kvscope.engine.probes.heads import probe_heads
from kvscope.engine.probes.knockout import probe_knockout
from kvscope.engine.probes.linear import probe_linear
from kvscope.engine.probes.locality import probe_locality
from kvscope.engine.probes.notes_map import probe_notes_map
from kvscope.engine.probes.suffix import probe_suffix
from kvscope.engine.probes.trigger import probe_trigger

PROBES: dict[str, Callable] = {
    "locality": probe_locality,
    "notes_map": probe_notes_map,
    "suffix": probe_suffix,
    "knockout": probe_knockout,
    "heads": probe_heads,
    "false_note": probe_false_note,
    "trigger": probe_trigger,
    "attention": probe_attention,
    "linear": probe_linear,
    "attribution": captum_attribution,
    "frontier": probe_frontier,
}
