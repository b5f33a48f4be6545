import re
from pathlib import Path

import pytest
import yaml

from reinforge.config import Config, ConfigError, config_to_dict, load_config, load_sft_config, save_config
from reinforge.config.loader import schema_keys, suggest_key
from reinforge.trainer.preflight import check_config, check_sft_config


def load_checked(path, overrides=()):
    """A config loaded and put through every rule: the schema's own (load_config) and the registries' (preflight)."""
    config = load_config(path, overrides)
    check_config(config)
    return config

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
    # a key in the wrong section: it was "did you mean data?" (a section) and "did you mean rollout.n?"
    ("data.n", "rollout.n"),
    ("rollout.lr", "actor.optim.lr"),
    ("lr", "actor.optim.lr"),
    ("critc.optim.lr", "critic.optim.lr"),
])
def test_suggestions(unknown, expected):
    assert suggest_key(unknown, schema_keys()) == expected


@pytest.mark.parametrize("command, override, hint", [
    ("sft", "trainning.x=1", "the sections are data, model, optim, trainer"),
    ("rm", "rm.bet=1", "the keys of rm are center_rewards_coefficient"),
    ("train", "qqqq=1", "the sections are data, model, actor, rollout, ref, critic, reward, algorithm, trainer"),
    ("train", "data.batch_size=4", "did you mean data.train_batch_size?"),  # sft's key; it was data.val_batch_size
])
def test_an_unknown_key_without_a_guess_names_the_keys_of_its_own_command(command, override, hint, capsys):
    from reinforge.cli import main

    assert main([command, override]) == 2  # it pointed sft, rm and dpo at train's reinforge/config/defaults.yaml
    assert capsys.readouterr().err.strip() == f"error: unknown key {override.split('=')[0]} (command line); {hint}"


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError, match=r"actor.optim.lr='fast' \(command line\) is not a valid float"):
        load_config(None, ["actor.optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"rollout.n='many'.*int"):
        load_config(None, ["rollout.n=many"])
    # Python's None is the text 'None': data.chat_template=None made every prompt the word None, and the run exited 0
    with pytest.raises(ConfigError, match=r"^data.chat_template='None' \(command line\) is the text None, not no "
                                          r"value; write null for that \(data.chat_template=null, or chat_template: "
                                          r"null in YAML\)$"):
        load_config(None, ["data.chat_template=None"], validate=False)
    assert load_config(None, ["data.chat_template=null"], validate=False).data.chat_template is None
    # a list or mapping given null (val_files: null for no validation) named no way to say "none"
    with pytest.raises(ConfigError, match=r"^data.val_files=null \(command line\) is not a valid list\[str\]; write "
                                          r"\[\] for none \(data.val_files=\[\], or val_files: \[\] in YAML\)$"):
        load_config(None, ["data.val_files=null"], validate=False)
    with pytest.raises(ConfigError, match=r"^reward.kwargs=null \(command line\) is not a valid mapping; write \{\}"):
        load_config(None, ["reward.kwargs=null"], validate=False)
    # OmegaConf reads any number as a bool: data.shuffle=2 was true; 0 and 1 (and yes, on, True) still read
    with pytest.raises(ConfigError, match=r"^data.shuffle=2 \(command line\) is not a valid bool: write true or false$"):
        load_config(None, ["data.shuffle=2"], validate=False)
    assert [load_config(None, [f"data.shuffle={text}"], validate=False).data.shuffle
            for text in ("0", "1", "yes", "off", "True")] == [False, True, True, False, True]


def test_a_chat_template_file_is_read_and_text_that_is_no_template_is_refused(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    # the path itself, taken as a template, rendered every prompt as the path's text
    assert load_config(None, [f"data.chat_template={tmp_path / 'chat.jinja'}"]).data.chat_template == template
    assert load_sft_config(None, [f"data.chat_template={tmp_path / 'chat.jinja'}"]).data.chat_template == template
    with pytest.raises(ConfigError, match=r"^data.chat_template='templates/chat.jinja' \(command line\) is neither a "
                                          r"Jinja chat template \(it has no \{\{ or \{%\) nor a file"):
        load_config(None, ["data.chat_template=templates/chat.jinja"])


def test_the_decode_products_choice_defaults_to_cublas_and_refuses_other_values():
    assert load_config(None, []).rollout.decode_products == "cublas"
    assert load_config(None, ["rollout.decode_products=timed"]).rollout.decode_products == "timed"
    with pytest.raises(ConfigError, match=r"rollout\.decode_products"):
        load_config(None, ["rollout.decode_products=fast"])


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
    (["actor.policy_loss.clip_ratio_c=0.5"], "greater than 1"),
    (["rollout.temperature=0", "rollout.n=4"], r"rollout.temperature=0 is greedy.*rollout.n=4"),
    (["rollout.val_kwargs.n=4"], r"rollout.val_kwargs.temperature=0 is greedy.*rollout.val_kwargs.n=4"),
    (["data.max_response_length=0"], "data.max_response_length=0 must be at least 1"),
    (["data.max_response_length=-8"], "data.max_response_length=-8 must be at least 1"),
    (["actor.optim.lr=-1e-6"], r"actor.optim.lr=-1e-06 is negative"),
    (["critic.optim.lr=-1"], r"critic.optim.lr=-1.0 is negative"),
    (["actor.optim.lr=nan"], r"actor.optim.lr=nan is not a number"),
    (["data.truncation=middle"], r"data.truncation='middle' is not one of error, left, right"),
    (["data.max_train_samples=0"], r"data.max_train_samples=0 must be at least 1, or null for every row"),
    (["data.max_val_samples=-1"], r"data.max_val_samples=-1 must be at least 1"),
    (["actor.grad_clip=-1"], r"actor.grad_clip=-1.0 must be positive"),
    (["critic.grad_clip=0"], r"critic.grad_clip=0.0 must be positive"),
    (["reward.timeout_s=0"], r"reward.timeout_s=0.0 must be positive"),
    (["reward.num_workers=-1"], r"reward.num_workers=-1 must be 0"),
    (["actor.policy_loss.clip_ratio_c=nan"], r"clip_ratio_c=nan must be greater than 1"),
    (["actor.ppo_mini_batch_size=8"], r"actor_rollout_ref.actor.ppo_mini_batch_size is verl's; reinforge calls it "
                                      r"actor.mini_batch_size"),
    (["actor.ppo_micro_batch_size_per_gpu=2"], r"ppo_micro_batch_size_per_gpu is verl's and has no equivalent here: "
                                               r"micro-batches are formed from the token budget"),
    (["actor.policy_loss.clip_ratio=-0.2"], r"clip_ratio=-0.2 is out of range"),
    (["actor.policy_loss.clip_ratio_low=1.5"], r"clip_ratio_low=1.5 is out of range.*\(0, 1\]"),
    (["actor.policy_loss.clip_ratio_high=0"], r"clip_ratio_high=0.0 is out of range"),
    (["algorithm.gamma=1.5"], r"algorithm.gamma=1.5 is out of range; it must be between 0 and 1"),
    (["algorithm.lam=-0.1"], r"algorithm.lam=-0.1 is out of range"),
    (["actor.optim.warmup_ratio=1.5"], r"actor.optim.warmup_ratio=1.5 is out of range"),
    (["trainer.total_steps=0"], r"trainer.total_steps=0 trains nothing"),
    (["rollout.stop_token_ids=[2,-1]"], r"^rollout.stop_token_ids=\[2, -1\] holds -1, which is no token id"),
    (["trainer.test_every=-1"], r"^trainer.test_every=-1 must be >= 0 .*\(trainer.test_every: command line\)$"),
    (["trainer.output_dir="], r"trainer.output_dir is empty, which would make the current folder the run folder"),
    (["trainer.total_steps=null", "trainer.total_epochs=0"], r"trainer.total_epochs=0 must be at least 1"),
    (["actor.policy_loss.loss_mode=dro"], r"needs actor.policy_loss.dro_beta > 0 \(it is None\)"),
    (["algorithm.grpo_epsilon=0"], r"algorithm.grpo_epsilon=0.0 must be positive"),
    (["algorithm.adv_estimator=gdpo"], "needs algorithm.gdpo_reward_keys"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[format,acc]", "algorithm.gdpo_reward_weights=[1.0]"],
     "gdpo_reward_weights has 1 values for 2 gdpo_reward_keys"),
    (["algorithm.rollout_correction.rollout_rs=token_k1,seq_sum_k2",
      "algorithm.rollout_correction.rollout_rs_threshold=2.0,0.8_1.25"], r"\(seq_sum_k2\)='0.8_1.25': this rule takes one"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2_1"],
     "lower bound above its upper bound"),
    (["algorithm.rollout_correction.loss_type=pg"], "loss_type='pg' is not one of ppo_clip, reinforce"),
    (["algorithm.rollout_correction.bypass_mode=true", "actor.policy_loss.loss_mode=gspo"],
     "actor.policy_loss.loss_mode=gspo would be ignored"),
    (["algorithm.rollout_correction.bypass_mode=true", "algorithm.adv_estimator=optimal_token_baseline"],
     "which algorithm.rollout_correction.bypass_mode=true skips"),
    (["trainer.mode=async", "trainer.proximal=loglinear", "algorithm.adv_estimator=tir_optimal_token_baseline"],
     "which trainer.proximal=loglinear skips on the stale batches of trainer.mode=async; set trainer.proximal=recompute"),
    (["model.lora.rank=-1"], r"model.lora.rank=-1 must be 0 \(off\) or a positive adapter rank"),
    (["model.lora.rank=8", "model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
    (["model.lora.dropout=1.0"], r"model.lora.dropout=1.0 must be in \[0, 1\)"),
    (["model.lora.rank=8", "model.lora.alpha=0"], r"model.lora.alpha=0.0 scales the adapters. output by alpha / rank"),
    (["model.lora.rank=8", "model.lora.target_modules=[q_proj,lm_head]"],
     "names lm_head, outside the decoder layers"),
    (["actor.keep_gathered=true", "trainer.devices_per_node=2"],
     r"actor.keep_gathered=true keeps one device's whole model gathered, but the run has 2 devices"),
    (["actor.keep_gathered=true", "actor.param_offload=true"], "parameters streamed from the host"),
    (["actor.keep_gathered=sometimes"], r"actor.keep_gathered='sometimes' must be auto or true or false"),
])
def test_cross_field_rules_fail_before_any_model_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_checked(None, overrides)


def test_gae_with_auto_critic_and_n_one_is_fine():
    load_checked(None, ["algorithm.adv_estimator=gae", "rollout.n=1"])


def test_saved_config_reloads_identically(tmp_path):
    config = load_config(None, ["rollout.n=3", "actor.optim.lr=3e-6"])
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config


def test_greedy_with_one_sample_and_log_space_clip_bounds_are_fine():
    load_checked(None, ["rollout.temperature=0", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"])
    load_checked(None, ["actor.policy_loss.loss_mode=geo_mean", "actor.policy_loss.clip_ratio_low=1.5"])


@pytest.mark.parametrize("overrides, message", [
    (["optim.lr=-1e-5"], "optim.lr=-1e-05 is negative"),
    (["optim.warmup_ratio=-0.1"], "optim.warmup_ratio=-0.1 is out of range"),
    (["trainer.total_steps=0"], "trainer.total_steps=0 trains nothing"),
    (["trainer.output_dir= "], "trainer.output_dir is empty"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip=-1.0 must be positive"),
    (["data.max_train_samples=0"], "data.max_train_samples=0 must be at least 1"),
    (["model.lora.rank=16"], r"model.lora.rank=16: reinforge sft trains every parameter and would ignore the adapters"),
])
def test_sft_config_rejects_the_same_run_settings(overrides, message):
    from reinforge.config import load_sft_config

    with pytest.raises(ConfigError, match=message):
        load_sft_config(None, overrides)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.kl_loss_coef=0.01",
     "unknown key actor_rollout_ref.actor.kl_loss_coef (command line); it is verl's key; reinforge calls it "
     "actor.kl_loss_coef (`reinforge train --from-verl ...` translates a whole verl command)"),
    ("trainer.save_freq=5", "unknown key trainer.save_freq (command line); it is verl's key; reinforge calls it "
                            "trainer.save_every"),
    ("actor_rollout_ref.actor.use_dynamic_bsz=true",
     "unknown key actor_rollout_ref.actor.use_dynamic_bsz (command line); it is verl's key and has no equivalent "
     "here: micro-batches are always balanced by tokens under actor.max_tokens_per_micro_batch"),
    ("actor_rollout_ref=1", "unknown key actor_rollout_ref (command line); it is a section of verl's config"),
])
def test_a_verl_key_names_its_translation_not_a_neighbour(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert str(error.value).startswith(message)


def test_an_rl_key_given_to_sft_names_sfts_own_key_not_a_verl_translation():
    """data.train_batch_size is verl's RL key and reinforge train's; reinforge sft calls its batch data.batch_size."""
    from reinforge.config import load_sft_config

    with pytest.raises(ConfigError) as error:
        load_sft_config(None, ["data.train_batch_size=4"])
    assert str(error.value) == "unknown key data.train_batch_size (command line); did you mean data.batch_size?"


def test_a_verl_section_in_yaml_names_a_translation(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    kl_loss_coef: 0.01\n    ppo_epochs: 2\n")
    with pytest.raises(ConfigError, match=r"unknown key actor_rollout_ref.actor \(from run.yaml\); it is verl's; translate "
                                          r"it with `reinforge config from-verl KEY=VALUE ...` .*\(e.g. "
                                          r"actor_rollout_ref.actor.kl_loss_coef is actor.kl_loss_coef here\)"):
        load_config(path)


def test_dapo_settings_are_checked_before_a_model_loads():
    from reinforge.config import load_config

    with pytest.raises(ConfigError, match=r"data.gen_batch_size=16 only applies to dynamic sampling; set "
                                          r"algorithm.filter_groups.enable=true"):
        load_config(None, ["data.gen_batch_size=16"])
    with pytest.raises(ConfigError, match=r"algorithm.filter_groups.metric='accuracy' is not one of acc, score"):
        load_config(None, ["algorithm.filter_groups.metric=accuracy"])
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer.len=0 must be in 1..data.max_response_length=256"):
        load_config(None, ["reward.overlong_buffer.enable=true"])
    config = load_config(None, ["algorithm.filter_groups.enable=true", "data.gen_batch_size=16",
                                "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=256"])
    assert config.data.gen_batch_size == 16
    # 2 batches of 16 prompts can never keep 64 groups: refused here, not after the model loads at step 1
    with pytest.raises(ConfigError, match=r"max_num_gen_batches=2 generation batches of data.gen_batch_size=16 prompts "
                                          r"cannot fill data.train_batch_size=64 groups .*set max_num_gen_batches to 4"):
        load_config(None, ["algorithm.filter_groups.enable=true", "data.gen_batch_size=16", "data.train_batch_size=64",
                           "algorithm.filter_groups.max_num_gen_batches=2"])
    assert load_config(None, ["algorithm.filter_groups.enable=true", "data.gen_batch_size=16", "data.train_batch_size=64",
                              "algorithm.filter_groups.max_num_gen_batches=0"]).data.gen_batch_size == 16


def test_lower_upper_thresholds_stay_text(tmp_path):
    # YAML 1.1 would read 0.5_5 as the number 0.55
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  rollout_correction:\n    rollout_is: token\n    rollout_is_threshold: 0.5_5\n")
    config = load_config(path, ["algorithm.rollout_correction.rollout_rs_threshold=0.8_1"])
    assert config.algorithm.rollout_correction.rollout_is_threshold == "0.5_5"
    assert config.algorithm.rollout_correction.rollout_rs_threshold == "0.8_1"
    # a number field still takes 1_000, and a plain number is its text
    config = load_config(None, ["trainer.total_steps=1_000", "algorithm.rollout_correction.rollout_is_threshold=3"])
    assert config.trainer.total_steps == 1000
    assert config.algorithm.rollout_correction.rollout_is_threshold == "3"

def test_exponents_without_a_dot_are_numbers_in_files_and_overrides(tmp_path):
    # YAML 1.1 reads 1e-3 as the text '1e-3': a reward function's keyword got a string, kv_cache_gib=1e1 was refused
    path = tmp_path / "run.yaml"
    path.write_text("reward:\n  kwargs:\n    tolerance: 1e-3\n    scale: 1.0e3\nactor:\n  optim:\n    lr: 1e-6\n")
    config = load_config(path, ["rollout.kv_cache_gib=1e1", "reward.kwargs.floor=-5E-1"], validate=False)
    assert config.reward.kwargs == {"tolerance": 0.001, "scale": 1000.0, "floor": -0.5}
    assert config.rollout.kv_cache_gib == 10.0 and config.actor.optim.lr == 1e-6



def test_one_file_for_a_list_of_files_is_a_list_of_one(tmp_path):
    """data.train_files=/x.parquet (verl's habit) on our command line and in YAML."""
    config = load_config(None, ["data.train_files=/x.parquet", "trainer.loggers=jsonl"], validate=False)
    assert config.data.train_files == ["/x.parquet"] and config.trainer.loggers == ["jsonl"]
    (tmp_path / "run.yaml").write_text("data:\n  val_files: /v.parquet\n")
    assert load_config(tmp_path / "run.yaml", validate=False).data.val_files == ["/v.parquet"]


def test_a_value_a_check_refuses_names_where_it_was_set(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_batch_size: 0\n")
    with pytest.raises(ConfigError, match=r"^data.train_batch_size=0 must be at least 1 \(data.train_batch_size: "
                                          r"from run.yaml\)$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^optim.lr=-1.0 is negative; .* \(optim.lr: command line\)$"):
        load_sft_config(path=None, overrides=["optim.lr=-1"])


def test_a_list_written_without_brackets_is_named_with_its_list(tmp_path):
    # it was one item 'jsonl,console', refused as no logger (or no file, after the memory plan, for data files)
    with pytest.raises(ConfigError, match=re.escape("trainer.loggers='jsonl, console' (command line) is one text with "
                                                    "commas; write a list as trainer.loggers=[jsonl,console] (quoted for "
                                                    "the shell), or ['jsonl, console'] for one item with a comma in it")):
        load_config(None, ["trainer.loggers=jsonl, console"], validate=False)
    (tmp_path / "run.yaml").write_text("data:\n  train_files: a.parquet,b.parquet\n")
    with pytest.raises(ConfigError, match=r"data.train_files='a.parquet,b.parquet' \(from run.yaml\) is one text"):
        load_config(tmp_path / "run.yaml", validate=False)
    assert load_config(None, ["data.train_files=['a,b.parquet']"], validate=False).data.train_files == ["a,b.parquet"]


def test_a_value_ending_in_a_colon_stays_text():
    config = load_config(None, ["reward.custom_function=rewards.py:", "trainer.experiment_name=a: b: c"], validate=False)
    assert config.reward.custom_function == "rewards.py:" and config.trainer.experiment_name == "a: b: c"


@pytest.mark.parametrize("override, message", [
    ("actor.optim.lr=inf", r"actor.optim.lr=inf is infinite"),
    ("actor.optim.lr=nan", r"actor.optim.lr=nan is not a number"),
    ("model.lora.alpha=nan", r"model.lora.alpha=nan scales"),
    ("trainer.devices_per_node=0", r"trainer.devices_per_node=0 must be at least 1"),
    ("trainer.gpu_memory_gib=inf", r"trainer.gpu_memory_gib=inf must be a positive number"),
])
def test_values_that_would_train_nothing_or_divide_by_zero_are_refused(override, message):
    from reinforge.config.validate import validate_config

    with pytest.raises(ConfigError, match=message):  # some at loading, the rest when the run validates
        validate_config(load_config(None, ["model.lora.rank=8", override]))


def test_a_typo_under_a_section_verl_also_has_is_a_typo_not_a_verl_key():
    with pytest.raises(ConfigError, match=r"model.lora.alph \(command line\); did you mean model.lora.alpha\?"):
        load_config(None, ["model.lora.alph=3"])


def test_auto_settings_name_auto_and_a_leaf_one_section_too_high_is_found():
    with pytest.raises(ConfigError, match=r"actor.param_offload=1 \(command line\) is not a valid bool or 'auto'"):
        load_config(None, ["actor.param_offload=1"])
    with pytest.raises(ConfigError, match=r"is not a valid int or 'auto'"):
        load_config(None, ["actor.max_tokens_per_micro_batch=true"])
    with pytest.raises(ConfigError, match=r"^actor.router_aux_loss_coef=\[1\] \(command line\) is not a valid float or "
                                          r"'declared' or null$"):
        load_config(None, ["actor.router_aux_loss_coef=[1]"])
    assert load_config(None, ["actor.router_aux_loss_coef=declared"]).actor.router_aux_loss_coef == "declared"
    assert suggest_key("actor.lr", schema_keys()) == "actor.optim.lr"


@pytest.mark.parametrize("override", [".data=1", "=x", "data.=1", "a..b=1"])
def test_an_override_with_an_empty_key_part_is_named(override):
    with pytest.raises(ConfigError, match=rf"override '{re.escape(override)}' \(command line\) has an empty key"):
        load_config(None, [override])


def test_a_yaml_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"trainer:\n  experiment_name: caf\xe9\n")  # Latin-1: it was "'utf-8' codec can't decode ..."
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))} has a byte that is not UTF-8 \(0xe9\) on line 2; "
                                          r"save the file as UTF-8$"):
        load_config(path)
    path.write_bytes("\ufefftrainer:\n  experiment_name: café\n".encode())  # a byte-order mark some editors write
    assert load_config(path, validate=False).trainer.experiment_name == "café"


def test_a_key_given_twice_in_a_yaml_file_is_refused_with_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second actor: section silently replaced the first one."""
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  optim:\n    lr: 1.0e-5\ntrainer:\n  total_steps: 3\nactor:\n  mini_batch_size: 4\n")
    with pytest.raises(ConfigError, match=r"run.yaml is not valid YAML at line 6, column 1: the key 'actor' is given "
                                          r"twice in one mapping \(first on line 1\); keep one of them; fix the file$"):
        load_config(path)
    path.write_text("actor:\n  optim:\n    lr: 1.0e-5\n    lr: 2.0e-5\n")
    with pytest.raises(ConfigError, match=r"the key 'lr' is given twice .*first on line 3"):
        load_config(path)
    path.write_text("base: &base\n  lr: 1.0e-5\nactor:\n  optim:\n    <<: *base\n    weight_decay: 0.1\n")
    with pytest.raises(ConfigError, match="unknown key base"):  # a merge key is not a repeated key
        load_config(path)
    path.write_text("rollout.n: 3\nrollout:\n  n: 5\n")  # the dotted key and the section's: 5 won without a word
    with pytest.raises(ConfigError, match=r"^rollout.n is given twice \(from run.yaml\): as a dotted key and inside "
                                          r"its section; keep one of them$"):
        load_config(path)
    path.write_text("rollout.n: 3\nrollout:\n  temperature: 0.5\n")
    assert load_config(path).rollout.n == 3


@pytest.mark.parametrize("overrides, message", [
    (["actor.optim.betas=[0.9]"], r"actor.optim.betas=\[0.9\] must be two numbers in \[0, 1\)"),
    (["critic.optim.betas=[0.9,1.5]"], r"critic.optim.betas=\[0.9, 1.5\] must be two numbers"),
    (["actor.optim.eps=-1"], r"actor.optim.eps=-1.0 must be a finite number >= 0"),
    (["actor.optim.weight_decay=-0.1"], r"actor.optim.weight_decay=-0.1 must be a finite number >= 0"),
    (["model.dtype=fp32"], r"model.dtype='fp32' is not one of auto, float32, bfloat16, float16"),
    (["trainer.loggers=[jsonl,wandbb]"], r"trainer.loggers names 'wandbb', which is not a tracking backend"),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"],
     r"algorithm.kl_ctrl.type=adaptive needs .*target_kl > 0 and .*horizon > 0 \(they are 0.1 and 0\)"),
    (["algorithm.kl_ctrl.kl_coef=-0.1"], r"algorithm.kl_ctrl.kl_coef=-0.1 must be a finite number >= 0"),
    (["actor.kl_loss_coef=nan"], r"actor.kl_loss_coef=nan must be a finite number"),
    (["actor.entropy_coeff=inf"], r"actor.entropy_coeff=inf must be a finite number"),
    (["actor.router_aux_loss_coef=-0.01"], r"^actor.router_aux_loss_coef=-0.01 must be a finite number >= 0 \(the "
     r"weight of a mixture of experts' load-balancing loss; null: the model config's\) \(actor.router_aux_loss_coef: "
     r"command line\)$"),
    (["actor.router_aux_loss_coef=model"], r"^actor.router_aux_loss_coef='model' is not a weight; give a finite number "
     r">= 0 \(0: no aux loss\), null \(the model config's router_aux_loss_coef when its output_router_logits is true\) "
     r"or declared \(the model config's router_aux_loss_coef, as TRL takes it\)"),
    (["actor.policy_loss.loss_mode=sapo", "actor.policy_loss.tau_pos=0"], r"tau_pos=0.0 and tau_neg=1.05 must both be"),
    (["actor.policy_loss.loss_mode=kl_cov", "actor.policy_loss.kl_cov_ratio=2"], r"kl_cov_ratio=2.0 must be in \(0, 1\]"),
    (["actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0"], r"clip_cov_ratio=0.0 must be in"),
    (["rollout.temperature=nan"], r"rollout.temperature=nan must be a finite number >= 0"),
    (["rollout.val_kwargs.temperature=-1"], r"rollout.val_kwargs.temperature=-1.0 must be a finite number >= 0"),
    (["rollout.val_kwargs.top_p=0"], r"rollout.val_kwargs.top_p=0.0 must be in \(0, 1\]"),
    (["rollout.top_k=-5"], r"^rollout.top_k=-5 must be a number of tokens \(at least 1\), or -1 \(or 0\) for all"),
    (["rollout.min_p=2"], r"rollout.min_p=2.0 must be in \[0, 1\]"),
    (["reward.fallback_score=nan"], r"reward.fallback_score=nan must be a finite number"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=8", "reward.overlong_buffer.penalty_factor=nan"],
     r"penalty_factor=nan must be >= 0"),
    (["trainer.num_logged_samples=-1"], r"trainer.num_logged_samples=-1 must be 0"),
    (["trainer.call_timeout_s=0"], r"trainer.call_timeout_s=0.0 must be positive"),
    (["trainer.call_timeout_s=1e12"], r"trainer.call_timeout_s=1000000000000.0 must be positive and at most 1000000"),
    (["reward.timeout_s=.inf"], r"reward.timeout_s=inf must be positive and at most 1000000 \(seconds a scorer"),
    (["rollout.multi_turn.tool_timeout_s=.inf"], r"tool_timeout_s=inf must be positive and at most 1000000 .*null: no"),
    (["ref.max_tokens_per_micro_batch=-1"], r"ref.max_tokens_per_micro_batch=-1 cannot hold one sequence"),
    (["algorithm.adv_estimator=gae", "critic.max_tokens_per_micro_batch=100"],
     r"critic.max_tokens_per_micro_batch=100 cannot hold one sequence"),
    (["algorithm.adv_estimator=gae", "critic.cliprange_value=-0.5"], r"critic.cliprange_value=-0.5 must be positive"),
    (["algorithm.adv_estimator=gae", "critic.ppo_epochs=0"], r"critic.ppo_epochs=0 must be at least 1, or null"),
    (["trainer.seed=-1"], r"trainer.seed=-1 must be between 0 and 4294967295"),
    (["data.seed=4294967296"], r"data.seed=4294967296 must be between 0 and 4294967295"),
    (["data.val_batch_size=0"], r"data.val_batch_size=0 must be at least 1, or null"),
    (["trainer.mode=async", "trainer.max_staleness=.inf"], r"trainer.max_staleness=inf must be a finite number >= 0"),
    (["trainer.mode=async", "trainer.max_staleness=nan"], r"trainer.max_staleness=nan must be a finite number >= 0"),
    (["trainer.mode=async", "data.train_batch_size=4", "trainer.max_in_flight_groups=3"],
     r"trainer.max_in_flight_groups=3 must be at least data.train_batch_size .* = 4, .*set it to 4 or more, or null"),
    (["trainer.mode=async", "data.train_batch_size=4", "trainer.trigger_sync_steps=2", "trainer.async_deterministic=true",
      "trainer.max_in_flight_groups=6"], r"trainer.max_in_flight_groups=6 must be at least trigger_sync_steps x "
     r"data.train_batch_size \(with trainer.async_deterministic\) = 8"),
    (["trainer.mode=one_step_off", "algorithm.adv_estimator=remax"],
     r"remax needs a greedy rollout per step, which trainer.mode=one_step_off does not run; use trainer.mode=sync"),
])
def test_values_refused_only_after_the_model_loaded_are_refused_with_the_config(overrides, message):
    """Each of these passed validation and failed once the model had loaded (AdamW's own checks, the KL controller,
    the tracker, the SAPO loss at step 1), some as a bare IndexError or KeyError."""
    with pytest.raises(ConfigError, match=message):
        load_checked(None, overrides)


def test_model_dtypes_are_the_loaders():
    from reinforge.config.validate import MODEL_DTYPES
    from reinforge.models.loading import DTYPES

    assert set(MODEL_DTYPES) == {"auto", *DTYPES}


def test_sft_checks_its_optimizer_loggers_and_dtype_too():
    from reinforge.config import load_sft_config

    for override, message in (("optim.betas=[0.9,0.999,0.5]", "optim.betas"), ("trainer.loggers=[tb]", "'tb'"),
                              ("model.dtype=bf16", "model.dtype='bf16'")):
        with pytest.raises(ConfigError, match=message):
            check_sft_config(load_sft_config(None, [override]))


def test_a_logger_whose_package_is_missing_stops_train_before_any_model_loads(monkeypatch, capsys, tmp_path):
    from reinforge.cli import main
    from reinforge.tracking import backends

    monkeypatch.setitem(backends.BACKEND_PACKAGES, "mlflow", ("reinforge_no_such_module", "mlflow"))
    # the model path does not exist: reaching the trainer would fail on it instead
    args = [f"model.path={tmp_path / 'missing'}", f"data.train_files=[{tmp_path / 'missing.parquet'}]",
            "trainer.loggers=[jsonl,mlflow]"]
    assert main(["train", *args]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: trainer.loggers names mlflow, which needs the mlflow package, not installed here; pip install mlflow "
        "(or reinforge[tracking]), or remove mlflow from trainer.loggers")
    load_config(None, args)  # the config itself stays valid (reinforge config from-verl may translate it)


def test_a_leading_tilde_in_a_path_setting_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    config_file = tmp_path / "run.yaml"
    config_file.write_text("data:\n  train_files: ~/data/train.parquet\ntrainer:\n  output_dir: ~/runs/x\n")
    config = load_config(config_file, ["reward.custom_function=~/rewards.py:score", "trainer.resume=~/ckpt/step_2",
                                       "rollout.multi_turn.tool_config_path=~/tools.yaml"])
    # trainer.output_dir=~/runs/x made a folder named ~ in the working directory
    assert config.trainer.output_dir == f"{tmp_path}/runs/x"
    assert config.reward.custom_function == f"{tmp_path}/rewards.py:score"
    assert config.trainer.resume == f"{tmp_path}/ckpt/step_2"
    assert config.rollout.multi_turn.tool_config_path == f"{tmp_path}/tools.yaml"
    assert config.data.train_files == ["~/data/train.parquet"]  # expanded where it is read, recorded as given
    from reinforge.config import load_sft_config

    assert load_sft_config(None, ["trainer.output_dir=~/sft"]).trainer.output_dir == f"{tmp_path}/sft"


def test_a_yaml_section_with_every_key_commented_out_sets_nothing(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("actor:\n#  optim:\n#    lr: 1e-5\nrollout:\n  n: 4\n")
    config = load_config(config_file)  # was: actor=None (from run.yaml) is not a valid ActorConfig
    assert config.rollout.n == 4 and config.actor == load_config(None).actor


@pytest.mark.parametrize("override, message", [
    ("critic.optim.lr=${nope.x}", r"^critic.optim.lr='\$\{nope.x\}' \(command line\) cannot be resolved: Interpolation "
                                  r"key 'nope.x' not found; fix the \$\{...\} reference"),
    ("trainer.experiment_name=${oc.env:REINFORGE_TEST_UNSET_VARIABLE}",
     r"^trainer.experiment_name='\$\{oc.env:REINFORGE_TEST_UNSET_VARIABLE\}' \(command line\) cannot be resolved: .*"
     r"Environment variable 'REINFORGE_TEST_UNSET_VARIABLE' not found"),
    ("model.path=???", r"^model.path=\?\?\? \(command line\) is a value left to fill in; set model.path=...$"),
])
def test_an_interpolation_that_does_not_resolve_is_one_config_line(override, message, monkeypatch):
    """These were OmegaConf's own exceptions, several lines each (full_key, reference_type, object_type)."""
    monkeypatch.delenv("REINFORGE_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_an_interpolation_names_the_file_it_came_from_and_resolves_against_later_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("REINFORGE_TEST_MODEL", "/models/m")
    config_file = tmp_path / "run.yaml"
    config_file.write_text("model:\n  path: ${oc.env:REINFORGE_TEST_MODEL}\ncritic:\n  optim:\n    lr: ${actor.optim.lr}\n"
                           "trainer:\n  experiment_name: ???\n")
    with pytest.raises(ConfigError, match=r"^trainer.experiment_name=\?\?\? \(from run.yaml\) is a value left"):
        load_config(config_file)
    config = load_config(config_file, ["trainer.experiment_name=e", "actor.optim.lr=3e-6"])
    assert (config.model.path, config.critic.optim.lr) == ("/models/m", 3e-6)


@pytest.mark.parametrize("override", ["rollout.stop_token_ids=[[1]]", "data.train_files=[a.parquet,{b: c}]",
                                      "model.lora.target_modules=[q_proj,[k_proj]]", "actor.optim.betas=[[0.9],0.99]"])
def test_a_list_item_that_is_itself_a_list_or_mapping_is_refused(override):
    key = override.split("=")[0]  # OmegaConf left such items unchecked: data.train_files held a dict
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=.* \(command line\) is not a valid list\[\w+\]: an "
                                          "item is itself a list or a mapping"):
        load_config(None, [override])


@pytest.mark.parametrize("override", ["data.train_files=[/data/train.parquet", "reward.kwargs={method: strict",
                                      "actor.optim.betas=[0.9,0.99]]"])
def test_a_list_or_mapping_cut_short_on_the_command_line_is_named(override):
    # read as text, data.train_files=[/x.parquet would be the file pattern '[/x.parquet', reported as matching no file
    with pytest.raises(ConfigError, match=rf"^override '{re.escape(override)}' \(command line\) is not a valid YAML "
                                          r"list or mapping \(.*\); write a list as \[a,b\]"):
        load_config(None, [override])


def test_text_that_starts_with_a_bracket_stays_text():
    assert load_config(None, ["trainer.experiment_name=[exp1] run"]).trainer.experiment_name == "[exp1] run"


def test_a_whole_mapping_on_the_command_line_replaces_the_files_and_a_key_of_it_adds_to_it(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("reward:\n  kwargs: {method: strict}\n")

    def kwargs(*overrides):
        return load_config(config_file, list(overrides), validate=False).reward.kwargs

    assert kwargs("reward.kwargs={}") == {}  # it was merged: {} changed nothing, the file's method stayed
    assert kwargs("reward.kwargs={format_score: 0.1}") == {"format_score": 0.1}
    assert kwargs("reward.kwargs.format_score=0.1") == {"method": "strict", "format_score": 0.1}
    assert kwargs("reward.kwargs={a: 1}", "reward.kwargs.b=2") == {"a": 1, "b": 2}


@pytest.mark.parametrize("text, key", [("defaults:\n  - ppo_trainer\n  - _self_\n", "defaults"),
                                       ("hydra:\n  run:\n    dir: outputs\n", "hydra")])
def test_a_hydra_config_file_is_named_as_such(tmp_path, text, key):
    config_file = tmp_path / "verl.yaml"
    config_file.write_text(text)
    with pytest.raises(ConfigError, match=rf"^unknown key {key} \(from verl.yaml\); Hydra's defaults list and hydra: "
                                          r"section are not read here: a reinforge config is plain YAML"):
        load_config(config_file)


def test_a_whole_number_is_a_size_in_gib(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  logits_buffer_gib: 2\n")
    config = load_config(path, ["rollout.kv_cache_gib=4"])
    assert (config.rollout.kv_cache_gib, config.actor.logits_buffer_gib) == (4.0, 2.0)
    assert load_config(None, ["rollout.kv_cache_gib=auto"]).rollout.kv_cache_gib == "auto"


@pytest.mark.parametrize(("given", "kept"), [("bf16", "auto"), ("bfloat16", "auto"), ("BF16", "auto"),
                                             ("fp8_e4m3", "fp8"), ("auto", "auto"), ("fp8", "fp8")])
def test_the_kv_cache_dtype_takes_the_names_of_its_values(given, kept):
    """bf16 names the default cache (the model's dtype, bfloat16) and fp8_e4m3 is vLLM's name of fp8."""
    assert load_config(None, [f"rollout.kv_cache_dtype={given}"]).rollout.kv_cache_dtype == kept


def test_a_bf16_kv_cache_for_a_model_run_in_another_dtype_or_an_unknown_cache_type_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_dtype=bf16 with model.dtype=float32: .* set "
                                          r"rollout.kv_cache_dtype=auto, or model.dtype=bfloat16"):
        load_config(None, ["rollout.kv_cache_dtype=bf16", "model.dtype=float32"])
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_dtype=bf16 with model.dtype=auto on trainer.device=cpu "
                                          r"\(float32\): "):
        load_config(None, ["rollout.kv_cache_dtype=bf16", "trainer.device=cpu"])
    assert load_config(None, ["rollout.kv_cache_dtype=bf16", "trainer.device=cpu", "model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_dtype='int8' is not one of auto, fp8, bf16"):
        load_config(None, ["rollout.kv_cache_dtype=int8"])
