"""The sample a bound on measured turns allows: a host that measures at most N turns of a log lowers ``--sample K``
until every change signature's measured turns together fit (a token pass of its own, as ``audit_traffic`` renders;
no model forward)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.audit.logs.render import context_limit
from engine.audit.logs.requests import RequestLog
from engine.audit.scan.token_pass import sample_groups, scan_log
from engine.audit.simulate.caches import CacheSettings
from engine.progress import StepProgress

if TYPE_CHECKING:  # a tokenizer is all it reads: no torch at import
    from engine.cache.loaded import LoadedModel, LoadedTokenizer


def bounded_sample(
    lm: LoadedModel | LoadedTokenizer,
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
    scan = scan_log(lm.tokenizer, log, settings, limit=max_tokens or context_limit(lm), model=lm.name, progress=progress)
    return next(k for k in range(sample, -1, -1) if sum(len(group.measured) for group in sample_groups(scan, k)) <= most)
