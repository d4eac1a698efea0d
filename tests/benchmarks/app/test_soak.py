"""The soak test's latency summary: p50/p90/p99 by the one percentile definition (numpy's 'linear'), named in its JSON."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.app import soak


def test_edit_latency_percentiles_interpolate_linearly_as_numpy_does():
    seconds = [3.1, 9.4, 4.0, 17.2, 5.5, 6.0, 50.5, 4.4, 3.9, 7.7]
    stats = soak._percentiles(seconds)
    assert stats["n"] == 10 and stats["max"] == 50.5 and stats["mean"] == pytest.approx(np.mean(seconds), abs=0.005)
    for q in (50, 90, 99):
        assert stats[f"p{q}"] == pytest.approx(np.percentile(seconds, q, method="linear"), abs=0.005)
    assert stats["p90"] == pytest.approx(20.53, abs=0.005)  # nearest rank (the stored runs' definition) would say 50.5
    assert soak._percentiles([]) is None
