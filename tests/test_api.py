"""The Python API (reinforge.api): TRL's names and objects in, the CLI's run out."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from reinforge.api import GRPOConfig, SFTConfig, write_dataset

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SCRIPT = re.search(r"## Python API.*?```python\n(.*?)```", README, re.DOTALL).group(1)
"""The README's script, as written there: no ``if __name__ == "__main__":`` guard, reward functions of its own."""


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readme_script_trains_without_a_main_guard_and_its_reward_rises(tmp_path):
    script = tmp_path / "train_api.py"
    script.write_text(SCRIPT)
    finished = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = [row for row in read_metrics(tmp_path / "runs" / "api") if "critic/score/mean" in row]
    assert len(rows) == 8
    assert all(row["reward/errors"] == 0.0 for row in rows)
    correct = [row["rewards/correct/mean"] for row in rows]
    no_minus = [row["rewards/no_minus/mean"] for row in rows]
    scores = [row["critic/score/mean"] for row in rows]
    assert scores == pytest.approx([c + 0.5 * n for c, n in zip(correct, no_minus, strict=True)])
    assert sum(scores[-3:]) / 3 > sum(scores[:2]) / 2 + 0.15, scores


def test_import_reinforge_stays_light_and_the_api_loads_on_first_use():
    code = ("import sys, reinforge; assert 'reinforge.api' not in sys.modules; "
            "from reinforge import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer; "
            "assert 'torch' not in sys.modules, 'the API imported torch before a trainer was made'; print('ok')")
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert finished.stdout.strip() == "ok", finished.stderr


def test_grpo_config_maps_trls_names_onto_reinforges_keys():
    args = GRPOConfig(output_dir="runs/x", learning_rate=3e-6, num_generations=4, per_device_train_batch_size=8,
                      gradient_accumulation_steps=2, max_completion_length=64, beta=0.04, epsilon=0.2,
                      epsilon_high=0.28, loss_type="dr_grpo", num_iterations=2, temperature=0.9, max_steps=10,
                      save_steps=5, seed=3, reward_weights=[1, 0.5], scale_rewards="none", report_to="none",
                      overrides={"rollout.top_p": 0.9})
    assert args.to_overrides() == {
        "trainer.output_dir": "runs/x", "actor.optim.lr": 3e-6, "rollout.n": 4, "data.max_response_length": 64,
        "actor.use_kl_loss": True, "actor.kl_loss_coef": 0.04, "actor.kl_loss_type": "k3",
        "actor.policy_loss.clip_ratio": 0.2, "actor.policy_loss.clip_ratio_high": 0.28,
        "actor.loss_agg_mode": "seq-mean-token-sum-norm", "actor.ppo_epochs": 2, "rollout.temperature": 0.9,
        "trainer.total_steps": 5, "trainer.save_every": 3, "trainer.seed": 3, "data.seed": 3,  # 2 updates a step
        "reward.weights": [1.0, 0.5], "algorithm.norm_adv_by_std": False, "trainer.loggers": ["console", "plots"],
        "rollout.top_p": 0.9, "data.train_batch_size": 4,  # 8 x 2 completions a step = 4 prompts x 4
        # TRL's default of what is not given (max_steps decides the length)
        "actor.optim.weight_decay": 0.0, "actor.optim.schedule": "linear",
        "actor.policy_loss.clip_ratio_c": math.inf,  # no dual clip without TRL's delta
        "actor.router_aux_loss_coef": "declared",  # a mixture of experts' coefficient, as TRL takes it
        "trainer.val_before_train": False}  # TRL's eval_on_start=False
    # TRL divides by the group's std + 1e-4 (reinforge's own default is verl's 1e-6); read by GRPO's estimators alone
    assert GRPOConfig().to_overrides().items() >= {"algorithm.norm_adv_by_std": True,
                                                   "algorithm.grpo_epsilon": 1e-4}.items()
    assert "algorithm.grpo_epsilon" not in GRPOConfig(overrides={"algorithm.adv_estimator": "rloo"}).to_overrides()
    assert GRPOConfig(beta=0.0, max_steps=-1, report_to=None).to_overrides().items() >= {
        "actor.use_kl_loss": False, "trainer.total_steps": None, "trainer.loggers": ["console", "plots"]}.items()
    assert SFTConfig(per_device_train_batch_size=4, gradient_accumulation_steps=8, max_length=512,
                     learning_rate=1e-5).to_overrides().items() >= {
        "data.batch_size": 32, "data.max_length": 512, "data.truncation": "right", "optim.lr": 1e-5}.items()
    # as TRL's, a longer prompt is cut on the left, not dropped
    assert GRPOConfig(max_prompt_length=96).to_overrides().items() >= {
        "data.max_prompt_length": 96, "data.filter_overlong_prompts": False, "data.truncation": "left"}.items()
    # gradient_accumulation_steps alone multiplies TRL's default per_device_train_batch_size (8)
    assert GRPOConfig(gradient_accumulation_steps=4, num_generations=4).to_overrides()["data.train_batch_size"] == 8
    assert SFTConfig(gradient_accumulation_steps=4).to_overrides()["data.batch_size"] == 32
    assert SFTConfig(num_train_epochs=2.0, completion_only_loss=True,
                     assistant_only_loss=None).to_overrides()["trainer.total_epochs"] == 2


@pytest.mark.parametrize("config_class", ["GRPOConfig", "SFTConfig", "DPOConfig", "RewardConfig"])
def test_a_setting_left_out_is_trls_default_not_reinforges(config_class):
    """TRL's run where a script leaves a setting out: a GRPOConfig() of 8 completions (one prompt) a step of up to
    512 tokens for 3 epochs, no weight decay, seed 42; an SFTConfig() at 2e-5 on 8 rows a step, cut at 1024 tokens."""
    import reinforge.api as api

    args = getattr(api, config_class)()
    expected = {"trainer.total_epochs": 3, "trainer.seed": 42, "data.seed": 42, "trainer.val_before_train": False}
    if config_class == "GRPOConfig":
        expected |= {"data.max_response_length": 512, "data.train_batch_size": 1, "actor.optim.weight_decay": 0.0,
                     "actor.optim.schedule": "linear", "actor.policy_loss.clip_ratio_c": math.inf,
                     "algorithm.norm_adv_by_std": True, "algorithm.grpo_epsilon": 1e-4}  # scale_rewards="group"
        assert (args.num_train_epochs, args.max_completion_length, args.learning_rate) == (3, 512, None)
    else:
        expected |= {"data.batch_size": 8, "optim.weight_decay": 0.0, "optim.warmup_ratio": 0.0,
                     "optim.schedule": "linear",
                     "optim.lr": {"SFTConfig": 2e-5, "DPOConfig": 1e-6, "RewardConfig": 1e-4}[config_class]}
        assert args.per_device_train_batch_size == 8
    if config_class == "SFTConfig":
        expected |= {"data.max_length": 1024, "data.truncation": "right"}  # TRL's keep_start, not dropped
    # a mixture of experts' aux loss: the coefficient its config declares, as TRL takes it; TRL's RewardTrainer adds none
    expected[f"{'actor' if config_class == 'GRPOConfig' else 'trainer'}.router_aux_loss_coef"] = (
        0.0 if config_class == "RewardConfig" else "declared")
    assert args.to_overrides() == expected
    # a setting given, or a reinforge key in overrides, wins over the default
    assert getattr(api, config_class)(seed=3, overrides={"data.seed": 5}).to_overrides()["trainer.seed"] == 3
    assert getattr(api, config_class)(seed=3, overrides={"data.seed": 5}).to_overrides()["data.seed"] == 5


def test_steps_per_generation_and_num_iterations_count_optimizer_steps_as_in_trl():
    """TRL generates per_device_train_batch_size x steps_per_generation completions at once and makes an optimizer
    step of every per_device_train_batch_size x gradient_accumulation_steps, num_iterations times over; max_steps
    and save_steps count those optimizer steps."""
    args = GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4,
                      num_generations=4, num_iterations=2, max_steps=12, save_steps=4, eval_steps=8)
    mapped = args.to_overrides()
    # 32 completions = 8 prompts a generation, 16 = 4 prompts an optimizer step: 2 x 2 optimizer steps a generation
    assert (mapped["data.train_batch_size"], mapped["actor.mini_batch_size"], mapped["actor.ppo_epochs"]) == (8, 4, 2)
    assert (mapped["trainer.total_steps"], mapped["trainer.save_every"], mapped["trainer.test_every"]) == (3, 1, 2)
    assert GRPOConfig(generation_batch_size=32, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                      num_generations=4).to_overrides()["actor.mini_batch_size"] == 4
    # the default: one generation an optimizer step, whose steps reinforge counts as they are
    plain = GRPOConfig(per_device_train_batch_size=8, num_generations=4, num_iterations=1, max_steps=12).to_overrides()
    assert "actor.mini_batch_size" not in plain and plain["trainer.total_steps"] == 12
    assert GRPOConfig(num_iterations=3, max_steps=12, num_generations=8).to_overrides()["trainer.total_steps"] == 4
    with pytest.raises(ValueError, match="steps_per_generation=3 with gradient_accumulation_steps=2: reinforge's "
                                         "optimizer steps take whole prompt groups"):
        GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=3,
                   num_generations=4).to_overrides()
    with pytest.raises(ValueError, match="steps_per_generation=2 and generation_batch_size=16: set one of them"):
        GRPOConfig(steps_per_generation=2, generation_batch_size=16).to_overrides()


def test_without_delta_the_loss_has_no_dual_clip_as_trls():
    """TRL's GRPO bounds the ratio of a negative advantage only with delta (INTELLECT-2's two-sided clip, the
    dual clip); reinforge's default bound of 3 would cut the loss of a token whose ratio grew past it."""
    import torch

    from reinforge.algorithms.policy_losses import compute_policy_loss
    from reinforge.config.schema import PolicyLossConfig

    mapped = GRPOConfig().to_overrides()["actor.policy_loss.clip_ratio_c"]
    advantages = torch.tensor([[-1.0, 0.0, 1.0, -1.0]])
    log_probs = torch.tensor([[math.log(5.0), 0.3, math.log(5.0), -0.1]], requires_grad=True)
    old_log_probs = torch.zeros(1, 4)
    loss, _ = compute_policy_loss("vanilla", old_log_probs=old_log_probs, log_probs=log_probs, advantages=advantages,
                                  response_mask=torch.ones(1, 4), loss_agg_mode="token-sum",
                                  config=PolicyLossConfig(clip_ratio_c=mapped))
    loss.backward()
    ratio = log_probs.detach().exp()
    # TRL's -min(r A, clip(r, 0.8, 1.2) A) per token, summed
    expected = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).sum()
    assert float(loss.detach()) == pytest.approx(float(expected))  # 5 on the first token, not the dual clip's 3
    assert torch.isfinite(log_probs.grad).all()
    assert GRPOConfig(delta=4.0).to_overrides()["actor.policy_loss.clip_ratio_c"] == 4.0


@pytest.mark.parametrize("eval_on_start", [None, True])
def test_an_eval_dataset_is_evaluated_before_training_only_with_eval_on_start(tmp_path, tiny_model_dir, eval_on_start):
    """TRL evaluates an eval_dataset on its eval_strategy (none by default), before the first step only with
    eval_on_start=True; reinforge's runs validate before training unless trainer.val_before_train=false."""
    from reinforge import SFTTrainer

    rows = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(4)]
    settings = {} if eval_on_start is None else {"eval_on_start": eval_on_start}
    trainer = SFTTrainer(str(tiny_model_dir), SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none",
                                                        per_device_train_batch_size=4, **settings),
                         train_dataset=rows, eval_dataset=rows)
    trainer.train()
    assert [row["step"] for row in read_metrics(tmp_path) if "val/loss" in row] == [0, 1][eval_on_start is None:]
    assert GRPOConfig(eval_on_start=True).to_overrides()["trainer.val_before_train"] is True


@pytest.mark.parametrize(("settings", "evaluated"), [
    (dict(eval_strategy="no", eval_steps=1, eval_on_start=True, per_device_eval_batch_size=2), []),
    (dict(eval_strategy="steps", eval_steps=2), [2, 4, 5]),
    (dict(eval_strategy="steps", eval_steps=0.4, save_steps=0.4, save_total_limit=5), [2, 4, 5]),
    (dict(eval_strategy="epoch"), [2, 4, 5]),
])
def test_eval_strategy_decides_when_the_eval_dataset_is_evaluated(tmp_path, tiny_model_dir, caplog, settings,
                                                                  evaluated):
    """TRL's eval_strategy='no' never evaluates (whatever eval_steps says); 'steps' every eval_steps steps (a
    fraction of the run's below 1, as a save_steps below 1 is), 'epoch' at each epoch's end; reinforge evaluates at
    the end too."""
    from reinforge import SFTTrainer

    rows = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(4)]
    trainer = SFTTrainer(str(tiny_model_dir), SFTConfig(output_dir=str(tmp_path), max_steps=5, report_to="none",
                                                        per_device_train_batch_size=2, **settings),
                         train_dataset=rows, eval_dataset=rows)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert [row["step"] for row in read_metrics(tmp_path) if "val/loss" in row] == evaluated
    assert not [record for record in caplog.records if "val" in record.getMessage()]
    if "save_steps" in settings:
        assert sorted(path.name for path in (tmp_path / "checkpoints").glob("step_*")) == [
            "step_000002", "step_000004", "step_000005"]
    with pytest.raises(ValueError, match="eval_strategy='best': it is one of no, steps, epoch"):
        SFTConfig(eval_strategy="best").to_overrides()


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_an_eval_strategy_without_an_eval_dataset_is_refused_as_in_trl(tmp_path, tiny_model_dir, strategy):
    from reinforge import SFTTrainer

    rows = [{"prompt": "1+1=", "completion": "2"}]
    with pytest.raises(ValueError, match=f"eval_strategy='{strategy}' \\(SFTConfig\\) evaluates an eval_dataset, and "
                                         "SFTTrainer was given none"):
        SFTTrainer(str(tiny_model_dir), SFTConfig(output_dir=str(tmp_path), eval_strategy=strategy, report_to="none"),
                   train_dataset=rows)


def test_eval_steps_map_in_either_order_and_fall_back_to_logging_steps_as_in_trl():
    every = lambda **settings: SFTConfig(**settings).to_overrides().get("trainer.test_every")  # noqa: E731
    assert every(eval_steps=5, eval_strategy="no") is None and every(eval_strategy="no", eval_steps=5) is None
    assert every(eval_steps=5, eval_strategy="steps") == every(eval_strategy="steps", eval_steps=5) == 5
    assert every(eval_strategy="steps") == every(eval_strategy="steps", eval_steps=0) == 10  # TRL's logging_steps
    assert every(eval_strategy="steps", logging_steps=4) == 4 and every(eval_steps=7) == 7
    saves = lambda **settings: SFTConfig(**settings).to_overrides().get("trainer.save_every")  # noqa: E731
    assert saves(save_strategy="no", save_steps=5) == saves(save_steps=5, save_strategy="no") == 0
    assert saves(save_steps=5) == 5 and saves(save_steps=0.5) is None  # a fraction: set once the run's steps are known


def test_use_bias_correction_kl_is_taken_where_it_changes_nothing_and_said_where_it_would(caplog):
    """TRL 1.16 weighs the KL term by the importance ratio by default (use_bias_correction_kl=True); reinforge does
    not, which is the same run without a KL term, or with the correction turned off."""
    for settings in (dict(use_bias_correction_kl=True), dict(use_bias_correction_kl=True, beta=0.0),
                     dict(use_bias_correction_kl=False, beta=0.04)):
        with caplog.at_level("WARNING", logger="reinforge.api.settings"):
            GRPOConfig(**settings).to_overrides()
    assert not caplog.records
    with pytest.raises(ValueError, match=r"use_bias_correction_kl=True with beta=0.04: reinforge's KL loss is not "
                                         r"weighted .* set use_bias_correction_kl=False"):
        GRPOConfig(use_bias_correction_kl=True, beta=0.04).to_overrides()
    with caplog.at_level("WARNING", logger="reinforge.api.settings"):
        assert GRPOConfig(beta=0.04).to_overrides()["actor.kl_loss_coef"] == 0.04
    assert [record.getMessage()[:61] for record in caplog.records] == [
        "beta=0.04: TRL weighs each token's KL by its importance ratio"]


def test_without_a_prompt_limit_no_prompt_is_dropped_or_cut_as_in_trl(tmp_path, monkeypatch, tiny_model_dir):
    """TRL 1.16 has no max_prompt_length: every prompt is generated from whole. reinforge's default limit (512,
    longer prompts dropped) would leave the long ones out; the limit is the longest prompt's length instead."""
    import dataclasses

    import reinforge.data.rl_dataset as rl_dataset
    import reinforge.trainer.rl_trainer as rl_trainer
    from reinforge import GRPOTrainer
    from reinforge.data import RLDataset
    from reinforge.models import load_tokenizer
    from reinforge.trainer.preflight import preflight

    checked = []
    monkeypatch.setattr(rl_trainer, "RLTrainer", lambda config, **kwargs: checked.append(preflight(config, **kwargs)))
    encoded = []
    encode_prompt = rl_dataset.encode_prompt
    monkeypatch.setattr(rl_dataset, "encode_prompt", lambda *args, **kwargs: (
        encoded.append(args[1]), encode_prompt(*args, **kwargs))[1])
    rows = [{"prompt": [{"role": "user", "content": "1+1="}]}, {"prompt": [{"role": "user", "content": "7" * 700}]}]

    def data_settings(**settings):
        return GRPOTrainer(model=str(tiny_model_dir), args=GRPOConfig(output_dir=str(tmp_path), **settings),
                           reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), train_dataset=rows,
                           eval_dataset=[{"prompt": "8" * 800}]).config.data

    data = data_settings()
    assert len(encoded) == 3  # each prompt once: the limit is sized from the datasets the run then takes
    unbounded = dataclasses.replace(data, max_prompt_length=10_000)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    lengths = []
    for split, taken in (("train", checked[0].train_set), ("val", checked[0].val_set)):
        whole = [example.prompt_ids for example in RLDataset.from_config(unbounded, tokenizer, split).examples]
        assert [example.prompt_ids for example in RLDataset.from_config(data, tokenizer, split).examples] == whole
        assert [example.prompt_ids for example in taken.examples] == whole
        lengths += [len(prompt_ids) for prompt_ids in whole]
    assert data.max_prompt_length == max(lengths) > 512
    assert data_settings(max_prompt_length=96).max_prompt_length == 96  # as given, longer prompts cut on the left


def test_a_setting_set_on_the_config_after_it_is_made_counts():
    """TRL's configs are dataclasses that scripts change after making them (``args.max_steps = 10``)."""
    args = GRPOConfig(num_generations=4)
    args.max_steps, args.learning_rate = 10, 3e-6
    assert args.max_steps == 10
    assert args.to_overrides().items() >= {"trainer.total_steps": 10, "actor.optim.lr": 3e-6}.items()
    with pytest.raises(AttributeError, match="GRPOConfig has no setting 'learnig_rate'"):
        args.learnig_rate = 1e-6


def test_an_unknown_or_unfitting_setting_is_one_line():
    with pytest.raises(TypeError, match="GRPOConfig has no setting 'learnig_rate'; did you mean learning_rate?"):
        GRPOConfig(learnig_rate=1e-6)
    with pytest.raises(TypeError, match=r"^GRPOConfig has no setting 'foo'; it takes TRL's names \(the \d+ of "
                                        r"sorted\(GRPOConfig.SETTINGS\)\), and reinforge's own keys as overrides=") as refused:
        GRPOConfig(foo=1)
    assert len(str(refused.value)) < 200  # one line a person reads, not every name
    from reinforge.api.inputs import reward_functions_of

    with pytest.raises(ValueError, match=r"^reward_funcs=\[\] names no reward function; give at least one"):
        reward_functions_of([], {})  # it scored by data_source and blamed reward.custom_function
    with pytest.raises(ValueError, match=r"reward_weights='1.0': give a list of numbers, one per reward function"):
        GRPOConfig(reward_weights="1.0").to_overrides()  # it said: could not convert string to float: '.'
    with pytest.raises(AttributeError, match="has no setting 'learnig_rate'; did you mean learning_rate?"):
        GRPOConfig().learnig_rate = 1e-6
    with pytest.raises(TypeError, match=r"^GRPOConfig\(fsdp=...\): TRL's fsdp has no counterpart here, reinforge "
                                        r"places and shards the model itself .*; remove it$"):
        GRPOConfig(fsdp="full_shard")
    with pytest.raises(TypeError, match=r"^SFTConfig\(resume_from_checkpoint=...\): TRL's resume_from_checkpoint "):
        SFTConfig(resume_from_checkpoint="runs/x/checkpoint-5")
    with pytest.raises(ValueError, match="12 completions a step is not a multiple of num_generations=8"):
        GRPOConfig(per_device_train_batch_size=12, num_generations=8).to_overrides()
    with pytest.raises(ValueError, match="loss_type='sapo2'"):
        GRPOConfig(loss_type="sapo2").to_overrides()
    # TRL's None defaults: equal weights, evaluation on reinforge's cadence; others in one line naming the setting
    assert GRPOConfig(reward_weights=None, eval_steps=None).to_overrides() == GRPOConfig().to_overrides()
    with pytest.raises(ValueError, match=r"beta=None is not a value GRPOConfig can use"):
        GRPOConfig(beta=None).to_overrides()
    with pytest.raises(ValueError, match=r"save_total_limit=None: reinforge keeps the last trainer.keep_last"):
        SFTConfig(save_total_limit=None).to_overrides()
    with pytest.raises(ValueError, match=r"report_to='all': .* name the loggers"):
        GRPOConfig(report_to="all").to_overrides()
    with pytest.raises(ValueError, match=r"num_train_epochs=0.5: reinforge runs whole passes .* set max_steps"):
        GRPOConfig(num_train_epochs=0.5).to_overrides()


@pytest.mark.parametrize(("settings", "message"), [
    (dict(num_generations=1, per_device_train_batch_size=8),
     r"^num_generations=1 \(GRPOConfig\) is reinforge's rollout.n: rollout.n=1 is too small"),
    (dict(max_completion_length=None), r"^max_completion_length=None \(GRPOConfig\) is reinforge's "
                                        r"data.max_response_length: "),
    (dict(learning_rate=-1.0, overrides={"actor.optim.lr": -2.0}), r"^actor.optim.lr=-2.0 is negative"),  # ours
    (dict(per_device_train_batch_size=64, num_generations=4),
     r"^per_device_train_batch_size=64, num_generations=4 \(GRPOConfig\) is reinforge's data.train_batch_size: "
     r"data.train_batch_size=16 is larger than the 4 train prompts"),
    (dict(report_to="trackio"), r"^report_to='trackio' \(GRPOConfig\) is reinforge's trainer.loggers: trainer.loggers "
                                r"names 'trackio', which is not a tracking backend"),
])
def test_a_refusal_of_a_key_made_from_trls_settings_names_them(tmp_path, tiny_model_dir, settings, message):
    from reinforge import GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), max_completion_length=settings.pop("max_completion_length", 4),
                      **{"num_generations": 2, "per_device_train_batch_size": 2} | settings)
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(str(tiny_model_dir), lambda completions, **kwargs: [1.0] * len(completions), args,
                    train_dataset=[{"prompt": f"{a}+{a}="} for a in range(4)], trainer__device="cpu")


TRL_SCRIPT_SETTINGS = [
    # what a TRL script spells out that changes nothing in a reinforge run: taken as it is
    (dict(bf16=True, use_vllm=True, vllm_mode="server", logging_dir="logs", log_completions=True,
          remove_unused_columns=False, push_to_hub=False, gradient_checkpointing_kwargs={"use_reentrant": False},
          optim="adamw_torch", disable_dropout=True, mask_truncated_completions=False, save_strategy="steps"), {}),
    # what means the same as a reinforge key
    (dict(bf16=False), {"model.dtype": "float32"}),
    (dict(fp16=True, bf16=False), {"model.dtype": "float16"}),
    (dict(model_init_kwargs={"torch_dtype": "bfloat16", "device_map": "auto", "attn_implementation": "eager"}),
     {"model.dtype": "bfloat16", "model.attn_implementation": "eager"}),
    (dict(generation_kwargs={"top_k": 20, "max_tokens": 64, "do_sample": True}, top_k=50),  # they win, as in TRL
     {"rollout.top_k": 20, "data.max_response_length": 64}),
    (dict(min_p=0.05, shuffle_dataset=False, run_name="exp", save_strategy="no", entropy_coef=0.01),
     {"rollout.min_p": 0.05, "data.shuffle": False, "trainer.experiment_name": "exp", "trainer.save_every": 0,
      "actor.entropy_coeff": 0.01}),
    (dict(importance_sampling_level="sequence", loss_type="grpo"),
     {"actor.policy_loss.loss_mode": "gspo", "actor.loss_agg_mode": "seq-mean-token-mean"}),
    (dict(loss_type="cispo", epsilon_high=5.0),  # TRL's cap of the weight itself; no bound below
     {"actor.policy_loss.loss_mode": "cispo", "actor.loss_agg_mode": "token-mean",
      "actor.policy_loss.clip_ratio_low": 1.0, "actor.policy_loss.clip_ratio_high": 4.0}),
    (dict(loss_type="sapo", sapo_temperature_neg=1.2),
     {"actor.policy_loss.loss_mode": "sapo", "actor.loss_agg_mode": "seq-mean-token-mean",
      "actor.policy_loss.tau_neg": 1.2}),
    (dict(delta=4.0), {"actor.policy_loss.clip_ratio_c": 4.0}),
    (dict(lr_scheduler_type="constant"), {"actor.optim.schedule": "constant"}),
    (dict(warmup_steps=0.1), {"actor.optim.warmup_ratio": 0.1}),  # transformers 5: below 1, a fraction of the run
    (dict(warmup_steps=10), {"actor.optim.warmup_steps": 10}),
    (dict(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, adam_beta2=0.99,
          adam_epsilon=1e-6),
     {"actor.optim.schedule": "cosine", "actor.optim.min_lr_ratio": 0.1, "actor.optim.betas": [0.9, 0.99],
      "actor.optim.eps": 1e-6}),
]


@pytest.mark.parametrize(("settings", "expected"), TRL_SCRIPT_SETTINGS)
def test_the_settings_a_trl_script_spells_out_are_taken(settings, expected):
    mapped = GRPOConfig(**settings).to_overrides()
    default = GRPOConfig().to_overrides()
    assert {key: value for key, value in mapped.items() if default.get(key, object()) != value} == expected


@pytest.mark.parametrize("settings", [settings for settings, _ in TRL_SCRIPT_SETTINGS] + [
    dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4, num_generations=4)])
def test_the_settings_a_trl_script_spells_out_make_a_valid_run(tmp_path, monkeypatch, tiny_model_dir, settings):
    import reinforge.trainer.rl_trainer as rl_trainer
    from reinforge import GRPOTrainer

    monkeypatch.setattr(rl_trainer, "RLTrainer", lambda config, reward_functions=None, prompt_sets=None: None)
    args = GRPOConfig(**{"output_dir": str(tmp_path), "num_generations": 4, "per_device_train_batch_size": 8,
                         **settings})
    trainer = GRPOTrainer(model=str(tiny_model_dir), args=args, train_dataset=[{"prompt": "1+1="}],
                          reward_funcs=lambda completions, **kwargs: [0.0] * len(completions))
    for key, value in args.to_overrides().items():
        section, *path = key.split(".")
        node = getattr(trainer.config, section)
        for name in path:
            node = getattr(node, name)
        assert node == value, key


@pytest.mark.parametrize(("settings", "message"), [
    (dict(push_to_hub=True), "push_to_hub=True: reinforge does not upload"),
    (dict(mask_truncated_completions=True), "mask_truncated_completions=True: reinforge trains on truncated"),
    (dict(optim="adamw_8bit"), "optim='adamw_8bit': reinforge's optimizer is torch's AdamW"),
    (dict(top_entropy_quantile=0.2), "top_entropy_quantile=0.2: reinforge's loss takes every completion token"),
    (dict(generation_kwargs={"num_beams": 2}), r"generation_kwargs\['num_beams'\]=2: reinforge's engine takes"),
    (dict(model_init_kwargs={"revision": "v1"}), r"model_init_kwargs\['revision'\]: reinforge loads the model with"),
    (dict(loss_type="cispo"), "loss_type='cispo' caps the importance weight at epsilon_high=0.2, below 1"),
    (dict(lr_scheduler_type="polynomial"), "lr_scheduler_type='polynomial': reinforge's schedules are linear, "),
    (dict(lr_scheduler_kwargs={"min_lr_rate": 0.1}), "lr_scheduler_kwargs=.*: reinforge's linear schedule takes no "),
    (dict(bf16=True, fp16=True), "bf16=True and fp16=True: choose one precision"),
    (dict(save_strategy="epoch"), "save_strategy='epoch': reinforge checkpoints every save_steps steps"),
    # TRL's bonus is the mean entropy over tokens whatever the loss_type; reinforge's follows the loss's aggregation
    (dict(entropy_coef=0.01, loss_type="dr_grpo"), "entropy_coef=0.01 with loss_type='dr_grpo': TRL's entropy bonus "
                                                   r"is the mean entropy over tokens.*seq-mean-token-sum-norm"),
])
def test_a_trl_setting_reinforge_cannot_honour_is_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**settings).to_overrides()


def test_a_frame_a_dataset_and_a_list_become_parquet_the_rl_data_reads(tmp_path):
    import datasets
    import pandas as pd

    from reinforge.config.schema import DataConfig
    from reinforge.data.rl_dataset import RLDataset
    from reinforge.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()

    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2", "ground_truth": "2"},
            {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "ground_truth": "4"}]
    for name, given in (("list", rows), ("frame", pd.DataFrame(rows)), ("dataset", datasets.Dataset.from_list(rows))):
        [path] = write_dataset(given, tmp_path / name, "train")
        dataset = RLDataset(path, tokenizer, DataConfig(max_prompt_length=64))
        assert [example.raw_prompt for example in dataset] == [row["prompt"] for row in rows], name
        assert [example.columns for example in dataset] == [{"answer": "2"}, {"answer": "4"}], name
        assert [example.ground_truth for example in dataset] == ["2", "4"], name  # verl's reward_model.ground_truth
    # a column the first row lacks is kept (the others' values, None in that row)
    [path] = write_dataset([{"prompt": "1+1="}, {"prompt": "2+2=", "answer": "4", "ground_truth": "4"}], tmp_path, "some")
    examples = list(RLDataset(path, tokenizer, DataConfig(max_prompt_length=64)))
    assert [(example.columns, example.ground_truth) for example in examples] == [({"answer": None}, None),
                                                                                ({"answer": "4"}, "4")]
    assert write_dataset("data/train.parquet", tmp_path, "train") == ["data/train.parquet"]
    with pytest.raises(TypeError, match="train_dataset must be a datasets.Dataset, a pandas DataFrame"):
        write_dataset(42, tmp_path, "train")
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "1+1="}])})
    with pytest.raises(TypeError, match=r"got a DatasetDict \(a DatasetDict of splits 'train': pass one, e.g. "
                                        r"dataset\['train'\]\)$"):
        write_dataset(splits, tmp_path, "train")
    with pytest.raises(ValueError, match=r"^train_dataset cannot be stored as parquet: column 'prompt' holds values "
                                         r"of types str \(row 0\) and list \(row 1\); .* not both\)$"):
        write_dataset([{"prompt": "1+1="}, {"prompt": [{"role": "user", "content": "2+2="}]}], tmp_path / "mixed", "train")


@pytest.mark.slow
def test_a_loaded_model_and_reward_callables_train_in_this_process(tmp_path, tiny_model_dir, arithmetic_data_dir):
    import pandas as pd
    from transformers import AutoModelForCausalLM

    from reinforge import GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    frame = pd.read_parquet(arithmetic_data_dir / "train.parquet")
    calls = []

    def has_seven(completions, completion_ids, trainer_state, **kwargs):
        calls.append((len(completions), trainer_state.global_step))
        return [float("7" in completion[0]["content"]) for completion in completions]

    def not_applicable(prompts, **kwargs):
        return [None] * len(prompts)

    args = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=2, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=2, reward_weights=[2.0, 1.0], report_to="none")
    trainer = GRPOTrainer(model=model, reward_funcs=[has_seven, not_applicable], train_dataset=frame, args=args,
                          reward__num_workers=0, data__max_prompt_length=64)
    trainer.train()
    assert (tmp_path / "run" / "inputs" / "initial_model" / "config.json").is_file()
    assert (trainer.save_model() / "config.json").is_file()
    assert calls == [(8, 0), (8, 1)]  # once per step's batch, with the step
    rows = [row for row in read_metrics(tmp_path / "run") if "critic/score/mean" in row]
    assert [row["critic/score/mean"] for row in rows] == pytest.approx(
        [2.0 * row["rewards/has_seven/mean"] for row in rows])
    assert all("rewards/not_applicable/mean" not in row for row in rows)


@pytest.mark.slow
def test_sft_trainer_takes_prompt_completion_pairs(tmp_path, tiny_model_dir):
    from reinforge import SFTTrainer

    pairs = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(16)]
    trainer = SFTTrainer(model=str(tiny_model_dir), train_dataset=pairs,
                         args=SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2, per_device_train_batch_size=4,
                                        max_length=64, report_to="none"))
    trainer.train()
    rows = read_metrics(tmp_path / "sft")
    assert [row["step"] for row in rows if "train/loss" in row] == [1, 2]


def test_a_model_given_loaded_holds_the_trained_weights_after_train(tmp_path, tiny_model_dir):
    """TRL trains the object it is given; reinforge trains a saved copy and copies the result back."""
    import torch
    from transformers import AutoModelForCausalLM

    from reinforge import SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pairs = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(4)]
    def args(max_steps):
        return SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=max_steps, per_device_train_batch_size=4,
                         max_length=32, learning_rate=1e-2, report_to="none")

    trainer = SFTTrainer(model=model, train_dataset=pairs, args=args(1))
    trainer.train()
    trained = AutoModelForCausalLM.from_pretrained(trainer.save_model()).state_dict()
    assert any(not torch.equal(model.state_dict()[name], initial[name]) for name in initial)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0, msg=name)
    # TRL's save_model(args.output_dir): the model's files beside the run's own, which stays resumable
    assert trainer.save_model(str(tmp_path / "sft")) == tmp_path / "sft"
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "sft").state_dict()
    assert saved.keys() == trained.keys() and all(torch.equal(saved[name], trained[name]) for name in trained)
    # handed to the same run again, it continues it (the run's initial model, its checkpoint's weights)
    again = SFTTrainer(model=model, train_dataset=pairs, args=args(2))
    assert again.config.model.path == trainer.config.model.path == str(tmp_path / "sft" / "inputs" / "initial_model")


def test_a_tokenizer_given_beside_a_model_path_is_the_one_trained_with(tmp_path, tiny_model_dir):
    from reinforge import SFTTrainer
    from reinforge.models import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    trainer = SFTTrainer(model=str(tiny_model_dir), processing_class=tokenizer, args=SFTConfig(
        output_dir=str(tmp_path / "sft"), max_steps=1, report_to="none"), train_dataset=[{"messages": [
            {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}])
    assert trainer.config.model.tokenizer_path == str(tmp_path / "sft" / "inputs" / "tokenizer")
    assert trainer.trainer.tokenizer.chat_template == tokenizer.chat_template


SFT_ROWS = {"messages": [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}],
            "pairs": [{"prompt": "1+1=", "completion": "2"}],
            "chat pairs": [{"prompt": [{"role": "user", "content": "1+1="}],
                            "completion": [{"role": "assistant", "content": "2"}]}]}


@pytest.mark.parametrize(("rows", "settings", "loss_on"), [
    ("messages", {}, "all"),  # TRL trains every token of a conversation unless assistant_only_loss=True
    ("messages", {"assistant_only_loss": True}, "assistant"),
    ("pairs", {}, "assistant"),  # and a prompt/completion pair's completion, unless completion_only_loss=False
    ("chat pairs", {}, "assistant"),
    ("chat pairs", {"completion_only_loss": False}, "all"),
    ("pairs", {"completion_only_loss": False, "assistant_only_loss": True}, "assistant"),
    ("messages", {"overrides": {"data.loss_on": "assistant"}}, "assistant"),
])
def test_sft_trains_the_tokens_trl_trains_for_the_rows_given(tmp_path, tiny_model_dir, rows, settings, loss_on):
    from reinforge import SFTTrainer

    trainer = SFTTrainer(str(tiny_model_dir), SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none",
                                                        **settings), train_dataset=SFT_ROWS[rows])
    assert trainer.config.data.loss_on == loss_on
    [example] = trainer.trainer.train_loader.rows
    assert (sum(example.loss_mask) == len(example.input_ids) - 1) == (loss_on == "all")  # all but the first


def test_dpo_trainer_takes_trls_ref_model(tmp_path, tiny_model_dir):
    import math

    from transformers import AutoModelForCausalLM

    from reinforge import DPOConfig, DPOTrainer
    from reinforge.models import save_tiny_model

    reference = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "other", seed=1))
    pairs = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(4)]
    trainer = DPOTrainer(str(tiny_model_dir), reference, DPOConfig(  # TRL's order: model, ref_model, args
        output_dir=str(tmp_path / "dpo"), max_steps=1, per_device_train_batch_size=4, max_length=32, report_to="none"),
        train_dataset=pairs)
    assert trainer.config.dpo.reference_path == str(tmp_path / "dpo" / "inputs" / "reference_model")
    loss = trainer.train()["train/loss"]
    assert loss != pytest.approx(math.log(2), abs=1e-4)  # the policy is not its own reference: the margins start apart


def test_dpo_and_reward_configs_take_trls_names_for_what_they_do_and_refuse_the_rest_in_one_line():
    from reinforge import DPOConfig, RewardConfig

    taken = DPOConfig(loss_type=["ipo"], precompute_ref_log_probs=True, disable_dropout=True, dataset_num_proc=8,
                      padding_free=True, pad_to_multiple_of=8, ref_model_sync_steps=512).to_overrides()
    assert taken["dpo.loss_type"] == "ipo"  # TRL's list of one loss
    assert RewardConfig(dataset_num_proc=4, activation_offloading=False).to_overrides() == RewardConfig().to_overrides()
    assert "rm.center_rewards_coefficient" in RewardConfig(disable_dropout=True,
                                                           center_rewards_coefficient=0.01).to_overrides()
    for settings, message in ((dict(loss_type=["sigmoid", "sft"]), "loss_type=['sigmoid', 'sft']: reinforge dpo "
                               "trains one loss, not a weighted mix; give one of sigmoid, ipo, hinge, robust"),
                              (dict(disable_dropout=False), "disable_dropout=False: reinforge rm and dpo always switch "
                               "a checkpoint's dropout off; remove it"),
                              (dict(reference_free=True), "reference_free=True: reinforge dpo always compares the "
                               "policy with a reference (ref_model, or the model's starting weights); remove it"),
                              (dict(truncation_mode="keep_end"), "truncation_mode='keep_end': reinforge dpo drops a "
                               "pair longer than max_length (counted in the log) rather than cutting it; remove it"),
                              (dict(max_length=None), "max_length=None: reinforge needs a limit on a pair's tokens "
                               "to size its micro-batches (a longer pair is dropped, counted in the log); give one "
                               "above your longest pair (TRL's default is 1024)")):
        with pytest.raises(ValueError) as error:
            DPOConfig(**settings).to_overrides()
        assert str(error.value) == message


def test_sft_config_takes_trls_sft_settings_for_what_they_do_and_refuses_the_rest_in_one_line(tmp_path, tiny_model_dir):
    """TRL's SFTConfig names of the rows and their loss: a script spelling out TRL's defaults runs unchanged."""
    from reinforge import DPOConfig

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    defaults = dict(dataset_text_field="text", dataset_kwargs={"skip_prepare_dataset": False}, dataset_num_proc=4,
                    eos_token=None, truncation_mode="keep_start", shuffle_dataset=True, packing_strategy="bfd",
                    padding_free=True, pad_to_multiple_of=None, eval_packing=False, loss_type="nll",
                    activation_offloading=False, pad_token=None, router_aux_loss_coef=None, chat_template_path=None)
    assert SFTConfig(**defaults).to_overrides() == SFTConfig().to_overrides() | {"data.text_key": "text"}
    assert SFTConfig(dataset_text_field="content", chat_template_path=str(template)).to_overrides().items() >= {
        "data.text_key": "content", "data.chat_template": template.read_text()}.items()
    assert (SFTConfig(chat_template_path=str(tiny_model_dir)).to_overrides()["data.chat_template"]
            == (tiny_model_dir / "chat_template.jinja").read_text())
    assert SFTConfig(router_aux_loss_coef=0.01).to_overrides()["trainer.router_aux_loss_coef"] == 0.01
    for settings, message in ((dict(max_length=None), "max_length=None: reinforge needs a limit on a row's tokens to "
                               "size its micro-batches (a longer row is cut at its end); give one above your longest "
                               "row (TRL's default is 1024)"),
                              (dict(packing_strategy="wrapped"), "packing_strategy='wrapped': reinforge packs each row "
                               "whole into rows of up to max_length tokens, as TRL's bfd (in the rows' order, not "
                               "best-fit), and cuts the end of a longer one; remove it"),
                              (dict(dataset_kwargs={"skip_prepare_dataset": True}), "dataset_kwargs={'skip_prepare_"
                               "dataset': True}: reinforge tokenizes the rows itself (messages, prompt/completion or "
                               "text); remove it and give the rows untokenized"),
                              (dict(loss_type="dft"), "loss_type='dft': reinforge trains the mean negative "
                               "log-likelihood of the trained tokens (nll); remove it"),
                              (dict(chat_template_path=str(tmp_path / "none")), f"chat_template_path="
                               f"'{tmp_path / 'none'}' does not exist; give a Jinja file or a tokenizer folder")):
        with pytest.raises(ValueError) as error:
            SFTConfig(**settings).to_overrides()
        assert str(error.value) == message
    with pytest.raises(TypeError, match="DPOConfig has no setting 'dataset_text_field'"):
        DPOConfig(dataset_text_field="text")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dpo", "reward"])
def test_dpo_and_reward_trainers_take_preference_rows(tmp_path, tiny_model_dir, kind):
    from reinforge import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    pairs = [{"prompt": [{"role": "user", "content": f"{a}+{a}?"}], "chosen": [{"role": "assistant", "content": str(2 * a)}],
              "rejected": [{"role": "assistant", "content": str(2 * a + 1)}]} for a in range(8)]
    trainer_class, config_class = (DPOTrainer, DPOConfig) if kind == "dpo" else (RewardTrainer, RewardConfig)
    extra = {"beta": 0.2} if kind == "dpo" else {"center_rewards_coefficient": 0.01}
    trainer = trainer_class(model=str(tiny_model_dir), train_dataset=pairs,
                            args=config_class(output_dir=str(tmp_path / kind), max_steps=2, per_device_train_batch_size=4,
                                              max_length=64, report_to="none", **extra))
    assert (trainer.config.dpo.beta == 0.2) if kind == "dpo" else (trainer.config.rm.center_rewards_coefficient == 0.01)
    trainer.train()
    assert [row["step"] for row in read_metrics(tmp_path / kind) if "train/loss" in row] == [1, 2]


def test_a_reinforge_config_and_keyword_overrides_reach_the_rl_trainer(tmp_path, monkeypatch, tiny_model_dir):
    import reinforge.trainer.rl_trainer as rl_trainer
    from reinforge import GRPOTrainer
    from reinforge.config import load_config

    made = {}

    class Recorded:
        def __init__(self, config, reward_functions=None, prompt_sets=None):
            made.update(config=config, reward_functions=reward_functions)

    monkeypatch.setattr(rl_trainer, "RLTrainer", Recorded)

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    base = load_config(None, ["rollout.n=4", f"trainer.output_dir={tmp_path / 'run'}"])
    GRPOTrainer(model="some/model", reward_funcs=reward, args=base, train_dataset=[{"prompt": "1+1=", "answer": "2"}],
                eval_dataset=[{"prompt": "2+2=", "answer": "4"}], reward__num_workers=0, rollout__temperature=0.7)
    config = made["config"]
    assert (config.rollout.n, config.rollout.temperature, config.reward.num_workers) == (4, 0.7, 0)
    assert config.model.path == "some/model" and made["reward_functions"] == [reward]
    assert config.data.train_files == [str(tmp_path / "run" / "inputs" / "train.parquet")]
    assert config.data.val_files == [str(tmp_path / "run" / "inputs" / "eval.parquet")]
    with pytest.raises(Exception, match="unknown key rollout.temprature"):
        GRPOTrainer(model="m", reward_funcs=reward, args=base, rollout__temprature=0.7)

    rows = [{"prompt": "1+1=", "answer": "2"}]
    args = GRPOConfig(output_dir=str(tmp_path / "rm"), reward_weights=[0.5, 2.0])
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=["org/reward-model", reward], args=args, train_dataset=rows)
    config = made["config"]
    assert (config.reward.reward_model.enable, config.reward.reward_model.model_path) == (True, "org/reward-model")
    assert (config.reward.combine.mode, config.reward.combine.rm_weight, config.reward.weights) == ("sum", 0.5, [2.0])
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs="org/reward-model", args=GRPOConfig(output_dir=str(tmp_path / "rm")),
                train_dataset=rows)
    assert made["config"].reward.combine.mode == "replace" and made["reward_functions"] is None
    with pytest.raises(ValueError, match="GRPOTrainer has no train_dataset; pass train_dataset="):
        GRPOTrainer(model="m", reward_funcs=reward, args=GRPOConfig(output_dir=str(tmp_path / "none")))
    with pytest.raises(ValueError, match="reward_funcs names 2 reward models"):
        GRPOTrainer(model="m", reward_funcs=["a/rm", "b/rm"], train_dataset=rows)
    # a loaded reward model, as TRL takes it, is scored as one (a module is callable, but no reward function)
    from transformers import AutoModelForSequenceClassification

    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[reward, reward_model], args=GRPOConfig(output_dir=str(tmp_path / "loaded")),
                train_dataset=rows)
    assert made["reward_functions"] == [reward]
    assert made["config"].reward.reward_model.model_path == str(tmp_path / "loaded" / "inputs" / "reward_model")
    assert (tmp_path / "loaded" / "inputs" / "reward_model" / "tokenizer_config.json").is_file()


def test_a_function_set_as_reward_custom_function_is_refused_in_one_line():
    from reinforge.config.schema import RewardConfig
    from reinforge.reward.data_checks import load_reward_function

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"reward.custom_function is a function, not a path; .*"
                                         r"RLTrainer\(config, reward_functions=\[fn, ...\]\)"):
        load_reward_function(RewardConfig(custom_function=reward))


def test_a_peft_lora_config_becomes_model_lora():
    from reinforge.api import peft_settings

    lora = SimpleNamespace(r=16, lora_alpha=32, lora_dropout=0.05, target_modules={"v_proj", "q_proj"})
    assert peft_settings(lora) == {"model.lora.rank": 16, "model.lora.alpha": 32.0, "model.lora.dropout": 0.05,
                                   "model.lora.target_modules": ["q_proj", "v_proj"]}
    assert peft_settings(None) == {}


def test_peft_target_modules_all_linear_or_none_mean_what_they_mean_in_peft(tiny_model_dir):
    from peft import LoraConfig

    from reinforge.api import peft_settings
    from reinforge.models.tiny import tiny_config

    every_linear = peft_settings(LoraConfig(r=8, target_modules="all-linear"), str(tiny_model_dir))
    assert every_linear["model.lora.target_modules"] == ["all-linear"]
    # none named: peft's default for the architecture (reinforge's own default adapts every linear layer)
    assert peft_settings(LoraConfig(r=8), str(tiny_model_dir))["model.lora.target_modules"] == ["q_proj", "v_proj"]
    phi3 = SimpleNamespace(config=tiny_config("phi3"))
    with pytest.raises(ValueError, match="peft_config names no target_modules and peft has no default for a phi3"):
        peft_settings(LoraConfig(r=8), phi3)


def test_peft_settings_reinforge_does_not_apply_are_refused_in_one_line():
    from reinforge.api import peft_settings

    lora = SimpleNamespace(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=None, modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match=r"peft_config sets modules_to_save=\['lm_head'\], which reinforge's LoRA"):
        peft_settings(lora)
    from peft import LoraConfig

    for rank in (0, -4):  # model.lora.rank=0 would have trained every weight
        with pytest.raises(ValueError, match=rf"^peft_config.r={rank}: a LoRA adapter's rank is a positive number"):
            peft_settings(LoraConfig(r=rank, target_modules=["q_proj"]))
    # a MoE's experts (target_parameters) or another initialisation would be dropped without a word
    for setting, shown in ((dict(target_parameters=["mlp.experts.gate_up_proj"]), "target_parameters="),
                           (dict(init_lora_weights=False), "init_lora_weights=False")):
        with pytest.raises(ValueError, match=f"peft_config sets {shown}"):
            peft_settings(LoraConfig(r=8, target_modules=["q_proj"], **setting))


def test_a_loaded_model_with_frozen_parameters_is_refused_not_trained_whole(tmp_path, tiny_model_dir):
    """A TRL run keeps a caller's frozen parameters frozen; a saved copy would forget requires_grad."""
    from transformers import AutoModelForCausalLM

    from reinforge.api.inputs import save_model_if_loaded

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.get_input_embeddings().requires_grad_(False)
    with pytest.raises(ValueError, match=r"the model was given with 1 parameter frozen \(requires_grad=False: "):
        save_model_if_loaded(model, None, tmp_path / "model")
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"the model is a peft PeftModel.*LoraConfig as peft_config"):
        save_model_if_loaded(adapted, None, tmp_path / "model")


@pytest.mark.parametrize("given", ["nothing", "its tokenizer"])
def test_a_loaded_vision_language_model_keeps_the_processor_of_its_folder(tmp_path, given):
    """TRL loads a VLM's processor from the model's own folder when none is given; the saved copy keeps it, so the
    run reads its rows' images (given its tokenizer alone, too)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from reinforge.api.inputs import save_model_if_loaded
    from reinforge.models.tiny_vlm import save_tiny_vlm
    from reinforge.models.vision import processor_for

    source = save_tiny_vlm(tmp_path / "vlm", "qwen3_vl")
    model = AutoModelForImageTextToText.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source) if given == "its tokenizer" else None
    saved = save_model_if_loaded(model, tokenizer, tmp_path / "inputs" / "initial_model")
    assert type(processor_for(saved)).__name__ == "Qwen3VLProcessor"


def test_a_later_start_keeps_the_inputs_an_earlier_start_wrote_and_puts_other_ones_beside_them(tmp_path,
                                                                                                  tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from reinforge.api.inputs import save_model_if_loaded
    from reinforge.models import load_tokenizer

    inputs = tmp_path / "run" / "inputs"
    rows, other_rows = [{"prompt": "1+1=", "answer": "2"}], [{"prompt": "2+2=", "answer": "4"}]
    assert write_dataset(rows, inputs, "train") == [str(inputs / "train.parquet")]
    written = (inputs / "train.parquet").read_bytes()
    assert write_dataset(rows, inputs, "train") == [str(inputs / "train.parquet")]  # the same rows: the same file
    assert write_dataset(other_rows, inputs, "train") == [str(inputs / "train-2.parquet")]
    assert (inputs / "train.parquet").read_bytes() == written
    assert write_dataset(rows, inputs, "train") == [str(inputs / "train.parquet")]
    assert write_dataset(other_rows, inputs, "train") == [str(inputs / "train-2.parquet")]
    assert sorted(path.name for path in inputs.iterdir()) == ["train-2.parquet", "train.parquet"]

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model_dir), load_tokenizer(str(tiny_model_dir))
    folder = inputs / "initial_model"
    assert save_model_if_loaded(model, tokenizer, folder) == str(folder)
    weights = {path.name: path.read_bytes() for path in folder.glob("*.safetensors")}
    assert save_model_if_loaded(model, tokenizer, folder) == str(folder)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert save_model_if_loaded(model, tokenizer, folder) == str(inputs / "initial_model-2")
    assert {path.name: path.read_bytes() for path in folder.glob("*.safetensors")} == weights
    assert not any(path.name.endswith(".partial") for path in inputs.iterdir())


def test_train_returns_trls_train_output(tmp_path, tiny_model_dir):
    """TRL's ``TrainOutput``: the step reached, the mean loss of the steps trained, the last step's metrics; a
    second ``train()`` on the same folder resumes and averages only what it trained."""
    from reinforge import SFTConfig, SFTTrainer
    from reinforge.tracking.jsonl import read_json_lines

    rows = [{"messages": [{"role": "user", "content": f"{a}+1="}, {"role": "assistant", "content": str(a + 1)}]}
            for a in range(8)]

    def trainer(steps):
        return SFTTrainer(model=str(tiny_model_dir), train_dataset=rows, args=SFTConfig(
            output_dir=str(tmp_path / "sft"), max_steps=steps, save_steps=2, per_device_train_batch_size=2,
            report_to="none"))

    output = trainer(2).train()
    global_step, training_loss, metrics = output  # a tuple, as in TRL
    logged = [row["train/loss"] for row in read_json_lines(tmp_path / "sft" / "metrics.jsonl")]
    assert global_step == output.global_step == 2 and len(logged) == 2
    assert training_loss == pytest.approx(sum(logged) / 2)
    assert output["train/loss"] == metrics["train/loss"] == pytest.approx(logged[-1])
    resumed = trainer(3).train()
    logged = [row["train/loss"] for row in read_json_lines(tmp_path / "sft" / "metrics.jsonl")]
    assert resumed.global_step == 3 and len(logged) == 3
    assert resumed.training_loss == pytest.approx(logged[-1])


def test_callbacks_state_and_model_follow_the_run_as_in_trl(tmp_path, tiny_model_dir):
    """TRL's TrainerCallback events, ``trainer.state.log_history`` under TRL's metric names, ``trainer.model`` holding
    the trained weights and ``trainer.processing_class``, with the model given as a path."""
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback

    from reinforge import SFTTrainer

    events, epochs = [], []

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            events.append(("on_train_begin", state.global_step, state.max_steps, args.output_dir))

        def on_step_end(self, args, state, control, **kwargs):
            events.append(("on_step_end", state.global_step))

        def on_log(self, args, state, control, logs=None, **kwargs):
            events.append(("on_log", state.global_step, sorted({"loss", "learning_rate", "grad_norm"} & set(logs))))
            epochs.append((state.epoch, logs.get("epoch")))

        def on_train_end(self, args, state, control, **kwargs):
            events.append(("on_train_end", state.global_step))

    rows = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(4)]
    trainer = SFTTrainer(str(tiny_model_dir), SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2,
                                                        per_device_train_batch_size=2, report_to="none"),
                         train_dataset=rows, callbacks=[Recorder])  # a class, as TRL takes it, or an instance
    untrained = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    saved = AutoModelForCausalLM.from_pretrained(trainer.save_model(tmp_path / "start")).state_dict()
    for name, tensor in untrained.items():  # before any checkpoint, the model as it starts, as TRL saves it
        torch.testing.assert_close(saved[name], tensor, msg=name)
    output = trainer.train()
    logged = ["grad_norm", "learning_rate", "loss"]
    assert events == [("on_train_begin", 0, 2, str(tmp_path / "sft")), ("on_step_end", 1), ("on_log", 1, logged),
                      ("on_step_end", 2), ("on_log", 2, logged), ("on_train_end", 2)]
    assert epochs == [(0.5, 0.5), (1.0, 1.0)]  # as TRL's state.epoch: 2 steps of 2 rows an epoch of 4
    history = trainer.state.log_history
    assert [row["step"] for row in history] == [1, 2, 2] and trainer.state.global_step == 2
    assert [row["loss"] for row in history[:2]] == [row["train/loss"] for row in read_metrics(tmp_path / "sft")]
    assert history[-1]["train_loss"] == output.training_loss == output.metrics["train_loss"]
    trained = AutoModelForCausalLM.from_pretrained(trainer.save_model()).state_dict()
    assert any(not torch.equal(trained[name], untrained[name]) for name in untrained)
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], msg=name)
    assert trainer.processing_class("1+1=")["input_ids"]


def test_callbacks_added_after_the_trainer_is_made_are_called_and_push_to_hub_says_what_uploads():
    """transformers' Trainer methods a TRL script calls: add_callback, pop_callback/remove_callback, push_to_hub."""
    from transformers import PrinterCallback, TrainerCallback, TrainerState

    from reinforge import SFTTrainer
    from reinforge.api.callbacks import CallbackHandler

    steps = []

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    trainer = object.__new__(SFTTrainer)  # the callbacks a made trainer holds, without a model to load
    trainer.callback_handler = CallbackHandler([], SFTConfig(), TrainerState(global_step=3))
    trainer.add_callback(Recorder)
    trainer.add_callback(PrinterCallback())
    assert isinstance(trainer.pop_callback(PrinterCallback), PrinterCallback)
    assert trainer.pop_callback(PrinterCallback) is None
    trainer.callback_handler.call("on_step_end")  # as the run calls it after each step
    assert steps == [3]
    trainer.remove_callback(Recorder)
    assert trainer.callback_handler.callbacks == []
    with pytest.raises(NotImplementedError, match=r"^trainer.push_to_hub\(\): reinforge does not upload; "
                                                  r"trainer.save_model\(\) writes the model folder"):
        trainer.push_to_hub()


def test_pop_callback_by_a_class_takes_an_instance_of_a_subclass_as_transformers_does():
    from transformers import PrinterCallback, TrainerState

    from reinforge import SFTTrainer
    from reinforge.api.callbacks import CallbackHandler

    class QuietPrinter(PrinterCallback):
        pass

    trainer = object.__new__(SFTTrainer)
    trainer.callback_handler = CallbackHandler([], SFTConfig(), TrainerState())
    trainer.add_callback(QuietPrinter)
    assert isinstance(trainer.pop_callback(PrinterCallback), QuietPrinter)
    assert trainer.callback_handler.callbacks == []


def test_steps_count_optimizer_steps_as_in_trl_when_a_generation_makes_several(tmp_path, tiny_model_dir):
    """steps_per_generation=4 with gradient_accumulation_steps=2: each reinforge step generates once and makes two
    optimizer steps, which TRL counts one by one (global_step, on_step_end, max_steps, the reward's trainer_state)."""
    from transformers import TrainerCallback

    from reinforge import GRPOTrainer

    ends, seen_by_reward = [], []

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append((state.global_step, state.max_steps))

    def reward(completions, trainer_state, log_metric, **kwargs):
        seen_by_reward.append((trainer_state.global_step, trainer_state.max_steps))
        log_metric("completions/seen", float(len(completions)))  # TRL's: lands in the step's metrics
        return [float(len(completion)) for completion in completions]

    rows = [{"prompt": f"{a}+{a}="} for a in range(8)]
    trainer = GRPOTrainer(str(tiny_model_dir), reward, GRPOConfig(
        output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        steps_per_generation=4, max_steps=4, max_completion_length=2, report_to="none"), train_dataset=rows,
        callbacks=[Recorder], reward__num_workers=0, trainer__device="cpu")
    output = trainer.train()
    assert ends == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert seen_by_reward == [(0, 4), (2, 4)]
    assert output.global_step == trainer.state.global_step == 4
    assert [row["step"] for row in trainer.state.log_history] == [2, 4, 4]
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]  # reinforge's own steps are generations
    assert [row["completions/seen"] for row in read_metrics(tmp_path)] == [8.0, 8.0]
    assert trainer.train().global_step == 4  # a second train() of a finished run trains nothing, and says so
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]


def test_a_callback_defining_events_a_run_never_calls_is_warned_of(caplog):
    from transformers import PrinterCallback, TrainerCallback

    from reinforge.api.callbacks import callback_objects

    class OnSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            pass

        def on_log(self, args, state, control, **kwargs):
            pass

    with caplog.at_level("WARNING", logger="reinforge.api.callbacks"):
        made = callback_objects([OnSave, PrinterCallback()])
    assert [type(callback) for callback in made] == [OnSave, PrinterCallback]
    assert [record.getMessage().split(" (")[0] for record in caplog.records] == [
        "callback OnSave defines on_save, which a reinforge run never calls"]


def test_a_callback_that_sets_should_training_stop_ends_the_run_after_that_step(tmp_path, tiny_model_dir):
    from transformers import TrainerCallback

    from reinforge import SFTTrainer

    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    rows = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(8)]
    trainer = SFTTrainer(str(tiny_model_dir), SFTConfig(output_dir=str(tmp_path), max_steps=5, save_steps=4,
                                                        per_device_train_batch_size=2, report_to="none"),
                         train_dataset=rows, callbacks=[StopAtTwo()])
    output = trainer.train()
    assert output.global_step == trainer.state.global_step == 2
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000002"]  # as at its end
    output = trainer.train()  # a second train() goes on from the stop, logged and saved as the first
    assert output.global_step == trainer.state.global_step == 5
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert [row["step"] for row in trainer.state.log_history if "loss" in row] == [1, 2, 3, 4, 5]


def test_trl_logs_name_the_rl_metrics_as_trl_does():
    from reinforge.api.callbacks import trl_logs

    logs = trl_logs({"actor/pg_loss": 0.5, "actor/lr": 1e-6, "critic/score/mean": 0.7, "actor/kl_loss": 0.01,
                     "response_length/mean": 12.0, "rewards/correct/mean": 0.7, "training/epoch": 1.0})
    assert logs.items() >= {"loss": 0.5, "learning_rate": 1e-6, "reward": 0.7, "kl": 0.01,
                            "completions/mean_length": 12.0, "rewards/correct/mean": 0.7, "epoch": 1.0}.items()


@pytest.mark.parametrize(("trainer_name", "arguments", "message"), [
    ("GRPOTrainer", {"optimizers": ("an optimizer", None)}, r"GRPOTrainer\(optimizers=...\): reinforge makes its own"),
    ("GRPOTrainer", {"tools": [print]}, r"GRPOTrainer\(tools=...\): reinforge's multi-turn tool runs"),
    ("SFTTrainer", {"data_collator": print}, r"SFTTrainer\(data_collator=...\): reinforge batches"),
    ("DPOTrainer", {"quantization_config": object()}, r"DPOTrainer\(quantization_config=...\): reinforge trains"),
    ("RewardTrainer", {"compute_metrics": print}, r"RewardTrainer\(compute_metrics=...\): reinforge logs"),
])
def test_trl_trainer_arguments_without_a_counterpart_are_refused_in_one_line(trainer_name, arguments, message):
    import reinforge

    with pytest.raises(TypeError, match=message):
        getattr(reinforge, trainer_name)("some/model", **arguments)


def test_a_formatting_func_makes_each_row_a_text_trained_whole(tmp_path, tiny_model_dir):
    from reinforge import SFTTrainer
    from reinforge.api.inputs import formatted_rows

    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]
    assert formatted_rows(rows, lambda row: row["question"] + row["answer"]) == [{"text": "1+1=2"}, {"text": "2+2=4"}]
    with pytest.raises(TypeError, match="formatting_func returned a dict for row 0; return the row's text"):
        formatted_rows(rows, lambda row: row)
    trainer = SFTTrainer(str(tiny_model_dir), SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none"),
                         train_dataset=rows, formatting_func=lambda row: row["question"] + row["answer"])
    import pyarrow.parquet as pq

    assert pq.read_table(trainer.config.data.train_files[0]).to_pylist() == [{"text": "1+1=2"}, {"text": "2+2=4"}]


def test_reward_processing_classes_give_a_loaded_reward_model_its_tokenizer(tmp_path, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    from reinforge.api.inputs import reward_functions_of
    from reinforge.models import load_tokenizer
    from reinforge.models.tiny import build_char_tokenizer

    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    reward_model.name_or_path = ""  # only the tokenizer given says which one it reads
    reward_model.config._name_or_path = ""
    tokenizer = build_char_tokenizer()

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    settings = {}
    assert reward_functions_of([reward, reward_model], settings, tmp_path, [None, tokenizer]) == [reward]
    saved = load_tokenizer(settings["reward.reward_model.model_path"])
    assert saved.get_vocab() == tokenizer.get_vocab()
    # a folder's own tokenizer is taken; another one is refused, not silently replaced by the folder's
    own = load_tokenizer(str(tiny_model_dir))
    assert reward_functions_of(str(tiny_model_dir), {}, tmp_path, own) is None
    with pytest.raises(ValueError, match="reward_processing_classes gives the reward model .* the tokenizer of"):
        reward_functions_of([str(tiny_model_dir)], {}, tmp_path, [tokenizer])
    with pytest.raises(ValueError, match="reward_processing_classes has 1 entries for 2 reward_funcs"):
        reward_functions_of([reward, str(tiny_model_dir)], {}, tmp_path, [tokenizer])


def test_a_reward_trainers_model_is_the_trained_token_classifier(tmp_path):
    """Started from a token classifier, ``trainer.model`` is one, with the trained weights (its score head's bias
    included) that ``save_model`` writes."""
    import torch
    from transformers import AutoModelForTokenClassification, Qwen2ForTokenClassification

    from reinforge import RewardConfig, RewardTrainer
    from tests.workers.test_reward_model import save_tiny_reward_model

    folder = save_tiny_reward_model(tmp_path / "token_rm", Qwen2ForTokenClassification)
    pairs = [{"prompt": [{"role": "user", "content": f"{a}+{a}?"}], "chosen": [{"role": "assistant", "content": str(2 * a)}],
              "rejected": [{"role": "assistant", "content": str(2 * a + 1)}]} for a in range(4)]
    trainer = RewardTrainer(model=str(folder), train_dataset=pairs,
                            args=RewardConfig(output_dir=str(tmp_path / "rm"), max_steps=1, per_device_train_batch_size=4,
                                              max_length=64, report_to="none", learning_rate=1e-2))
    trainer.train()
    saved = AutoModelForTokenClassification.from_pretrained(trainer.save_model()).state_dict()
    assert isinstance(trainer.model, Qwen2ForTokenClassification)
    untrained = AutoModelForTokenClassification.from_pretrained(folder).state_dict()
    assert not torch.equal(saved["score.weight"], untrained["score.weight"])
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], msg=name)


@pytest.mark.parametrize("output_router_logits", [False, True])
@pytest.mark.parametrize("kind", ["grpo", "sft", "dpo", "reward"])
def test_the_api_weighs_a_mixture_of_experts_aux_loss_by_trls_rule(tmp_path, monkeypatch, kind, output_router_logits):
    """TRL's router_aux_loss_coef=None takes the model config's declared coefficient for any mixture of experts,
    whatever its output_router_logits says; its RewardTrainer adds no aux loss at all. A run of the command line keeps
    reinforge's rule: the coefficient only where output_router_logits asks for it."""
    import reinforge.trainer.rl_trainer as rl_trainer
    from reinforge import DPOConfig, DPOTrainer, GRPOTrainer, RewardConfig, RewardTrainer, SFTTrainer
    from reinforge.config import load_config, load_sft_config
    from reinforge.config.preference_schema import load_dpo_config, load_rm_config
    from reinforge.engine.moe import router_aux_loss_coef
    from reinforge.models.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_layers=1,
                                output_router_logits=output_router_logits, router_aux_loss_coef=0.5)
    common = dict(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2, report_to="none")
    pairs = [{"prompt": [{"role": "user", "content": "1+1?"}], "chosen": [{"role": "assistant", "content": "2"}],
              "rejected": [{"role": "assistant", "content": "3"}]}] * 2
    if kind == "grpo":
        made = {}
        monkeypatch.setattr(rl_trainer, "RLTrainer", lambda config, **kwargs: made.update(config=config))
        GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
                    args=GRPOConfig(num_generations=2, **common), train_dataset=[{"prompt": "1+1=", "answer": "2"}])
        from transformers import AutoConfig

        coefficient = router_aux_loss_coef(AutoConfig.from_pretrained(model_dir), made["config"].actor.router_aux_loss_coef)
        command_line = router_aux_loss_coef(AutoConfig.from_pretrained(model_dir),
                                            load_config(None, []).actor.router_aux_loss_coef)
    else:
        if kind == "sft":
            trainer = SFTTrainer(str(model_dir), SFTConfig(max_length=32, **common),
                                 train_dataset=[{"prompt": "1+1=", "completion": "2"}] * 2)
        elif kind == "dpo":
            trainer = DPOTrainer(str(model_dir), args=DPOConfig(max_length=32, **common), train_dataset=pairs)
        else:
            trainer = RewardTrainer(str(model_dir), args=RewardConfig(max_length=32, **common), train_dataset=pairs)
        coefficient = trainer.trainer.router_aux_loss_coef
        loader = {"sft": load_sft_config, "dpo": load_dpo_config, "reward": load_rm_config}[kind]
        command_line = router_aux_loss_coef(trainer.trainer.model.config,
                                            loader(None, []).trainer.router_aux_loss_coef)
    assert coefficient == (0.0 if kind == "reward" else 0.5)
    assert command_line == (0.5 if output_router_logits else 0.0)
