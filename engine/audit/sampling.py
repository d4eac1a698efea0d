"""The sample a bound on measured turns allows: a host that measures at most N turns of a log lowers ``--sample K``
until every change signature's measured turns together fit (a token pass of its own, as ``audit_traffic`` renders;
no model forward)."""

from __future__ import annotations

from engine.audit.caches import CacheSettings
from engine.audit.requests import RequestLog, _context_limit
from engine.audit.scan import sample_groups, scan_log
from engine.cache.loaded import LoadedModel
from engine.progress import StepProgress


def bounded_sample(
    lm: LoadedModel,
    log: RequestLog,
    sample: int,
    most: int | None,
    *,
    settings: CacheSettings = CacheSettings(),
    max_tokens: int | None = None,
    progress: StepProgress = None,
) -> int:
    """The largest sample up to ``sample`` whose measured turns, over every group, number at most ``most`` (``sample``
    itself where nothing bounds it)."""
    if most is None or sample <= 0:
        return sample
    scan = scan_log(lm.tokenizer, log, settings, limit=max_tokens or _context_limit(lm), model=lm.name, progress=progress)
    return next(k for k in range(sample, -1, -1) if sum(len(group.measured) for group in sample_groups(scan, k)) <= most)
