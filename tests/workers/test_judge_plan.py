"""The memory planner counts a judge model of its own: its weights on the device in every phase, and a judge phase
with its engine's weight copy, KV cache and activations; the policy as its own judge costs nothing."""

import json
import sys
from pathlib import Path

import pytest

from reinforge.config import Config
from reinforge.engine.memory_plan import GiB, ModelShape
from reinforge.workers.memory_settings import memory_plan

sys.path.insert(0, str(Path(__file__).parents[1]))
from plan_configs import QWEN25_1_5B, standard_config  # noqa: E402

QWEN25_1_5B = dict(QWEN25_1_5B, architectures=["Qwen2ForCausalLM"])
QWEN25_0_5B = dict(QWEN25_1_5B, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                   intermediate_size=4864)


def model_folder(path, config: dict):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))  # the planner reads nothing else
    return path


def judged_config(policy, judge_path: str | None) -> Config:
    config = standard_config(policy)
    if judge_path is not None:
        config.reward.judge.enable = True
        config.reward.judge.model_path = judge_path
    return config


def test_a_judge_of_its_own_is_on_the_device_in_every_phase_and_generates_in_a_phase_of_its_own(tmp_path):
    policy = model_folder(tmp_path / "policy", QWEN25_1_5B)
    judge = model_folder(tmp_path / "judge", QWEN25_0_5B)
    weights = 2 * ModelShape.from_hf_config(QWEN25_0_5B).num_params
    assert weights / GiB == pytest.approx(0.92, abs=0.01)  # Qwen2.5-0.5B's 494M parameters in bf16
    without = memory_plan(judged_config(policy, None), host_bytes=256 * GiB)
    plan = memory_plan(judged_config(policy, str(judge)), host_bytes=256 * GiB)
    assert "judge" not in without.phases and "judge" not in without.phases["update"]
    assert plan.phases["rollout"]["judge"] == plan.phases["update"]["judge"] == weights
    phase = plan.phases["judge"]
    assert phase["judge"] == phase["judge weight copy"] == weights
    assert phase["judge kv cache"] == plan.phases["rollout"]["kv cache"]  # the engine takes rollout.kv_cache_gib
    assert phase["judge activations"] > 0
    table = plan.table()
    assert "device, judge:" in table and "judge 0.9" in table


def test_the_policy_as_its_own_judge_costs_no_memory(tmp_path):
    policy = model_folder(tmp_path / "policy", QWEN25_1_5B)
    plan = memory_plan(judged_config(policy, "policy"), host_bytes=256 * GiB)
    assert "judge" not in plan.phases and "judge" not in plan.phases["update"]
