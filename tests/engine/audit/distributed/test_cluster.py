"""The audit on a Ray cluster of two nodes (``ray.cluster_utils.Cluster``, each node one CPU, on this machine): the same
command with ``--ray ADDRESS`` gives the one-process JSON. Each of the two tokenizer actors needs a CPU, so they run
on both nodes (``start_ray`` joins the cluster; ``ray_scan`` refuses more actors than the cluster's CPUs)."""

from pathlib import Path

import pytest

from kvscope.engine.audit.logs.requests import RequestLogError
from tests.engine.audit.distributed.test_distributed import BUNDLED, _audit

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")
distributed = pytest.importorskip("kvscope.engine.audit.distributed.ray_scan")


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():  # another module's local Ray
        ray.shutdown()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_worker_register_timeout_seconds", "600")  # a worker's start on a loaded machine (default 60 s)
        cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
        ray.shutdown()
        cluster.shutdown()


def test_the_same_command_on_a_cluster_gives_the_one_process_json(two_nodes):
    argv = [*map(str, BUNDLED), "--model", "tiny-qwen2", "--sample", "0", "--replicas", "2", "--routing", "session"]
    single = _audit(argv)
    spread = _audit([*argv, "--ray", two_nodes.address, "--workers", "2"])
    assert len([node for node in ray.nodes() if node["Alive"]]) == 2
    assert spread == single
    assert len(single["requests"]) == 19 and len(single["fleet"]) == 1


def test_more_actors_than_the_cluster_has_cpus_are_refused(two_nodes):
    from kvscope.engine.audit.logs.shards import LogFiles
    from kvscope.engine.models.tiny import tiny_tokenizer

    with pytest.raises(RequestLogError, match="--workers 3 .* 2 CPUs"):
        distributed.ray_scan(tiny_tokenizer(), LogFiles.of([Path(BUNDLED[0])]), workers=3)
