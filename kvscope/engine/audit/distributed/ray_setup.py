"""Ray started for the audit: a local Ray of ``workers`` CPUs bound to the loopback address, or an existing
cluster joined (``start_ray``); ``RETRIES`` restarts of a lost actor and retries of a lost task."""

from __future__ import annotations

import os
from typing import Any

from kvscope.engine.audit.logs.requests import RequestLogError

RETRIES = 3  # restarts of a lost actor, retries of a lost task
LOCAL = "local"


def start_ray(address: str = LOCAL, workers: int = 2) -> None:
    """Join the Ray cluster at ``address``, or start a local one of ``workers`` CPUs (no dashboard, no usage
    statistics, its workers at the driver's priority, every server of it listening on 127.0.0.1 only)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return
    if workers < 1:
        raise RequestLogError(f"--workers must be at least 1, got {workers}")
    quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if address == LOCAL:
        # Ray starts its workers at nice 15 (for an interactive driver's sake); here they are the job's work, and on a
        # loaded machine a niced pool barely runs
        os.environ.setdefault("RAY_worker_niceness", "0")
        # 'local': a Ray of its own, even where another is running here (no address would join the latest one started)
        _init_on_loopback(address=LOCAL, num_cpus=workers, **quiet)
    else:
        ray.init(address=address, **quiet)


def _init_on_loopback(**options: Any) -> None:
    """``ray.init`` of a local cluster whose node address is 127.0.0.1, so that each of its servers binds there.

    In Ray 2.60 a server binds to loopback only when the node's address is loopback (the GCS, the raylet's node and
    object managers, every worker's and the driver's gRPC server, the runtime-env agent; with ray[default], the
    dashboard agent, its metrics exporter and the monitor's and dashboard's metrics ports too), and to all interfaces
    otherwise. ``ray.init`` replaces a loopback
    ``_node_ip_address`` with the machine's routable address unless ``ray_constants.ENABLE_RAY_CLUSTER`` is off
    (``services.resolve_ip_for_localhost``): Ray's own setting on macOS and Windows, read from
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ray is first imported. It is turned off for this call only."""
    import ray
    from ray._private import ray_constants

    cluster = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(**options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster
