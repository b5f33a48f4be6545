"""reward.reward_model and reward.combine: the settings that cannot work together, refused as the config loads."""

import pytest

from reinforge.config import ConfigError, load_config

ENABLED = ["reward.reward_model.enable=true", "reward.reward_model.model_path=/models/rm"]


@pytest.mark.parametrize("overrides, message", [
    (["reward.reward_model.enable=true"],
     "reward.reward_model.enable=true but reward.reward_model.model_path is not set; pass "
     "reward.reward_model.model_path=/path/to/reward_model (a sequence-classification folder)"),
    (["reward.combine.mode=sum"],
     "reward.combine.mode=sum combines a model's score with the rule's, but no reward.reward_model, reward.judge or "
     "reward.remote is enabled; enable one, or remove reward.combine.mode"),
    ([*ENABLED, "reward.combine.mode=mean"], "reward.combine.mode='mean' is not one of replace, sum, gate"),
    ([*ENABLED, "reward.combine.rm_weight=.nan"], "reward.combine.rm_weight=nan must be a finite number"),
    ([*ENABLED, "reward.reward_model.max_length=1"],
     "reward.reward_model.max_length=1 must be at least 2 tokens, or null (the default)"),
    ([*ENABLED, "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4"],
     "reward.overlong_buffer.enable=true shapes the rule-based score, which reward.combine.mode=replace leaves out; "
     "set reward.combine.mode=sum (rule_weight weighs the rule's score and its penalty) or "
     "reward.overlong_buffer.enable=false"),
    ([*ENABLED, "reward.reward_model.enable_resource_pool=true"],
     "reward.reward_model.enable_resource_pool=true places the reward model on devices of its own, which needs "
     "trainer.backend=ray; set it, or enable_resource_pool=false to share the actor's device"),
    ([*ENABLED, "reward.reward_model.enable_resource_pool=true", "trainer.backend=ray",
      "reward.reward_model.n_gpus_per_node=0"],
     "reward.reward_model.n_gpus_per_node=0 must be at least 1 (the reward model's own pool)"),
    (["reward.remote.enable=true", "reward.remote.url=' , '"],
     "reward.remote.enable=true but reward.remote.url=' , ' names no endpoint; pass "
     "reward.remote.url=http://host:port/get_reward (several: comma-separated)"),
    (["reward.remote.enable=true", "reward.remote.url=http://localhost:5000/get_reward", "reward.remote.timeout_s=.inf"],
     "reward.remote.timeout_s=inf must be positive and at most 1000000 (seconds one request may take in all)"),
    (["reward.judge.enable=true", "reward.judge.model_path=policy", "reward.judge.template='{response} Score:'",
      "reward.judge.timeout_s=1e12"],
     "reward.judge.timeout_s=1000000000000.0 must be positive and at most 1000000 (seconds the judging of one batch "
     "may take)"),
    (["reward.judge.enable=true", "reward.judge.model_path=policy", "reward.judge.template='{response} Score:'",
      "reward.judge.temperature=.nan"], "reward.judge.temperature=nan must be a finite number >= 0 (0: greedy)"),
])
def test_reward_model_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert str(error.value) == f"{message} ({message.split('=')[0]}: command line)"  # where the key was set


def test_the_judges_answer_tokens_are_text_never_yamls_booleans_and_differ(tmp_path):
    judge = ["reward.judge.enable=true", "reward.judge.model_path=policy", "reward.judge.template='{response} Right?'",
             "reward.judge.parse=yes_no"]
    with pytest.raises(ConfigError) as error:  # OmegaConf kept the text 'True': the judge's p(True) was the score
        load_config(None, [*judge, "reward.judge.yes_token=Yes"])
    assert str(error.value).startswith("reward.judge.yes_token (command line) was read as the boolean true, where text "
                                       "goes: YAML reads yes, no, on, off, true and false so unless quoted; quote the "
                                       "text, e.g. reward.judge.yes_token=\"'Yes'\" on the command line")
    run = tmp_path / "judge.yaml"
    run.write_text("reward:\n  judge:\n    no_token: No\n")
    with pytest.raises(ConfigError, match=r"^reward.judge.no_token \(from judge.yaml\) was read as the boolean false"):
        load_config(run, judge)
    assert load_config(None, [*judge, "reward.judge.yes_token='Yes'"]).reward.judge.yes_token == "Yes"
    with pytest.raises(ConfigError) as error:
        load_config(None, [*judge, "reward.judge.no_token='Yes'"])
    assert str(error.value).startswith("reward.judge.yes_token and reward.judge.no_token are both 'Yes', so every "
                                       "score would be 0.5; give the judge's two answers (e.g. 'Yes' and 'No')")


def test_a_reward_model_with_a_combination_loads():
    config = load_config(None, [*ENABLED, "reward.combine.mode=gate", "reward.combine.gate_threshold=0.5",
                                "reward.reward_model.input_tokenizer=null"])
    assert config.reward.combine.gate_threshold == 0.5
    assert config.reward.reward_model.input_tokenizer is None
