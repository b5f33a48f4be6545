"""verl's reward-model keys, 0.7's reward_model section and 0.9's reward.reward_model: each is translated, already
what reinforge does, or refused in one line naming it; none is left out silently."""

from pathlib import Path

import pytest

from reinforge.config import ConfigError, load_config
from reinforge.config.verl.translate import translate_verl

HERE = Path(__file__).parent
KEYS_0_7 = (HERE / "verl_0_7_reward_model_keys.txt").read_text().split()
"""Every key under reward_model of verl 0.7.0's generated ppo_trainer.yaml and ppo_megatron_trainer.yaml."""
KEYS_0_9 = [key for key in (HERE / "verl_0_9_1_trainer_keys.txt").read_text().split()
            if key.startswith("reward.reward_model.")]
KEYS_PPO = [key for key in (HERE / "verl_ppo_trainer_keys.txt").read_text().split() if key.startswith("reward_model.")]
PROBES = (True, False, None, 0, 3, 4096, "fsdp", "/models/rm", {"a": 1}, [1])
"""Values of every kind; whatever a key is given, it is never dropped silently."""


def outcome(key: str, value: object) -> str:
    try:
        translation = translate_verl({key: value})
    except ConfigError as error:
        assert str(error).startswith(f"{key}="), str(error)
        return "refused"
    assert [line.verl_key for line in translation.no_equivalent] == [], (key, value)
    named = {line.verl_key for line in (*translation.translated, *translation.already_ours)}
    assert key in named, (key, value)
    return "translated"


def test_every_reward_model_key_of_verl_is_translated_or_refused_in_one_line():
    assert len(KEYS_0_7) > 80 and len(KEYS_0_9) > 40 and len(KEYS_PPO) > 60
    for key in sorted({*KEYS_0_7, *KEYS_0_9, *KEYS_PPO}):
        for value in PROBES:
            outcome(key, value)


def test_verl_0_7_reward_model_translates_into_the_reward_model_worker():
    translation = translate_verl([
        "reward_model.enable=True", "reward_model.model.path=/models/rm", "reward_model.micro_batch_size_per_gpu=4",
        "reward_model.max_length=2048", "reward_model.model.input_tokenizer=null", "reward_model.strategy=fsdp2",
        "reward_model.model.fsdp_config.param_offload=True", "reward_model.model.use_remove_padding=True",
        "data.max_prompt_length=512", "data.max_response_length=1024"])
    config = load_config(None, tree=translation.tree)
    reward_model = config.reward.reward_model
    assert (reward_model.enable, reward_model.model_path, reward_model.max_length) == (True, "/models/rm", 2048)
    assert reward_model.max_tokens_per_micro_batch == 4 * (512 + 1024)
    assert reward_model.input_tokenizer is None and reward_model.offload is True
    assert config.reward.combine.mode == "replace"  # verl's: the reward model's score replaces the rule's
    assert translation.no_equivalent == []
    dynamic = translate_verl(["reward_model.use_dynamic_bsz=True", "reward_model.micro_batch_size_per_gpu=4",
                              "reward_model.forward_max_token_len_per_gpu=32768"])
    assert dynamic.tree["reward"]["reward_model"] == {"max_tokens_per_micro_batch": 32768}
    parallel = translate_verl(["reward_model.use_dynamic_bsz=True", "reward_model.forward_max_token_len_per_gpu=8192",
                               "reward_model.ulysses_sequence_parallel_size=2"])  # verl's micro-batch spans 2 GPUs
    assert parallel.tree["reward"]["reward_model"] == {"max_tokens_per_micro_batch": 16384}


def test_verl_0_9_reward_model_translates():
    translation = translate_verl(["reward.reward_model.enable=True", "reward.reward_model.model_path=/models/rm",
                                  "reward.reward_model.rollout.name=vllm",
                                  "reward.reward_model.rollout.gpu_memory_utilization=0.5"])
    assert translation.tree["reward"]["reward_model"] == {"enable": True, "model_path": "/models/rm"}
    assert translation.no_equivalent == []


@pytest.mark.parametrize("argument, message", [
    ("reward_model.model.external_lib=my_models",
     "reward_model.model.external_lib=my_models (verl command line) has no equivalent: reinforge imports no model "
     "package by name; register the reward model's architecture with transformers or use trust_remote_code"),
    ("reward_model.reward_manager=batch",
     "reward_model.reward_manager=batch (verl command line) has no equivalent: reinforge's reward manager scores each "
     "sample as verl's naive one does (in reward.num_workers processes, reward.timeout_s each); verl's batch and "
     "remote managers call scorers another way: write a reward.custom_function"),
    ("reward.reward_model.sglang_url=x",
     "reward.reward_model.sglang_url=x (verl command line) has no equivalent: reinforge knows no such reward-model "
     "setting of verl's; remove it"),
])
def test_a_reward_model_setting_reinforge_cannot_honour_is_refused_by_name(argument, message):
    with pytest.raises(ConfigError) as error:
        translate_verl([argument])
    assert str(error.value) == message


@pytest.mark.parametrize("argument", ["reward.reward_manager.name=batch", "reward.reward_manager.source=importlib",
                                      "reward.reward_manager.module.path=my_manager.py"])
def test_verl_0_9s_reward_manager_is_refused_where_0_7s_is(argument):
    with pytest.raises(ConfigError) as error:
        translate_verl([argument])
    assert str(error.value).startswith(f"{argument} (verl command line) has no equivalent: ")
    assert "reward.custom_function" in str(error.value) and "\n" not in str(error.value)
    naive = translate_verl(["reward.reward_manager.name=naive", "reward.reward_manager.source=register"])
    assert naive.no_equivalent == [] and len(naive.already_ours) == 2
