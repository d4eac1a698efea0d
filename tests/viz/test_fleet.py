"""The fleet figure: routers that keep the same share of the cache (often: session affinity and prefix-aware both
keep one server's reuse) stay visible, each with its own marker drawn inside the markers of the routers before it."""

from kvscope.viz.fleet import ROUTING_LABELS, fleet_figure
from tests.viz.figure_cases import FLEET


def _tied(data: dict) -> dict:
    """``data`` with every router at the same hit rate as one server, at every replica count."""
    one = data["engines"]["hit_rate"]
    return data | {"fleet": [entry | {"hit_rate": dict(one)} for entry in data["fleet"]]}


def test_routers_at_one_hit_rate_stay_told_apart():
    figure = fleet_figure(_tied(FLEET))
    for column in range(1, 4):
        routers = [trace for trace in figure.select_traces(col=column) if trace.name in ROUTING_LABELS.values()]
        assert [trace.name for trace in routers] == list(ROUTING_LABELS.values())
        assert len({tuple(trace.y) for trace in routers}) == 1  # drawn over one another
        assert len({trace.marker.symbol for trace in routers}) == len(routers)
        sizes = [trace.marker.size for trace in routers]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes) and min(sizes) >= 6, sizes
