"""The token pass as an audit of traffic makes it (the model's context limit, the observed engine, fleets), and the
sample a bound on measured turns allows: a host that measures at most N turns of a log lowers ``--sample K`` until
every change signature's measured turns together fit (read from the token pass: no model forward)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.engine.audit.logs.requests import RequestLog
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import TrafficScan, sample_groups, scan_log
from kvscope.engine.progress import StepProgress

if TYPE_CHECKING:  # a tokenizer is all it reads: no torch at import
    from kvscope.engine.cache.loaded import LoadedModel, LoadedTokenizer


def traffic_scan(
    lm: LoadedModel | LoadedTokenizer,
    log: RequestLog,
    settings: ScanSettings = ScanSettings(),
    *,
    progress: StepProgress = None,
) -> TrafficScan:
    """The token pass over ``log`` with ``lm``'s tokenizer and ``settings`` (its context limit, default the model's)."""
    return scan_log(lm.tokenizer, log, settings.for_model(lm), model=lm.name, progress=progress)


def bounded_sample(scan: TrafficScan, sample: int, most: int | None) -> int:
    """The largest sample up to ``sample`` whose measured turns in ``scan``, over every group, number at most ``most``
    (``sample`` itself where nothing bounds it)."""
    if most is None or sample <= 0:
        return sample
    return next(k for k in range(sample, -1, -1) if sum(len(group.measured) for group in sample_groups(scan, k)) <= most)
