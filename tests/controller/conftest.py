"""One Ray instance for every Ray test of the session: Ray takes seconds to start on a small machine."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from reinforge.controller.ray_pool import release_all_pools

    started_here = not ray.is_initialized()
    if started_here:
        # no idle task workers started ahead: the members are actors, which never reuse them
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
                 _system_config={"prestart_worker_first_driver": False})
    yield ray
    release_all_pools()
    if started_here:
        ray.shutdown()
