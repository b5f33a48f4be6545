from pathlib import Path

import pytest
import yaml

from reinforge.config import Config, ConfigError, config_to_dict, load_config, save_config
from reinforge.config.loader import schema_keys, suggest_key

DEFAULTS_YAML = Path(__file__).parents[2] / "reinforge" / "config" / "defaults.yaml"


def test_shipped_defaults_yaml_matches_the_dataclasses():
    assert yaml.safe_load(DEFAULTS_YAML.read_text()) == config_to_dict(Config())


def test_yaml_then_overrides_with_type_coercion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  n: 4\nactor:\n  optim:\n    lr: 2.0e-6\n")
    config = load_config(path, ["rollout.n=6", "actor.optim.betas=[0.9,0.95]", "data.val_batch_size=null",
                                "reward.kwargs.mode=flexible", "trainer.loggers=[console]"])
    assert config.rollout.n == 6
    assert config.actor.optim.lr == pytest.approx(2e-6)
    assert config.actor.optim.betas == [0.9, 0.95]
    assert config.data.val_batch_size is None
    assert config.reward.kwargs == {"mode": "flexible"}
    assert config.trainer.loggers == ["console"]
    assert isinstance(config, Config)


def test_unknown_key_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key actor.optim.learning_rate \(command line\); "
                                          r"did you mean actor.optim.lr\?"):
        load_config(None, ["actor.optim.learning_rate=1e-6"])
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError, match=r"rollout.temprature \(from run.yaml\); did you mean rollout.temperature"):
        load_config(path)


@pytest.mark.parametrize("unknown, expected", [
    ("actor.optim.learning_rate", "actor.optim.lr"),
    ("trainer.save_freq", "trainer.save_every"),
    ("data.train_batchsize", "data.train_batch_size"),
    ("actr.optim.lr", "actor.optim.lr"),
])
def test_suggestions(unknown, expected):
    assert suggest_key(unknown, schema_keys()) == expected


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError, match=r"actor.optim.lr='fast' \(command line\) is not a valid float"):
        load_config(None, ["actor.optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"rollout.n='many'.*int"):
        load_config(None, ["rollout.n=many"])


def test_section_set_as_value_is_explained():
    with pytest.raises(ConfigError, match="is a section"):
        load_config(None, ["actor=3"])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["rollout.n"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("overrides, message", [
    (["rollout.n=1", "algorithm.adv_estimator=grpo"], r"rollout.n=1 is too small for algorithm.adv_estimator=grpo.*2 or more"),
    (["rollout.n=1", "algorithm.adv_estimator=rloo"], "too small"),
    (["algorithm.adv_estimator=gae", "critic.enable=false"], "needs a critic"),
    (["data.train_batch_size=8", "actor.mini_batch_size=3"], "must divide data.train_batch_size=8"),
    (["actor.max_tokens_per_micro_batch=100"], "cannot hold one sequence"),
    (["algorithm.adv_estimator=nope"], "not one of"),
    (["actor.loss_agg_mode=mean"], "not one of"),
    (["rollout.name=vllm"], "not one of hf, native"),
    (["actor.policy_loss.clip_ratio_c=0.5"], "greater than 1"),
])
def test_cross_field_rules_fail_before_any_model_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_gae_with_auto_critic_and_n_one_is_fine():
    config = load_config(None, ["algorithm.adv_estimator=gae", "rollout.n=1"])
    from reinforge.config.validate import critic_enabled

    assert critic_enabled(config)


def test_saved_config_reloads_identically(tmp_path):
    config = load_config(None, ["rollout.n=3", "actor.optim.lr=3e-6"])
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config
