"""Translating verl command lines: verl's own GSM8K GRPO, DAPO and LoRA examples load and validate."""

import re
from pathlib import Path

import pytest
import yaml

from reinforge.cli import main
from reinforge.config import ConfigError, load_config
from reinforge.config.verl.translate import parse_verl_overrides, translate_verl
from reinforge.trainer.preflight import check_config

# verl's examples/grpo_trainer/run_qwen2-7b.sh (the GSM8K GRPO example), its overrides as the shell passes them.
VERL_GSM8K_GRPO = [
    "python3", "-m", "verl.trainer.main_ppo",
    "algorithm.adv_estimator=grpo",
    "data.train_files=/home/user/data/gsm8k/train.parquet",
    "data.val_files=/home/user/data/gsm8k/test.parquet",
    "data.train_batch_size=1024",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    'trainer.logger=["console","wandb"]',
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]

# The keys of verl's examples/grpo_trainer/run_qwen2-7b_seq_balance.sh that differ from the one above.
VERL_GSM8K_GRPO_SEQ_BALANCE = [
    "data.return_raw_chat=True",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000",
    "actor_rollout_ref.rollout.mode=async",
    "actor_rollout_ref.rollout.multi_turn.format=hermes",
    "trainer.val_before_train=False",
]

def test_verl_gsm8k_grpo_example_translates_loads_and_validates(capsys):
    translation = translate_verl(VERL_GSM8K_GRPO)
    config = load_config(None, tree=translation.tree)
    check_config(config)
    assert config.algorithm.adv_estimator == "grpo"
    assert config.data.train_files == ["/home/user/data/gsm8k/train.parquet"]
    assert config.data.val_files == ["/home/user/data/gsm8k/test.parquet"]
    assert (config.data.train_batch_size, config.data.max_response_length) == (1024, 1024)
    assert config.model.path == "Qwen/Qwen2-7B-Instruct" and config.model.gradient_checkpointing
    assert config.actor.optim.lr == pytest.approx(1e-6)
    assert config.actor.mini_batch_size == 256
    assert config.actor.use_kl_loss and config.actor.kl_loss_coef == pytest.approx(0.001)
    # verl's default (false) is left to our memory planner (auto); an explicit true is kept
    assert config.actor.param_offload == "auto" and config.ref.param_offload is True
    assert (config.rollout.name, config.rollout.n, config.rollout.gpu_memory_utilization) == ("native", 5, 0.6)
    assert config.trainer.loggers == ["console", "wandb", "jsonl", "plots"]
    assert (config.trainer.devices_per_node, config.trainer.backend) == (8, "ray")
    assert (config.trainer.save_every, config.trainer.test_every, config.trainer.total_epochs) == (20, 5, 15)
    assert config.trainer.project_name == "verl_grpo_example_gsm8k"

    report = translation.report()
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=256  ->  actor.mini_batch_size=256" in report
    for dropped in ("ppo_micro_batch_size_per_gpu=40: micro-batches are formed from the token budget "
                    "actor.max_tokens_per_micro_batch",
                    "tensor_model_parallel_size=2: reinforge shards every model with FSDP2",
                    "use_remove_padding=true: reinforge's passes are always padding-free"):
        assert dropped in report
    reported = {line.verl_key for line in translation.translated + translation.already_ours
                + translation.no_equivalent}
    assert reported >= {word.split("=")[0] for word in VERL_GSM8K_GRPO if "=" in word}


def test_dynamic_batch_size_becomes_the_token_budget():
    translation = translate_verl(VERL_GSM8K_GRPO + VERL_GSM8K_GRPO_SEQ_BALANCE)
    config = load_config(None, tree=translation.tree)
    assert config.actor.max_tokens_per_micro_batch == 24000
    assert config.trainer.val_before_train is False
    reasons = {line.verl_key: line.reason for line in translation.no_equivalent}
    assert "actor.max_tokens_per_micro_batch" in reasons["actor_rollout_ref.actor.use_dynamic_bsz"]
    assert "vLLM/SGLang" in reasons["actor_rollout_ref.rollout.mode"]
    assert config.rollout.multi_turn.format == "hermes"


@pytest.mark.parametrize("word, files", [
    ("data.train_files=/x.parquet", ["/x.parquet"]),
    ("data.train_files=[/a.parquet,/b.parquet]", ["/a.parquet", "/b.parquet"]),
    ("data.train_files=['/a.parquet', '/b.parquet']", ["/a.parquet", "/b.parquet"]),
    ("+data.train_files=~/x.parquet", [str(Path.home() / "x.parquet")]),
])
def test_train_files_in_verl_string_and_list_forms(word, files):
    assert translate_verl([word]).tree["data"]["train_files"] == files


def test_verl_defaults_that_change_the_run_are_carried_over():
    """A command that leaves out adv_estimator, rollout.n, ... runs what verl runs: GAE, one sample, 1024 prompts."""
    config = load_config(None, tree=translate_verl(["actor_rollout_ref.model.path=m"]).tree)
    assert config.algorithm.adv_estimator == "gae" and config.rollout.n == 1
    assert (config.data.train_batch_size, config.actor.mini_batch_size, config.trainer.total_epochs) == (1024, 256, 30)
    assert config.data.filter_overlong_prompts is False


def test_verls_checkpoint_folder_and_run_names_become_the_run_folder():
    named = translate_verl(["trainer.project_name=gsm8k_grpo", "trainer.experiment_name=qwen_7b"]).tree["trainer"]
    assert named["output_dir"] == "checkpoints/gsm8k_grpo/qwen_7b"
    assert (named["project_name"], named["experiment_name"]) == ("gsm8k_grpo", "qwen_7b")
    given = translate_verl(["trainer.experiment_name=b", "trainer.default_local_dir=/ckpt/${trainer.experiment_name}/x"])
    assert given.tree["trainer"]["output_dir"] == "/ckpt/b/x"
    assert "the run folder" in given.report()


def test_values_converted():
    translation = translate_verl([
        "custom_reward_function.path=/r/score.py", "+custom_reward_function.reward_kwargs.mode=flexible",
        "trainer.save_freq=-1", "data.train_max_samples=100", "data.val_max_samples=-1",
        "trainer.resume_mode=disable", "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "trainer.logger=tensorboard",
        "algorithm.norm_adv_by_std_in_grpo=False", "critic.model.path=/c", "trainer.critic_warmup=3",
    ])
    tree = translation.tree
    assert tree["reward"] == {"custom_function": "/r/score.py:compute_score", "kwargs": {"mode": "flexible"}}
    assert tree["trainer"]["resume"] == "never" and tree["trainer"]["loggers"] == ["tensorboard", "jsonl", "plots"]
    assert "save_every" not in tree["trainer"] and tree["data"]["max_train_samples"] == 100
    assert "max_val_samples" not in tree["data"] and "warmup_steps" not in tree["actor"]["optim"]
    assert tree["actor"]["optim"]["warmup_ratio"] == 0.1 and tree["algorithm"]["norm_adv_by_std"] is False
    assert tree["critic"] == {"model_path": "/c", "warmup_steps": 3}
    named = translate_verl(["custom_reward_function.path=s.py", "custom_reward_function.name=my_score"]).tree
    assert named["reward"]["custom_function"] == "s.py:my_score"
    resumed = translate_verl(["trainer.resume_mode=resume_path", "trainer.resume_from_path=/run/step_5"]).tree
    assert resumed["trainer"]["resume"] == "/run/step_5"


@pytest.mark.parametrize(("estimator", "ours"), [("grpo_vectorized", "grpo"), ("rloo_vectorized", "rloo")])
def test_verls_vectorized_estimators_are_the_estimators_they_compute(estimator, ours):
    translation = translate_verl([f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=4"])
    assert translation.tree.get("algorithm", {}).get("adv_estimator", "grpo") == ours  # grpo: our default
    assert f"verl's {estimator} computes {ours}'s advantages" in translation.report()


def test_values_without_equivalent_are_reported_not_translated():
    translation = translate_verl(["actor_rollout_ref.actor.optim.lr_scheduler_type=wsd", "data.truncation=middle",
                                  "actor_rollout_ref.actor.strategy=fsdp2", "trainer.logger=[console,swanlab]"])
    assert translation.tree == {"data": {"train_batch_size": 1024, "max_response_length": 512,
                                         "filter_overlong_prompts": False},
                                "model": {"gradient_checkpointing": True},
                                "actor": {"mini_batch_size": 256, "router_aux_loss_coef": 0.0,
                                          "freeze_vision_tower": False},
                                "trainer": {"total_epochs": 30, "project_name": "verl_examples", "experiment_name": "gsm8k",
                                            "output_dir": "checkpoints/verl_examples/gsm8k"},
                                "algorithm": {"adv_estimator": "gae"}, "rollout": {"n": 1}}
    reasons = {line.verl_key: line.reason for line in translation.no_equivalent}
    assert "the 'wsd' schedule is not here" in reasons["actor_rollout_ref.actor.optim.lr_scheduler_type"]
    assert "truncation 'middle' is not here" in reasons["data.truncation"]
    assert "cannot log to swanlab" in reasons["trainer.logger"]
    assert [line.verl_key for line in translation.already_ours] == ["actor_rollout_ref.actor.strategy"]


def test_dr_grpos_loss_scale_factor_translates_and_a_non_positive_one_is_refused():
    translation = translate_verl(["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                                  "actor_rollout_ref.actor.loss_scale_factor=4096", "critic.loss_scale_factor=2048"])
    assert translation.tree["actor"]["loss_scale_factor"] == 4096
    assert translation.tree["critic"]["loss_scale_factor"] == 2048
    with pytest.raises(ConfigError, match=r"^actor.loss_scale_factor=0.0 must be a positive number"):
        load_config(None, ["actor.loss_scale_factor=0"])
    with pytest.raises(ConfigError, match=r"^critic.loss_scale_factor=-1.0 .*\(null: actor.loss_scale_factor\)"):
        load_config(None, ["critic.loss_scale_factor=-1"])


def test_unknown_and_conflicting_verl_keys_fail_in_one_line():
    with pytest.raises(ConfigError, match=r"^data.train_filez \(verl command line\) is not a verl key reinforge "
                                          r"knows; did you mean data.train_files\?$"):
        translate_verl(["data.train_filez=/x"])
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.optim.clip_grad=0.5 and "
                                          r"actor_rollout_ref.actor.grad_clip \(verl command line\) both set "
                                          r"actor.grad_clip, to 0.5 and 2.0; keep one of them"):
        translate_verl(["actor_rollout_ref.actor.grad_clip=2.0", "actor_rollout_ref.actor.optim.clip_grad=0.5"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        parse_verl_overrides(["data.train_files"])


def test_verl_0_9_1_reward_section_and_lora_translate():
    translation = translate_verl(["reward.custom_reward_function.path=/r/score.py",
                                  "reward.custom_reward_function.name=my_score", "reward.num_workers=2",
                                  "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16",
                                  "reward._target_=verl.workers.config.RewardConfig"])
    assert translation.tree["reward"] == {"custom_function": "/r/score.py:my_score", "num_workers": 2}
    assert translation.tree["model"]["lora"] == {"rank": 8, "alpha": 16}


def test_loss_mode_bypass_mode_is_algorithm_rollout_correction_bypass_mode():
    translation = translate_verl(["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
                                  "algorithm.rollout_correction.bypass_mode=true"])
    assert translation.tree["algorithm"]["rollout_correction"] == {"bypass_mode": True}
    assert "policy_loss" not in translation.tree.get("actor", {})
    alone = translate_verl(["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"])
    assert "bypass_mode=true" in alone.no_equivalent[0].reason


def test_custom_reward_function_name_reports_the_joined_function():
    translation = translate_verl(["custom_reward_function.path=/r/s.py", "custom_reward_function.name=foo"])
    lines = {line.verl_key: line for line in translation.translated}
    assert lines["custom_reward_function.name"].our_value == "/r/s.py:foo"
    assert translation.tree["reward"] == {"custom_function": "/r/s.py:foo"}


def test_verl_megatron_script_forms_translate():
    """Hydra's --config-path/--config-name, Megatron keys and a stray shell `\\ ` (a lone space word)."""
    translation = translate_verl(["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", " ",
                                  "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                                  "actor_rollout_ref.actor.megatron.param_offload=True",
                                  "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"])
    assert translation.tree["actor"]["param_offload"] is True
    reasons = {line.verl_key: line.reason for line in translation.no_equivalent}
    assert "Megatron" in reasons["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"]
    with pytest.raises(ConfigError, match=r"--config-name=my_trainer \(verl command line\) picks a config"):
        parse_verl_overrides(["--config-name", "my_trainer"])


def test_config_from_verl_command_writes_yaml_that_trains_as_translated(tmp_path, capsys):
    out = tmp_path / "run.yaml"
    assert main(["config", "from-verl", *VERL_GSM8K_GRPO, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "actor_rollout_ref.rollout.n=5  ->  rollout.n=5" in err and f"wrote {out}" in err
    assert load_config(out) == load_config(None, tree=translate_verl(VERL_GSM8K_GRPO).tree)
    assert yaml.safe_load(out.read_text())["rollout"] == {"name": "native", "gpu_memory_utilization": 0.6, "n": 5}
    # -o naming a folder, or a file below a file: one line each (they were "[Errno 21] Is a directory: ...")
    assert main(["config", "from-verl", *VERL_GSM8K_GRPO, "-o", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: -o {tmp_path} (command line) is a folder; name the YAML file to "
                                               f"write, e.g. -o {tmp_path / 'run.yaml'}")
    assert main(["config", "from-verl", *VERL_GSM8K_GRPO, "-o", str(out / "x.yaml")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"error: -o {out / 'x.yaml'} (command line) cannot be written: "
                                                    f"{out} is a file; choose another file")


def test_train_from_verl_applies_our_overrides_after_double_dash(capsys):
    # No model.path: training stops before loading anything, after the translation printed its mapping.
    assert main(["train", "--from-verl", "data.train_files=/x.parquet", "actor_rollout_ref.rollout.n=4", "--",
                 "rollout.n=6"]) == 2
    err = capsys.readouterr().err
    assert "actor_rollout_ref.rollout.n=4  ->  rollout.n=4" in err and "error: model.path is not set" in err
    assert main(["train", "--from-verl", "actor_rollout_ref.rollout.nn=4"]) == 2
    assert "did you mean actor_rollout_ref.rollout.n?" in capsys.readouterr().err


@pytest.mark.parametrize("command, words, source", [
    ("config", ["algorithm.adv_estimator=grpo"], "verl's default; the command leaves it out"),
    ("train", ["algorithm.adv_estimator=grpo"], "verl's default; the command leaves it out"),
    ("config", ["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"], "verl command line"),
])
def test_one_sample_a_prompt_of_a_group_estimator_is_refused_in_verls_terms(command, words, source, capsys):
    argv = ["config", "from-verl"] if command == "config" else ["train", "--from-verl"]
    assert main([*argv, "data.train_files=/x.parquet", *words]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    estimator = words[0].split("=")[1]
    assert error.startswith(f"error: actor_rollout_ref.rollout.n=1 ({source}) gives algorithm.adv_estimator="
                            f"{estimator} one sample a prompt; verl runs it (each sample's score is its advantage")
    assert error.endswith("pass actor_rollout_ref.rollout.n=N with N >= 2 (verl's GRPO examples use 5)")


def test_one_sample_a_prompt_set_after_double_dash_is_reinforges_own_refusal(capsys):
    assert main(["train", "--from-verl", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "--",
                 "rollout.n=1"]) == 2
    assert "error: rollout.n=1 is too small for algorithm.adv_estimator=grpo" in capsys.readouterr().err


# verl's examples/gmpo_trainer/test_dapo_7b_math.sh (DAPO with geo_mean), its shell variables substituted.
VERL_DAPO_GEO_MEAN = [
    "data.train_files=/verl/data/dapo-math-17k.parquet", "data.val_files=/verl/data/aime-2024.parquet",
    "data.prompt_key=prompt", "data.truncation=left", "data.max_prompt_length=2048", "data.max_response_length=8192",
    "data.train_batch_size=512", "actor_rollout_ref.rollout.n=16", "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.kl_coef=0.0", "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.kl_loss_coef=0.0", "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean",
    "actor_rollout_ref.actor.clip_ratio_low=0.4", "actor_rollout_ref.actor.clip_ratio_high=0.4",
    "actor_rollout_ref.model.use_remove_padding=True",
    "+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
    "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30720",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30720", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.model.path=/verl/models/Qwen2.5-Math-7B",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=10", "actor_rollout_ref.actor.optim.weight_decay=0.1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.grad_clip=1.0", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4", "actor_rollout_ref.rollout.gpu_memory_utilization=0.80",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "actor_rollout_ref.rollout.enable_chunked_prefill=True",
    "actor_rollout_ref.rollout.max_num_batched_tokens=10240", "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.rollout.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
    "actor_rollout_ref.rollout.val_kwargs.top_k=-1", "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
    "actor_rollout_ref.rollout.val_kwargs.n=1", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4", "actor_rollout_ref.actor.fsdp_config.fsdp_size=32",
    "actor_rollout_ref.actor.checkpoint.save_contents=['model', 'optimizer', 'extra']",
    "reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False", "+reward_model.reward_kwargs.max_resp_len=8192",
    'trainer.logger=["console","wandb"]', "trainer.project_name=DAPO", "trainer.experiment_name=DAPO-Qwen2.5-7b-MATH",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=8", "trainer.val_before_train=True", "trainer.test_freq=10",
]


def test_verl_dapo_example_with_overlong_buffer_translates():
    translation = translate_verl(VERL_DAPO_GEO_MEAN)
    config = load_config(None, tree=translation.tree)
    check_config(config)
    assert config.reward.overlong_buffer.enable and config.reward.overlong_buffer.len == 4096
    assert config.actor.policy_loss.loss_mode == "geo_mean" and config.actor.policy_loss.clip_ratio_high == 0.4
    assert (config.actor.param_offload, config.actor.optimizer_offload, config.ref.param_offload) == (True, True, True)
    # verl spreads a micro-batch of ppo_max_token_len_per_gpu x ulysses_sequence_parallel_size (4) tokens over 4 GPUs
    assert config.ref.max_tokens_per_micro_batch == 4 * 30720 and config.actor.max_tokens_per_micro_batch == 4 * 20480
    assert (config.trainer.nnodes, config.trainer.devices_per_node, config.trainer.backend) == (8, 8, "ray")
    # verl's 10 warmup steps are training steps of 512 / 32 mini-batches: 160 optimizer steps here
    assert config.data.truncation == "left" and config.actor.optim.warmup_steps == 160
    reasons = {line.verl_key: line.reason for line in translation.no_equivalent}
    assert "rotary embeddings" in reasons["actor_rollout_ref.model.override_config.max_position_embeddings"]
    translated = {line.verl_key: line.our_key for line in translation.translated}
    assert translated["reward_model.reward_kwargs.max_resp_len"] == "data.max_response_length"


def test_verl_lora_example_translates():
    """verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh, its LoRA keys."""
    tree = translate_verl(["actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_alpha=32",
                           "actor_rollout_ref.rollout.load_format=safetensors",
                           "actor_rollout_ref.rollout.layered_summon=True"]).tree
    assert tree["model"]["lora"] == {"rank": 64, "alpha": 32}
    assert translate_verl(["actor_rollout_ref.model.lora_rank=8"]).tree["model"]["lora"] == {"rank": 8, "alpha": 16.0}
    assert "lora" not in translate_verl(["actor_rollout_ref.model.target_modules=all-linear"]).tree.get("model", {})


def test_dapo_recipe_overlong_buffer_keys_translate():
    """verl's DAPO recipe (tests/special_e2e/run_dapo.sh) sets reward_model.overlong_buffer.*; they are not a reward
    model's keys. The recipe's penalty_factor is 0 when the command leaves it out."""
    translation = translate_verl(["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=128",
                                  "reward_model.overlong_buffer.penalty_factor=0.5",
                                  "reward_model.overlong_buffer.log=False"])
    assert translation.tree["reward"] == {"overlong_buffer": {"enable": True, "len": 128, "penalty_factor": 0.5}}
    assert [line.verl_key for line in translation.already_ours] == ["reward_model.overlong_buffer.log"]
    assert translation.no_equivalent == []
    unset = translate_verl(["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=128"])
    assert unset.tree["reward"]["overlong_buffer"]["penalty_factor"] == 0.0


def test_filter_groups_without_max_num_gen_batches_has_no_limit_as_in_verl():
    tree = translate_verl(["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"]).tree
    assert load_config(None, tree=tree).algorithm.filter_groups.max_num_gen_batches == 0
    given = translate_verl(["algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=10"])
    assert load_config(None, tree=given.tree).algorithm.filter_groups.max_num_gen_batches == 10
    assert "filter_groups" not in translate_verl(["data.gen_batch_size=8"]).tree["algorithm"]


def test_clip_ratio_alone_keeps_verls_clip_ratio_low_and_high():
    """verl's actor.yaml sets clip_ratio_low/high to 0.2 and they win over clip_ratio: clip_ratio=0.3 alone clips
    at 0.2 there, so it must here too."""
    config = load_config(None, tree=translate_verl(["actor_rollout_ref.actor.clip_ratio=0.3"]).tree)
    assert (config.actor.policy_loss.clip_ratio_low, config.actor.policy_loss.clip_ratio_high) == (0.2, 0.2)
    config = load_config(None, tree=translate_verl(["actor_rollout_ref.actor.clip_ratio=0.3",
                                                    "actor_rollout_ref.actor.clip_ratio_high=0.28"]).tree)
    assert (config.actor.policy_loss.clip_ratio_low, config.actor.policy_loss.clip_ratio_high) == (0.2, 0.28)


@pytest.mark.parametrize("word, value", [
    ("trainer.experiment_name='1e-3'", "1e-3"),  # quoted: a string, as in Hydra
    ("trainer.experiment_name=on", "on"), ("trainer.experiment_name=yes", "yes"),  # YAML 1.1 bools
    ("trainer.experiment_name=12:30", "12:30"),  # YAML 1.1 sexagesimal 750
    ("trainer.experiment_name=2024-01-01", "2024-01-01"),  # YAML date
    ("actor_rollout_ref.rollout.n=010", "010"),  # YAML 1.1 octal 8; Hydra has no octal (OmegaConf's int() is 10)
    ("actor_rollout_ref.actor.optim.lr=1e-6", 1e-6), ("actor_rollout_ref.actor.optim.lr=3E5", 3e5),
    ("actor_rollout_ref.rollout.n=1_000", 1000), ("algorithm.filter_groups.enable=TRUE", True),
    ("trainer.total_training_steps=NULL", None), ("actor_rollout_ref.actor.optim.betas=[0.9,1e-1]", [0.9, 0.1]),
])
def test_values_are_read_with_hydras_grammar_not_yaml_1_1(word, value):
    assert parse_verl_overrides([word])[word.split("=")[0]] == value


def test_a_hydra_dict_needs_no_space_after_its_keys_colons():
    given = parse_verl_overrides(["+custom_reward_function.reward_kwargs={max_resp_len:512,tags:[a,b],url:'http://x:80'}",
                                  "data.apply_chat_template_kwargs={enable_thinking:False}"])
    assert given == {"custom_reward_function.reward_kwargs.max_resp_len": 512,
                     "custom_reward_function.reward_kwargs.tags": ["a", "b"],
                     "custom_reward_function.reward_kwargs.url": "http://x:80",
                     "data.apply_chat_template_kwargs.enable_thinking": False}
    assert parse_verl_overrides(["data.max_response_length=${oc.env:MAXLEN,512}", "trainer.experiment_name='a,b'"]) == {
        "data.max_response_length": "${oc.env:MAXLEN,512}", "trainer.experiment_name": "a,b"}


def test_an_unquoted_comma_is_hydras_sweep_and_refused_as_verl_refuses_it():
    with pytest.raises(ConfigError, match=r"^trainer.logger=console,wandb \(verl command line\) is Hydra's sweep over "
                                          r"several values, .*write trainer.logger=\[console,wandb\]"):
        translate_verl(["trainer.logger=console,wandb"])


@pytest.mark.parametrize("word", ["trainer.logger=null", "data.train_files=5", "trainer.logger=[1,2]",
                                  "actor_rollout_ref.actor.optim.lr_scheduler_type=[cosine]",
                                  "actor_rollout_ref.model.target_modules=true"])
def test_a_value_of_the_wrong_kind_fails_in_one_line_naming_the_key(word):
    with pytest.raises(ConfigError, match=rf"^{word.split('=')[0]}=.* \(verl command line\) is not a value verl "
                                          r"takes for it \(.*\); check its type"):
        translate_verl([word])


@pytest.mark.parametrize("word", ["trainer.n_gpus_per_node=", "+trainer.nnodes=", "data.train_batch_size= ",
                                  "actor_rollout_ref.actor.optim.lr=", "trainer.experiment_name="])
def test_an_empty_value_of_an_unset_shell_variable_names_the_verl_word(word):
    key = word.strip().lstrip("+").removesuffix("=")
    with pytest.raises(ConfigError) as refusal:
        translate_verl(["actor_rollout_ref.rollout.n=4", word])
    assert str(refusal.value).startswith(f"{word.strip()} (verl command line) has no value, as `{key}=$VAR` gives")


def test_an_empty_value_of_a_key_without_equivalent_or_quoted_empty_is_not_refused():
    translation = translate_verl(["actor_rollout_ref.rollout.tensor_model_parallel_size=",
                                  "trainer.experiment_name=''"])
    assert translation.tree["trainer"]["experiment_name"] == ""


def test_null_device_counts_fail_in_the_config_check_not_in_the_translation():
    for word in ("trainer.nnodes=null", "trainer.n_gpus_per_node=null"):
        with pytest.raises(ConfigError, match=r"trainer\.(nnodes|devices_per_node)"):
            load_config(None, tree=translate_verl([word]).tree)


@pytest.mark.parametrize(("path", "converter"), [
    ("recipe/retool/retool.py", "reinforge data retool --src"),
    ("my_project/dataset.py", "reinforge data gsm8k --src"),
])
def test_a_custom_dataset_class_is_refused_naming_the_converter(path, converter):
    with pytest.raises(ConfigError) as raised:
        translate_verl([f"data.custom_cls.path={path}", "data.custom_cls.name=CustomRLHFDataset"])
    message = str(raised.value)
    assert message.startswith(f"data.custom_cls.path={path} (verl command line) is a dataset class")
    assert converter in message and "\n" not in message
    assert translate_verl(["data.custom_cls.path=null"]).tree.get("data", {}).get("train_files") is None


def test_a_verl_logger_whose_package_is_missing_is_left_out_with_one_warning(capsys):
    from reinforge.config import commands

    config = commands.load_from_verl([*VERL_GSM8K_GRPO, "trainer.logger=[console,wandb]"],
                                     lambda name: "wandb" if name == "wandb" else None)
    assert config.trainer.loggers == ["console", "jsonl", "plots"]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "wandb" in warnings[0] and "pip install wandb" in warnings[0]


def test_a_ray_job_submit_launch_keeps_its_double_dash_and_ours_follows_the_module():
    from reinforge.config import commands

    config = commands.load_from_verl(["ray", "job", "submit", "--address=http://127.0.0.1:8265", "--no-wait", "--",
                                      *VERL_GSM8K_GRPO, "--", "rollout.top_p=0.5"])
    assert config.rollout.top_p == 0.5 and config.rollout.n == 5


def test_config_name_of_verls_multi_turn_examples_applies_that_files_keys_first():
    given = parse_verl_overrides(["--config-path=/verl/examples/sglang_multiturn/config",
                                  "--config-name='gsm8k_multiturn_grpo'", "data.train_batch_size=8"])
    assert given["actor_rollout_ref.rollout.multi_turn.max_assistant_turns"] == 5
    assert given["data.train_batch_size"] == 8  # the command's own value wins
    tree = translate_verl(["-cn", "retool_multiturn_grpo", "data.train_batch_size=8"]).tree
    assert tree["rollout"]["multi_turn"] == {"max_assistant_turns": 5, "tool_config_path":
                                             "./config/tool_config/sandbox_fusion_tool_config.yaml"}
    assert tree["data"]["max_response_length"] == 1024
    server = parse_verl_overrides(["--config-name=gsm8k_multiturn_grpo_server"])  # SGLang in server mode: the same keys
    assert server["actor_rollout_ref.rollout.multi_turn.max_assistant_turns"] == 5


def test_an_unknown_config_name_is_refused_naming_the_keys_to_pass():
    with pytest.raises(ConfigError) as raised:
        parse_verl_overrides(["--config-name=geo3k_multiturn_grpo"])
    message = str(raised.value)
    assert message.startswith("--config-name=geo3k_multiturn_grpo (verl command line) picks a config file")
    assert "gsm8k_multiturn_grpo" in message and "actor_rollout_ref.rollout.multi_turn.enable=true" in message
    assert "\n" not in message


def test_verls_default_epochs_stay_behind_when_the_command_gives_its_steps(caplog):
    from reinforge.trainer.ineffective_settings import warn_ineffective_settings

    translation = translate_verl(["actor_rollout_ref.model.path=m", "trainer.total_training_steps=5"])
    assert "total_epochs" not in translation.tree["trainer"]
    assert "trainer.total_epochs" not in {line.verl_key for line in (*translation.translated, *translation.already_ours)}
    config = load_config(None, tree=translation.tree)
    assert config.trainer.total_steps == 5
    with caplog.at_level("WARNING"):
        warn_ineffective_settings(config)
    assert "total_epochs" not in caplog.text  # nothing the command wrote is called ineffective
    both = translate_verl(["trainer.total_training_steps=5", "trainer.total_epochs=2"])
    assert (both.tree["trainer"]["total_steps"], both.tree["trainer"]["total_epochs"]) == (5, 2)
    [steps] = [line.render() for line in both.translated if line.verl_key == "trainer.total_training_steps"]
    assert steps.endswith("(exactly this many steps, the data repeated as needed; verl stops sooner if "
                          "trainer.total_epochs run out)")  # the one way the two differ is said, not hidden


def test_a_resume_mode_verl_does_not_have_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refusal:
        translate_verl(["trainer.resume_mode=latest"])
    assert str(refusal.value) == ("trainer.resume_mode=latest (verl command line) is not one of verl's resume modes "
                                  "auto, disable, resume_path; use one of them")
    assert translate_verl(["trainer.resume_mode=disable"]).tree["trainer"]["resume"] == "never"


def test_a_mixture_of_experts_trains_without_a_router_loss_as_in_verl():
    """verl's actor never adds the routers' load-balancing loss; a model config with output_router_logits would
    make reinforge's default add its router_aux_loss_coef."""
    from transformers import MixtralConfig

    from reinforge.engine.moe import router_aux_loss_coef

    config = load_config(None, tree=translate_verl(["actor_rollout_ref.model.path=m"]).tree)
    model_config = MixtralConfig(output_router_logits=True, router_aux_loss_coef=0.02)
    assert router_aux_loss_coef(model_config, config.actor.router_aux_loss_coef) == 0.0
    overridden = load_config(None, ["actor.router_aux_loss_coef=0.01"],
                             tree=translate_verl(["actor_rollout_ref.model.path=m"]).tree)
    assert router_aux_loss_coef(model_config, overridden.actor.router_aux_loss_coef) == 0.01


_ENGINE = "+actor_rollout_ref.rollout.engine_kwargs"


@pytest.mark.parametrize("word, ours", [
    (f"{_ENGINE}.vllm.kv_cache_dtype=fp8", "fp8"), (f"{_ENGINE}.sglang.kv_cache_dtype=fp8_e4m3", "fp8"),
    (f"{_ENGINE}.trtllm.kv_cache_config.dtype=fp8", "fp8"), (f"{_ENGINE}.vllm.kv_cache_dtype=auto", None),
])
def test_an_engines_kv_cache_dtype_is_the_native_engines(word, ours):
    """verl passes kv_cache_dtype to vLLM/SGLang through engine_kwargs; reinforge's engine has the same setting."""
    translation = translate_verl([word])
    assert translation.tree.get("rollout", {}).get("kv_cache_dtype") == ours
    assert translation.no_equivalent == []
    assert load_config(None, tree=translation.tree).rollout.kv_cache_dtype == (ours or "auto")


@pytest.mark.parametrize("word, message", [
    (f"{_ENGINE}.vllm.kv_cache_dtype=fp8_e5m2", "is not a KV-cache type reinforge's engine has"),
    ("+actor_rollout_ref.model.override_config.attention_dropout=0.1", "turns every dropout of the model off"),
    ("actor_rollout_ref.model.lora_adapter_path=/ckpt/adapter", "reinforge's LoRA starts from fresh adapters"),
    ("actor_rollout_ref.model.exclude_modules=.*mlp.*", "keeps layers without LoRA adapters"),
])
def test_a_verl_setting_that_would_change_the_run_is_refused_in_one_line(word, message):
    with pytest.raises(ConfigError) as refusal:
        translate_verl([word])
    assert str(refusal.value).startswith(f"{word.lstrip('+')} (verl command line) ")
    assert message in str(refusal.value) and "\n" not in str(refusal.value)


def test_model_overrides_reinforge_already_computes_are_reported_as_ours():
    """The dropout-off, attention-kernel and router-loss overrides of verl's examples change nothing here; the one
    on the vision tower is what reinforge's frozen tower does with LoRA."""
    translation = translate_verl([
        "+actor_rollout_ref.model.override_config.attention_dropout=0.", "+actor_rollout_ref.model.override_config."
        "embd_pdrop=0.", "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "+actor_rollout_ref.model.override_config.output_router_logits=True",
        "actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.exclude_modules=.*visual.*",
        "actor_rollout_ref.rollout.calculate_log_probs=True"])
    assert translation.no_equivalent == []
    assert len(translation.already_ours) == 5
    [excluded] = [line for line in translation.translated if line.verl_key.endswith("exclude_modules")]
    assert (excluded.our_key, excluded.our_value) == ("actor.freeze_vision_tower", True)
    assert load_config(None, tree=translation.tree).actor.freeze_vision_tower is True


def test_a_vision_tower_trains_unless_the_command_freezes_it_as_in_verl():
    """verl's freeze_vision_tower is false: a vision-language command trains the tower unless it says otherwise (or
    keeps it out of LoRA with exclude_modules)."""
    assert load_config(None, tree=translate_verl(["data.image_key=images"]).tree).actor.freeze_vision_tower is False
    frozen = translate_verl(["actor_rollout_ref.actor.freeze_vision_tower=True"])
    assert load_config(None, tree=frozen.tree).actor.freeze_vision_tower is True


def test_the_dapo_recipes_reward_kwargs_on_verls_reward_section_translate():
    """The DAPO recipe's dapo_trainer.yaml keeps its overlong buffer under reward.reward_kwargs (verl 0.9's reward
    section); --config-name=dapo_trainer is that file."""
    translation = translate_verl(["--config-name=dapo_trainer", "data.max_response_length=4096",
                                  "reward.reward_manager.name=dapo", "reward.reward_kwargs.overlong_buffer_cfg.enable=True",
                                  "reward.reward_kwargs.overlong_buffer_cfg.len=512",
                                  "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                                  "reward.reward_kwargs.max_resp_len=4096"])
    assert translation.tree["reward"] == {"overlong_buffer": {"enable": True, "len": 512}}
    assert translation.tree["trainer"]["project_name"] == "verl-dapo"
    unset = translate_verl(["reward.reward_kwargs.overlong_buffer_cfg.enable=True"])
    assert unset.tree["reward"]["overlong_buffer"] == {"enable": True, "penalty_factor": 0.0}  # the recipe's default
    with pytest.raises(ConfigError, match=r"^reward.reward_kwargs.max_resp_len=2048 .*data.max_response_length=4096"):
        translate_verl(["data.max_response_length=4096", "reward.reward_kwargs.max_resp_len=2048"])


@pytest.mark.parametrize("words, actor, ref, critic", [
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], 2 * 11264, 2 * 22528, 30000),
    (["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
      "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1", "critic.ulysses_sequence_parallel_size=4"],
     2 * 11264, 22528, 4 * 30000),
    (["actor_rollout_ref.actor.megatron.context_parallel_size=2"], 2 * 11264, 2 * 22528, 30000),
])
def test_a_sequence_parallel_token_budget_is_the_micro_batch_verl_forms(words, actor, ref, critic):
    """verl's dp/megatron actors form a micro-batch of ppo_max_token_len_per_gpu x the sequence (context) parallel
    size, spread over that many devices; reinforge runs each sequence whole on one device (prompt 2048 + response
    20480 = 22528 tokens here, which an un-multiplied 11264 could not hold)."""
    translation = translate_verl(["data.max_prompt_length=2048", "data.max_response_length=20480",
                                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=11264",
                                  "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=22528",
                                  "critic.ppo_max_token_len_per_gpu=30000", *words])
    config = load_config(None, tree=translation.tree)
    check_config(config)
    assert (config.actor.max_tokens_per_micro_batch, config.ref.max_tokens_per_micro_batch,
            config.critic.max_tokens_per_micro_batch) == (actor, ref, critic)


def test_a_generation_batch_without_dynamic_sampling_is_the_prompts_a_step():
    """verl's loader hands out data.gen_batch_size prompts a step and, without filter_groups, trains on all of them
    (the DAPO recipe's scripts with enable_filter_groups=False: 48 generated for a train_batch_size of 16)."""
    words = ["data.train_batch_size=16", "data.gen_batch_size=48", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    translation = translate_verl(words)
    config = load_config(None, tree=translation.tree)
    check_config(config)
    assert (config.data.train_batch_size, config.data.gen_batch_size) == (48, None)
    [line] = [line for line in translation.translated if line.verl_key == "data.train_batch_size"]
    assert "data.gen_batch_size's" in line.render()
    filtered = load_config(None, tree=translate_verl([*words, "algorithm.filter_groups.enable=True"]).tree)
    assert (filtered.data.train_batch_size, filtered.data.gen_batch_size) == (16, 48)


def test_verls_megatron_lora_is_our_lora_with_its_defaults():
    """verl's Megatron LoRA (lora.rank ...) scales by its alpha of 32 when left out, and names its layers Megatron's
    way."""
    tree = translate_verl(["actor_rollout_ref.model.lora.rank=16", "actor_rollout_ref.model.lora.dropout=0.05",
                           "actor_rollout_ref.model.lora.target_modules=[linear_qkv,linear_fc2]",
                           "actor_rollout_ref.model.lora.type=lora"]).tree
    assert tree["model"]["lora"] == {"rank": 16, "alpha": 32.0, "dropout": 0.05,
                                     "target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"]}
    every_layer = translate_verl(["actor_rollout_ref.model.lora.rank=16", "actor_rollout_ref.model.lora.target_modules="
                                  "[linear_qkv,linear_proj,linear_fc1,linear_fc2]"]).tree
    assert every_layer["model"]["lora"] == {"rank": 16, "alpha": 32.0}
    for word in ("actor_rollout_ref.model.lora.target_modules=[linear_qkv,router]",
                 "actor_rollout_ref.model.lora.type=dora", "actor_rollout_ref.model.lora.adapter_path=/a"):
        with pytest.raises(ConfigError, match=rf"^{re.escape(word.split('=')[0])}="):
            translate_verl([word])


def test_a_model_config_override_that_changes_the_model_is_refused_naming_the_config_file():
    """override_config.sliding_window (or rope scaling) would make verl's model attend otherwise; reinforge reads the
    model's config.json, so the translation stops instead of training the model as saved."""
    for word in ("+actor_rollout_ref.model.override_config.sliding_window=null",
                 "+actor_rollout_ref.model.override_config.rope_scaling={type:linear,factor:2.0}"):
        with pytest.raises(ConfigError) as refusal:
            translate_verl([word])
        assert "config.json" in str(refusal.value) and "\n" not in str(refusal.value)
        assert str(refusal.value).startswith("actor_rollout_ref.model.override_config.")
    kept = translate_verl(["+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
                           "actor_rollout_ref.model.override_config={}"])
    assert [line.verl_key for line in kept.no_equivalent] == ["actor_rollout_ref.model.override_config."
                                                              "max_position_embeddings"]
    whole = translate_verl(["+actor_rollout_ref.model.override_config={attention_dropout: 0.0, "
                            "attn_implementation: eager}"])  # one key for the mapping: each of its keys is looked up
    assert len(whole.already_ours) == 2 and whole.no_equivalent == []


@pytest.mark.parametrize("word, ours", [
    ("+actor_rollout_ref.actor.router_aux_loss_coef=0.01", "actor.router_aux_loss_coef"),
    ("+actor_rollout_ref.rollout.kv_cache_dtype=fp8", "rollout.kv_cache_dtype"),
])
def test_one_of_our_settings_written_into_verls_section_names_ours(word, ours):
    """verl has no such key; the closest verl name (kl_loss_coef, dtype) would be another setting altogether."""
    with pytest.raises(ConfigError) as refusal:
        translate_verl([word])
    message = str(refusal.value)
    assert f"reinforge's own {ours} has this name: pass {ours}=... after --" in message
    assert "did you mean" not in message and "\n" not in message


def _refusal(words: list[str]) -> str:
    with pytest.raises(ConfigError) as refusal:
        translate_verl(words)
    assert "\n" not in str(refusal.value)
    return str(refusal.value)


@pytest.mark.parametrize("words, start, says", [
    (["actor_rollout_ref.rollout.ignore_eos=True"], "actor_rollout_ref.rollout.ignore_eos=true", "end of sequence"),
    (["model_engine=torchtitan"], "model_engine=torchtitan", "use model_engine=dp"),
    (["actor_rollout_ref.actor.optim.lr_decay_style=WSD"], "actor_rollout_ref.actor.optim.lr_decay_style=WSD",
     "constant, cosine or linear"),
    (["actor_rollout_ref.actor.optim.lr_decay_style=linear", "actor_rollout_ref.actor.optim.min_lr=1e-7"],
     "actor_rollout_ref.actor.optim.min_lr=1.0e-07", "ends at 0"),
    (["actor_rollout_ref.actor.optim.lr_start=1e-7"], "actor_rollout_ref.actor.optim.lr_start=1.0e-07", "from 0"),
    (["+data.apply_chat_template_kwargs.enable_thinking=False"], "data.apply_chat_template_kwargs.enable_thinking=false",
     "custom_chat_template"),
    (["trainer.device=npu"], "trainer.device=npu", "leave the key out or pass cuda"),
    (["actor@actor_rollout_ref.actor=mlite_actor"], "actor@actor_rollout_ref.actor=mlite_actor", "another config file"),
    (["+actor_rollout_ref.actor.policy_loss.tau_pos=1.0"], "actor_rollout_ref.actor.policy_loss.tau_pos (verl command",
     "pass actor_rollout_ref.actor.tau_pos=... instead"),
    (["actor_rollout_ref.actor.model_engine=megatron"], "actor_rollout_ref.actor.model_engine (verl command",
     "pass model_engine=... instead"),
])
def test_a_verl_setting_that_would_change_the_run_stops_naming_it_and_the_fix(words, start, says):
    message = _refusal(words)
    assert message.startswith(start) and says in message, message


def test_hydras_own_output_settings_are_reported_and_its_search_path_refused():
    translation = translate_verl(["hydra.run.dir=outputs/run", "algorithm.adv_estimator=grpo"])
    assert [line.verl_key for line in translation.no_equivalent] == ["hydra.run.dir"]
    assert "another config file" in _refusal(["hydra.searchpath=[pkg://verl_mlite.config]"])


def test_verls_megatron_and_veomni_schedules_become_ours():
    """Megatron's engine decays by lr_decay_style to min_lr; VeOmni's by lr_scheduler_type, cosine unless given."""
    megatron = load_config(None, tree=translate_verl([
        "model_engine=megatron", "actor_rollout_ref.actor.optim.lr=2e-6",
        "actor_rollout_ref.actor.optim.lr_decay_style=cosine", "actor_rollout_ref.actor.optim.min_lr=2e-7"]).tree)
    assert megatron.actor.optim.schedule == "cosine" and megatron.actor.optim.min_lr_ratio == pytest.approx(0.1)
    constant = translate_verl(["model_engine=megatron", "actor_rollout_ref.actor.optim.min_lr=1e-6"]).tree
    assert "optim" not in constant.get("actor", {})  # a constant schedule never reaches min_lr
    veomni = load_config(None, tree=translate_verl([
        "model_engine=veomni", "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr_min=1e-7"]).tree)
    assert veomni.actor.optim.schedule == "cosine" and veomni.actor.optim.min_lr_ratio == pytest.approx(0.1)
    assert veomni.critic.optim.schedule == "constant"  # GRPO trains no critic
    given = translate_verl(["model_engine=veomni", "actor_rollout_ref.actor.optim.lr_scheduler_type=constant"]).tree
    assert "optim" not in given.get("actor", {})


def test_veomnis_ulysses_size_multiplies_the_per_device_token_budget():
    tree = translate_verl(["model_engine=veomni", "actor_rollout_ref.actor.veomni.ulysses_parallel_size=4",
                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192",
                           "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192"]).tree
    assert tree["actor"]["max_tokens_per_micro_batch"] == tree["ref"]["max_tokens_per_micro_batch"] == 32768


@pytest.mark.parametrize("loss_mode, ours", [("cispo", 1.0), ("vanilla", 1.0), ("geo_mean", 10)])
def test_a_lower_clip_bound_below_zero_is_one_for_a_ratio_clipped_loss(loss_mode, ours):
    """1 - clip_ratio_low <= 0 never clips a positive ratio; geo_mean clips the log-ratio, where 10 is a bound."""
    translation = translate_verl([f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
                                  "actor_rollout_ref.actor.clip_ratio_low=10"])
    assert translation.tree["actor"]["policy_loss"]["clip_ratio_low"] == ours
    check_config(load_config(None, tree=translation.tree))
