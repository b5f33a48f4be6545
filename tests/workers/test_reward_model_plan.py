"""The memory planner counts the reward model: on the host between calls, on the device in its scoring phase."""

import json
import sys
from pathlib import Path

import pytest

from reinforge.config import Config
from reinforge.engine.memory_plan import GiB, ModelShape, reward_model_params
from reinforge.workers.memory_settings import memory_plan

sys.path.insert(0, str(Path(__file__).parents[1]))
import plan_configs  # noqa: E402
from plan_configs import QWEN25_1_5B  # noqa: E402


@pytest.fixture
def folders(tmp_path):
    """config.json alone of a 1.5B policy and a 1.5B-shaped reward model (the planner reads nothing else)."""
    policy, reward_model = tmp_path / "policy", tmp_path / "rm"
    for folder, architecture in ((policy, "Qwen2ForCausalLM"), (reward_model, "Qwen2ForSequenceClassification")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**QWEN25_1_5B, "architectures": [architecture]}))
    return policy, reward_model


def standard_config(policy, reward_model=None, **reward_model_settings) -> Config:
    config = plan_configs.standard_config(policy)
    if reward_model is not None:
        config.reward.reward_model.enable = True
        config.reward.reward_model.model_path = str(reward_model)
        for key, value in reward_model_settings.items():
            setattr(config.reward.reward_model, key, value)
    return config


def test_an_offloaded_reward_model_waits_on_the_host_and_scores_in_a_phase_of_its_own(folders):
    policy, reward_model = folders
    weights = 2 * reward_model_params(ModelShape.from_hf_config(QWEN25_1_5B))
    assert weights / GiB == pytest.approx(2.87, abs=0.01)  # Qwen2.5-1.5B's 1.54B parameters less its LM head
    without = memory_plan(standard_config(policy), host_bytes=256 * GiB)
    plan = memory_plan(standard_config(policy, reward_model), host_bytes=256 * GiB)
    assert plan.host["reward model"] == weights
    assert "reward model" not in plan.phases["update"] and "reward model" not in plan.phases["rollout"]
    assert plan.phases["update"] == without.phases["update"]  # the rollout and the update lose nothing
    reward = plan.phases["reward"]
    assert reward["reward model"] == weights
    # its largest micro-batch: whole prompt groups of 128 + 8 x 512 tokens under the actor's budget
    tokens = reward["reward model activations"] / (2 * (6 * 1536 + 2 * 2 * 128 + 3 * 8960))
    assert tokens <= plan.settings.micro_batch_tokens and tokens % (128 + 8 * 512) == 0
    assert "device, reward:" in plan.table() and "reward model 2.9" in plan.table()


def test_a_reward_model_kept_on_the_device_is_in_every_phase(folders):
    policy, reward_model = folders
    plan = memory_plan(standard_config(policy, reward_model, offload=False, max_tokens_per_micro_batch=8192),
                       host_bytes=256 * GiB)
    weights = 2 * reward_model_params(ModelShape.from_hf_config(QWEN25_1_5B))
    assert "reward model" not in plan.host
    assert plan.phases["rollout"]["reward model"] == plan.phases["update"]["reward model"] == weights
    tokens = plan.phases["reward"]["reward model activations"] / (2 * (6 * 1536 + 2 * 2 * 128 + 3 * 8960))
    assert tokens == 128 + 8 * 512  # one prompt group a micro-batch: 8192 tokens hold one
    # a reward model on a pool of its own costs the actor's devices nothing
    apart = standard_config(policy, reward_model, enable_resource_pool=True)
    assert "reward" not in memory_plan(apart, host_bytes=256 * GiB).phases
