"""Probes: where a field edit's effect lives in the cache, measured as in the paper (one module each).

Every probe takes an :class:`EditExperiment` (the stale run with the old value, the oracle run with the new
one) and returns a result dataclass whose ``as_dict()`` is JSON-ready. Recovery is measured on the decision
margin between two reference states: 0 = stale, 1 = oracle (trigger: original rule, flipped rule).

| probe | question | reads (R ≈ one decision read) | needs same-length values |
|---|---|---|---|
| ``locality`` | does recomputing the field alone recover the decision? | 2 strategies | no (reports n/a) |
| ``notes_map`` | which (layer, position) entries carry the change? | 1 backward + ~3·top R (+ P R with exact) | yes |
| ``suffix`` | how does recovery grow with the top-K patched notes, per layer band? | #K·(4 + seeds) R | yes |
| ``knockout`` | does hiding the top-K notes from the oracle's decision undo it? | #K·(1 + seeds) R | yes |
| ``heads`` | which heads read the notes, and does knocking them out matter? | 3 + seeds R | yes |
| ``false_note`` | does an injected note beat the live field? | 2 R | yes |
| ``trigger`` | flipping a rule word: do notes after it carry the flip, and the word alone not? | 1 prefill + 3 R | no |
| ``attention`` | where do the decision tokens look, in stale and oracle? | 2 R | no |

Notes are ranked by attribution patching (one backward, ``kvscope.engine.cache.patching``); positions before the field
hold identical K/V in both runs, so the maps cover the field and the downstream tokens only. The shared
error, gap, readings and steps live in :mod:`kvscope.engine.probes.common`; each probe in the module of its name.
:data:`kvscope.engine.probes.registry.PROBES` names every probe: these eight, then ``linear``, ``attribution`` and
``frontier`` (not imported here: those modules import this package).
"""

from __future__ import annotations

from kvscope.engine.probes.attention import AttentionMap, AttentionResult, probe_attention
from kvscope.engine.probes.common import Gap, ProbeError, RandomControl, Reading, k_ladder
from kvscope.engine.probes.false_note import FalseNoteResult, probe_false_note
from kvscope.engine.probes.heads import HeadsResult, probe_heads
from kvscope.engine.probes.knockout import KnockoutResult, probe_knockout
from kvscope.engine.probes.locality import LocalityResult, probe_locality
from kvscope.engine.probes.notes_map import NotesMapResult, probe_notes_map
from kvscope.engine.probes.suffix import SuffixResult, probe_suffix
from kvscope.engine.probes.trigger import TriggerResult, probe_trigger

__all__ = [
    "ProbeError",
    "Gap",
    "Reading",
    "RandomControl",
    "k_ladder",
    "LocalityResult",
    "NotesMapResult",
    "SuffixResult",
    "KnockoutResult",
    "HeadsResult",
    "FalseNoteResult",
    "TriggerResult",
    "AttentionMap",
    "AttentionResult",
    "probe_locality",
    "probe_notes_map",
    "probe_suffix",
    "probe_knockout",
    "probe_heads",
    "probe_false_note",
    "probe_trigger",
    "probe_attention",
]
