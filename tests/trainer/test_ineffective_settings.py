"""A setting that the rest of the config makes ineffective is a warning line at start (or a refusal)."""

import logging

import pytest

from reinforge.config import ConfigError, load_config, load_sft_config
from reinforge.config.schema import Config
from reinforge.config.sft_schema import SFTConfig
from reinforge.trainer.ineffective_settings import IGNORED_WHEN, ineffective_settings
from reinforge.trainer.preflight import check_config, preflight

# (the setting, the config that makes it ineffective, what the warning says)
WARNED = [
    ("trainer.test_every=1", [], "data.val_files is empty, so the run never validates"),
    ("rollout.val_kwargs.n=4", ["rollout.val_kwargs.temperature=1.0"], "data.val_files is empty"),
    ("rollout.val_kwargs.temperature=0.7", [], "data.val_files is empty"),
    ("rollout.val_kwargs.top_p=0.9", [], "data.val_files is empty"),
    ("rollout.val_kwargs.top_k=20", [], "data.val_files is empty"),
    ("data.val_batch_size=2", [], "data.val_files is empty"),
    ("data.max_val_samples=10", [], "data.val_files is empty"),
    ("actor.kl_loss_coef=5", ["actor.use_kl_loss=false"], "actor.use_kl_loss is false"),
    ("actor.kl_loss_type=k1", [], "actor.use_kl_loss is false"),
    ("algorithm.kl_ctrl.kl_coef=0.1", [], "algorithm.use_kl_in_reward is false"),
    ("algorithm.kl_ctrl.type=adaptive", [], "algorithm.use_kl_in_reward is false"),
    ("algorithm.kl_penalty=k3", [], "algorithm.use_kl_in_reward is false"),
    ("algorithm.kl_ctrl.target_kl=0.5", ["algorithm.use_kl_in_reward=true"], "algorithm.kl_ctrl.type is fixed"),
    ("algorithm.kl_ctrl.horizon=100", ["algorithm.use_kl_in_reward=true"], "algorithm.kl_ctrl.type is fixed"),
    ("critic.optim.lr=1e-4", [], "the run has no critic"),
    ("critic.cliprange_value=0.2", ["algorithm.adv_estimator=rloo"], "the run has no critic"),
    ("critic.warmup_steps=3", ["algorithm.adv_estimator=grpo", "critic.enable=false"], "the run has no critic"),
    ("critic.model_path=/models/value", [], "the run has no critic"),
    ("ref.param_offload=true", [], "the run loads no reference model"),
    ("ref.max_tokens_per_micro_batch=4096", ["actor.use_kl_loss=true", "model.lora.rank=8"],
     "with LoRA the reference is the actor itself"),
    ("algorithm.lam=0.95", [], "only GAE reads lambda"),
    ("actor.loss_scale_factor=512", [], "only seq-mean-token-sum-norm divides by it"),
    ("critic.loss_scale_factor=512", ["algorithm.adv_estimator=gae"], "only seq-mean-token-sum-norm divides by it"),
    ("algorithm.gamma=0.99", [], "only the gae, reinforce_plus_plus estimators discount returns"),
    ("algorithm.norm_adv_by_std=false", ["algorithm.adv_estimator=rloo"], "estimators divide by a group's std"),
    ("algorithm.grpo_epsilon=1e-4", ["algorithm.norm_adv_by_std=false"], "algorithm.norm_adv_by_std is false"),
    ("algorithm.gdpo_reward_keys=[acc]", [], "only the gdpo estimator reads them"),
    ("algorithm.gdpo_reward_weights=[1.0]", [], "only the gdpo estimator reads them"),
    ("rollout.kv_cache_gib=4", ["rollout.name=hf"], "settings of the native engine and rollout.name is hf"),
    ("rollout.gpu_memory_utilization=0.6", [], "settings of the native engine"),
    ("rollout.free_cache_engine=false", [], "settings of the native engine"),
    ("rollout.enable_prefix_caching=false", [], "settings of the native engine"),
    ("rollout.max_prefill_chunk_tokens=4096", [], "settings of the native engine"),
    ("rollout.kv_cache_dtype=fp8", [], "settings of the native engine"),
    ("rollout.decode_products=timed", [], "settings of the native engine"),
    ("rollout.shared_prefix_decode=true", [], "settings of the native engine"),
    ("trainer.max_staleness=2", ["trainer.mode=one_step_off"], "they are settings of trainer.mode=async"),
    ("trainer.trigger_sync_steps=2", [], "they are settings of trainer.mode=async"),
    ("trainer.max_in_flight_groups=64", [], "they are settings of trainer.mode=async"),
    ("trainer.async_deterministic=true", ["trainer.mode=one_step_off"], "they are settings of trainer.mode=async"),
    ("rollout.segment_tokens=64", [], "they are settings of trainer.mode=async"),
    ("trainer.separate_rollout=true", [], "trainer.mode is sync"),
    ("trainer.proximal=loglinear", [], "trainer.mode is sync"),
    ("algorithm.filter_groups.metric=score", [], "algorithm.filter_groups.enable is false"),
    ("algorithm.filter_groups.max_num_gen_batches=3", [], "algorithm.filter_groups.enable is false"),
    ("model.lora.alpha=16", [], "model.lora.rank is 0"),
    ("model.lora.dropout=0.1", [], "model.lora.rank is 0"),
    ("model.lora.target_modules=[q_proj]", [], "model.lora.rank is 0"),
    ("reward.overlong_buffer.len=64", [], "reward.overlong_buffer.enable is false"),
    ("reward.overlong_buffer.penalty_factor=2", [], "reward.overlong_buffer.enable is false"),
    ("algorithm.rollout_correction.rollout_is_threshold=3.0", [], "rollout_is is null"),
    ("algorithm.rollout_correction.rollout_is_batch_normalize=true", [], "rollout_is is null"),
    ("algorithm.rollout_correction.rollout_rs_threshold=3.0", [], "rollout_rs is null"),
    ("algorithm.rollout_correction.loss_type=reinforce", [], "bypass_mode is false"),
    ("actor.policy_loss.clip_ratio=0.1", ["actor.policy_loss.loss_mode=kl_cov"], "only the policy losses vanilla,"),
    ("actor.policy_loss.clip_ratio_low=0.1", ["actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=0.1"],
     "only the policy losses vanilla,"),
    ("actor.policy_loss.clip_ratio_high=0.28", ["actor.policy_loss.loss_mode=gpg"], "only the policy losses vanilla,"),
    ("actor.policy_loss.clip_ratio_high=0.28", ["algorithm.rollout_correction.bypass_mode=true",
                                                "algorithm.rollout_correction.loss_type=reinforce"], "clips nothing"),
    ("actor.policy_loss.clip_ratio_c=10", ["actor.policy_loss.loss_mode=gspo"],
     "only the policy losses vanilla, dppo_tv, dppo_kl read it"),
    ("actor.policy_loss.clip_cov_ratio=0.001", [], "parameters of actor.policy_loss.loss_mode=clip_cov"),
    ("actor.policy_loss.clip_cov_lb=2", [], "loss_mode=clip_cov"),
    ("actor.policy_loss.clip_cov_ub=4", [], "loss_mode=clip_cov"),
    ("actor.policy_loss.kl_cov_ratio=0.001", [], "loss_mode=kl_cov"),
    ("actor.policy_loss.ppo_kl_coef=1", [], "loss_mode=kl_cov"),
    ("actor.policy_loss.tau_pos=2", [], "loss_mode=sapo"),
    ("actor.policy_loss.tau_neg=2", [], "loss_mode=sapo"),
    ("actor.policy_loss.dro_beta=0.1", [], "loss_mode=dro"),
    ("actor.optim.warmup_ratio=0.1", ["actor.optim.warmup_steps=5"], "actor.optim.warmup_steps is set"),
    ("actor.optim.min_lr_ratio=0.1", [], "actor.optim.schedule is not cosine"),
    ("critic.optim.min_lr_ratio=0.1", ["algorithm.adv_estimator=gae"], "critic.optim.schedule is not cosine"),
    ("data.truncation=left", [], "data.filter_overlong_prompts drops every overlong prompt"),
    ("model.attn_implementation=eager", [], "it is an SFT setting"),
    ("trainer.total_epochs=3", ["trainer.total_steps=10"], "trainer.total_steps is set"),
    ("reward.max_memory_mb=1024", ["reward.num_workers=0"], "no heap cap applies"),
    ("trainer.ray_address=10.0.0.1:6379", [], "trainer.backend is local"),
    ("reward.reward_model.model_path=/models/rm", [], "reward.reward_model.enable is false"),
    ("reward.reward_model.offload=false", [], "reward.reward_model.enable is false"),
    ("reward.reward_model.nnodes=2", ["reward.reward_model.enable=true", "reward.reward_model.model_path=/models/rm"],
     "the reward model shares the actor's devices"),
    ("reward.combine.rm_weight=0.5", ["reward.reward_model.enable=true", "reward.reward_model.model_path=/models/rm"],
     "they weigh the scores of reward.combine.mode=sum"),
    ("reward.combine.gate_threshold=0.5", ["reward.reward_model.enable=true",
                                          "reward.reward_model.model_path=/models/rm", "reward.combine.mode=sum"],
     "it is the rule's pass mark of reward.combine.mode=gate"),
]

# (the setting, the config that makes it a mistake, the refusal)
REFUSED = [
    ("data.gen_batch_size=16", [], "only applies to dynamic sampling"),
    ("actor.policy_loss.loss_mode=gspo", ["algorithm.rollout_correction.bypass_mode=true"], "would be ignored"),
    ("critic.warmup_steps=3", ["algorithm.adv_estimator=gae", "critic.enable=false", "rollout.n=2"],
     "needs a critic but critic.enable=false"),
]


@pytest.mark.parametrize("setting, making, says", WARNED,
                         ids=lambda value: value if isinstance(value, str) and "=" in value else "")
def test_a_setting_without_effect_warns_in_one_line(setting, making, says):
    key = setting.split("=")[0]
    lines = [line for line in ineffective_settings(load_config(None, [*making, setting]))
             if line.startswith(f"{key}=")]
    assert len(lines) == 1 and says in lines[0] and "\n" not in lines[0]
    assert lines[0].endswith(f", or remove {key}")
    # the same config with the setting at its default says nothing of it
    assert not [line for line in ineffective_settings(load_config(None, making)) if line.startswith(f"{key}=")]


@pytest.mark.parametrize("setting, making, says", REFUSED, ids=lambda value: value if isinstance(value, str)
                         and "=" in value else "")
def test_a_setting_that_is_clearly_a_mistake_is_refused(setting, making, says):
    with pytest.raises(ConfigError, match=says):
        check_config(load_config(None, [*making, setting], validate=False))


def test_every_key_the_rules_name_is_listed_above():
    listed = {setting.split("=")[0] for setting, _, _ in WARNED}
    named = {key for rule in IGNORED_WHEN for key in rule.keys}
    assert named - listed == {"critic.optim.weight_decay", "critic.optim.betas", "critic.optim.eps",
                              "critic.optim.warmup_steps", "critic.optim.warmup_ratio", "critic.optim.schedule",
                              "critic.loss_agg_mode", "critic.ppo_epochs", "critic.max_tokens_per_micro_batch",
                              "critic.grad_clip", "critic.param_offload", "critic.optimizer_offload",  # as critic.optim.lr
                              "reward.reward_model.input_tokenizer", "reward.reward_model.max_length",
                              "reward.reward_model.max_tokens_per_micro_batch", "reward.reward_model.trust_remote_code",
                              "reward.reward_model.enable_resource_pool", "reward.reward_model.n_gpus_per_node",
                              "reward.combine.rule_weight"}
    assert listed <= named


def test_the_defaults_warn_about_nothing():
    assert ineffective_settings(Config()) == []
    assert ineffective_settings(SFTConfig()) == []


@pytest.mark.parametrize("setting, making, says", [
    ("trainer.test_every=5", [], "data.val_files is empty"),
    ("data.val_batch_size=8", [], "data.val_files is empty"),
    ("data.max_val_samples=8", [], "data.val_files is empty"),
    ("trainer.total_epochs=3", ["trainer.total_steps=10"], "trainer.total_steps is set"),
    ("optim.min_lr_ratio=0.1", ["optim.schedule=constant"], "optim.schedule is not cosine"),
    ("optim.warmup_ratio=0.1", ["optim.warmup_steps=5"], "optim.warmup_steps is set"),
], ids=lambda value: value if isinstance(value, str) and "=" in value else "")
def test_an_sft_setting_without_effect_warns_in_one_line(setting, making, says):
    key = setting.split("=")[0]
    lines = [line for line in ineffective_settings(load_sft_config(None, [*making, setting]))
             if line.startswith(f"{key}=")]
    assert len(lines) == 1 and says in lines[0]
    assert not [line for line in ineffective_settings(load_sft_config(None, making)) if line.startswith(f"{key}=")]


def test_a_run_warns_at_start_about_validation_that_never_runs_and_an_unused_kl_coefficient(rl_args, tmp_path,
                                                                                          caplog):
    config = load_config(None, rl_args(tmp_path / "run", **{"trainer.test_every": 1, "trainer.val_before_train": True,
                                                             "actor.kl_loss_coef": 5}))
    with caplog.at_level(logging.WARNING, logger="reinforge.trainer.ineffective_settings"):
        preflight(config)
    warned = [record.getMessage() for record in caplog.records if record.name.endswith("ineffective_settings")]
    assert warned == [
        "trainer.test_every=1 has no effect: data.val_files is empty, so the run never validates; give "
        "data.val_files, or remove trainer.test_every",
        "actor.kl_loss_coef=5.0 has no effect: actor.use_kl_loss is false; set actor.use_kl_loss=true, or remove "
        "actor.kl_loss_coef"]


def test_an_estimator_registered_outside_reinforge_may_read_the_discount(monkeypatch):
    from reinforge.algorithms import ADVANTAGE_ESTIMATORS
    from reinforge.algorithms.advantages import AdvantageEstimator

    def discounted(**_):
        raise NotImplementedError

    discounted.__module__ = "my_estimators"
    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, "my_discounted", AdvantageEstimator(discounted))
    config = Config()
    config.algorithm.adv_estimator, config.algorithm.gamma = "my_discounted", 0.99
    assert ineffective_settings(config) == []


def test_clip_ratios_of_a_loss_that_clips_say_nothing():
    for mode in ("vanilla", "gspo", "cispo", "clip_cov"):
        config = load_config(None, [f"actor.policy_loss.loss_mode={mode}", "actor.policy_loss.clip_ratio_high=0.28"])
        assert ineffective_settings(config) == []
    bypass = ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=ppo_clip"]
    assert ineffective_settings(load_config(None, [*bypass, "actor.policy_loss.clip_ratio_c=10"])) == []
    # no dual clip at all (the API's mapping of TRL's delta=None) is what a loss without one does anyway
    assert ineffective_settings(load_config(None, ["actor.policy_loss.loss_mode=gspo",
                                                   "actor.policy_loss.clip_ratio_c=.inf"])) == []


def test_a_critic_enabled_beside_an_estimator_that_reads_no_values_warns_that_it_is_trained_unused():
    """As in verl, critic.enable=true trains a critic under grpo (its critic/* metrics logged), whose values no
    advantage reads: one line names the key, what the run does with it and the fixes."""
    lines = ineffective_settings(load_config(None, ["algorithm.adv_estimator=grpo", "critic.enable=true"]))
    assert lines == ["critic.enable=true with algorithm.adv_estimator=grpo, which reads no values: the run plans, loads "
                     "and trains a critic whose values no advantage uses (its memory and time spent for the critic/* "
                     "metrics alone); remove critic.enable to train without it, or use algorithm.adv_estimator=gae to "
                     "train with its values"]
    assert ineffective_settings(load_config(None, ["algorithm.adv_estimator=gae", "critic.enable=true"])) == []
    assert ineffective_settings(load_config(None, ["algorithm.adv_estimator=grpo", "critic.enable=false"])) == []
