"""One Ray instance for the Ray tests of this folder: Ray takes seconds to start on a small machine.

It stops once the tests leave this folder: its processes (the GCS, the raylet, the log monitor and agents) would
otherwise go on polling beside every later test of the process. A Ray test that comes after that starts it again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_STARTED: list = []
"""The ``ray`` module, while this process has a Ray instance that ``ray_cluster`` started."""


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from reinforge.controller.ray_backend import RAY_SYSTEM_CONFIG
    from reinforge.controller.ray_pool import release_all_pools

    if not ray.is_initialized():
        # no idle task workers started ahead: the members are actors, which never reuse them
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
                 _system_config={**RAY_SYSTEM_CONFIG, "prestart_worker_first_driver": False})
        _STARTED[:] = [ray]
    yield ray
    release_all_pools()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's own teardown: stop the Ray instance ``ray_cluster`` started when no test of this folder
    follows in this process."""
    result = yield
    if _STARTED and (nextitem is None or Path(nextitem.path).parent != Path(__file__).parent):
        _STARTED.pop().shutdown()
    return result
