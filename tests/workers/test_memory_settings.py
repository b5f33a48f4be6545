"""The plan of a config: rollout.gpu_memory_utilization sizes the native engine's cache, and the table says where
each setting comes from."""

import json
import sys
from pathlib import Path

import pytest

from reinforge.engine.memory_plan import GiB, MemoryPlanError
from reinforge.workers.memory_settings import memory_plan

sys.path.insert(0, str(Path(__file__).parents[1]))
from plan_configs import QWEN25_1_5B, standard_config  # noqa: E402


@pytest.fixture
def config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_1_5B))
    config = standard_config(tmp_path)  # long responses: 128 sequences, where the engine could hold 512
    config.data.train_batch_size, config.data.max_response_length, config.trainer.host_memory_gib = 16, 8192, 500.0
    return config


def test_the_cache_fills_the_fraction_and_a_kept_cache_counts_in_the_update(config):
    """The plan counted a cache of the step's 128 sequences (28.5 GiB) where the engine takes what 0.9 of the device
    leaves (102 GiB), and an update beside a kept cache had that much less than planned."""
    config.rollout.gpu_memory_utilization = 0.9
    plan = memory_plan(config)
    rollout, update = plan.phases["rollout"], plan.phases["update"]
    assert rollout["kv cache"] > 100 * GiB
    assert sum(rollout.values()) == pytest.approx(0.9 * 139 * GiB)
    assert plan.fits and not plan.settings.keep_rollout_memory and "kv cache" not in update
    config.rollout.free_cache_engine = False  # kept: the update runs beside the whole cache
    kept = memory_plan(config).phases
    assert kept["update"]["kv cache"] == kept["rollout"]["kv cache"] > 100 * GiB
    config.rollout.free_cache_engine = "auto"
    assert "rollout.kv_cache_gib                 " f"{rollout['kv cache'] / GiB:.1f}" in plan.table()
    assert "(rollout.gpu_memory_utilization=0.9)" in plan.table()
    config.rollout.gpu_memory_utilization = None  # the planner's own size: every sequence at full length
    assert memory_plan(config).phases["rollout"]["kv cache"] < 30 * GiB


def test_a_fraction_that_leaves_no_cache_or_more_than_the_device_is_refused_naming_it(config):
    config.rollout.gpu_memory_utilization = 0.05
    with pytest.raises(MemoryPlanError, match=r"^rollout.gpu_memory_utilization=0.05 leaves 0.00 GiB for the KV cache "
                                              r".* less than one sequence of .* = 8320 tokens .*; raise it, or leave it "
                                              r"null"):
        memory_plan(config)
    config.rollout.gpu_memory_utilization, config.trainer.gpu_memory_gib = 1.0, 80.0  # no room for the overhead
    with pytest.raises(MemoryPlanError, match=r"it would fit with rollout.gpu_memory_utilization=null"):
        memory_plan(config)


def test_the_table_marks_what_the_run_fixes_apart_from_what_the_user_set(config):
    """The hf engine's freed memory read '(set)' in a table of a run that set nothing."""
    config.rollout.name, config.data.max_response_length = "hf", 512
    table = memory_plan(config).table()
    assert "rollout.free_cache_engine            True       (fixed)" in table
    assert "(set)" not in table
    config.rollout.free_cache_engine = True
    assert "rollout.free_cache_engine            True       (set)" in memory_plan(config).table()
