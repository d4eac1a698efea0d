"""A fleet on its own Ray actor (``ray_scan.FleetLane``) against the same fleet simulated beside the engines, fed the
same steps (no Ray needed: the lane is the actor's class); ``test_distributed`` runs it on a cluster."""

import numpy as np
import pytest

from kvscope.engine.audit.distributed.ray_scan import FleetLane
from kvscope.engine.audit.simulate.step import Simulation, Step
from tests.engine.audit.simulate.test_fleet import A1, B1, EXPECTED, SETTINGS


@pytest.mark.parametrize("routing", list(EXPECTED))
def test_a_fleet_simulated_apart_equals_the_fleet_beside_the_engines(routing):
    # FleetLane runs a fleet alone (Simulation(serving=False)); the replies each next turn resends included
    end = 99  # the end-of-turn token: A1's reply (50 51) is read off A2, which resends it
    turns = [(A1, "a"), (B1, "b"), (A1 + [50, 51, end] + [20, 21, 22], "a"), (B1 + [30, 31, 32], "b")]
    steps = [Step(np.array(ids, dtype=np.int32), np.zeros(0, dtype=np.int32), n, session) for n, (ids, session) in enumerate(turns)]
    together = Simulation(SETTINGS, [(2, routing)], {end})
    lane = FleetLane(SETTINGS, (2, routing), frozenset({end}))
    for step in steps:
        together.step(step)
    lane.feed(steps)
    assert together.replies["next_turn"] == lane.simulation.replies["next_turn"] == 1
    assert lane.result() == together.fleets[0].result()
    assert lane.simulation.held() == dict.fromkeys(lane.simulation.engines.caches, 0)  # the serving engines left empty
