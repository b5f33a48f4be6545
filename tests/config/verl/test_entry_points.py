"""verl's entry points other than main_ppo: the one-step-off and fully async trainers become trainer.mode, their
config files' keys translate or stop in one line, the SFT trainer and unknown modules are refused naming the fix."""

import shlex

import pytest

from reinforge.cli import main
from reinforge.config import ConfigError, load_config
from reinforge.config.verl.translate import parse_verl_overrides, translate_verl
from reinforge.trainer.preflight import check_config
from tests.config.verl.upstream_commands import FULLY_ASYNC_DAPO

FAKE_PATHS = {"MODEL": "/models/m", "TRAIN": "/data/train.parquet", "VAL": "/data/test.parquet", "RUN": "/runs/r"}
FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"
ONE_STEP_OFF = "verl.experimental.one_step_off_policy.main_ppo"


def fully_async_dapo(staleness: str) -> list[str]:
    """verl's fully async DAPO script with its staleness_threshold (0.1) set to ``staleness``."""
    words = shlex.split(FULLY_ASYNC_DAPO.format(**FAKE_PATHS))
    return [f"async_training.staleness_threshold={staleness}" if word.startswith("async_training.staleness") else word
            for word in words]


def loaded(words: list[str]):
    config = load_config(None, tree=translate_verl(words).tree)
    check_config(config)
    return config


@pytest.mark.parametrize("launch", [
    ["python3", "-m", ONE_STEP_OFF], ["python", "-m", "recipe.one_step_off_policy.main_ppo"], [ONE_STEP_OFF],
    ["torchrun", "--nproc_per_node=8", "-m", ONE_STEP_OFF]])
def test_the_one_step_off_entry_point_is_its_mode_with_the_rollout_on_a_group_of_its_own(launch):
    config = loaded([*launch, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                     "actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=1", "rollout.n_gpus_per_node=2"])
    assert (config.trainer.mode, config.trainer.separate_rollout, config.rollout.n) == ("one_step_off", True, 4)


@pytest.mark.parametrize("module", ["verl.trainer.main_ppo", "verl.trainer.main_ppo_sync", "recipe.dapo.main_dapo"])
def test_the_synchronous_trainers_stay_sync_and_hybrid_engine_false_has_no_equivalent(module):
    translation = translate_verl(["python3", "-m", module, "actor_rollout_ref.hybrid_engine=False"])
    assert "mode" not in translation.tree.get("trainer", {})
    assert [line.verl_key for line in translation.no_equivalent] == ["actor_rollout_ref.hybrid_engine"]


def test_verls_fully_async_dapo_script_translates_its_steps_syncs_and_frequencies():
    config = loaded(fully_async_dapo("1"))
    trainer = config.trainer
    assert (trainer.mode, trainer.max_staleness, trainer.trigger_sync_steps, trainer.separate_rollout) == (
        "async", 1, 4, True)
    assert config.data.train_batch_size == 4 * 32  # require_batches x ppo_mini_batch_size, where verl passes 0
    assert trainer.total_steps == 51200 // 128  # rollout.total_rollout_steps prompts over a step's prompts
    assert trainer.test_every == 10 * 4  # rollout.test_freq counts syncs of 4 steps each
    assert config.actor.optim.warmup_steps == 10 * 4  # a step is require_batches optimizer steps
    translation = translate_verl(fully_async_dapo("1"))
    reported = {line.verl_key for line in (*translation.translated, *translation.already_ours,
                                           *translation.no_equivalent)}
    assert set(parse_verl_overrides(fully_async_dapo("1"))) <= reported
    assert {"async_training.partial_rollout", "async_training.use_rollout_log_probs"} <= {
        line.verl_key for line in translation.no_equivalent}


@pytest.mark.parametrize("words, message", [
    (["async_training.staleness_threshold=-1"], "async_training.staleness_threshold=-1 (verl command line) is -1; "
                                                "verl's staleness_threshold is a number of syncs of 0 or more"),
    (["async_training.staleness_threshold=0", "data.train_batch_size=512"],
     "data.train_batch_size=512 (verl command line) is refused by verl's fully async trainer (it asserts 0"),
    (["async_training.staleness_threshold=0", "algorithm.filter_groups.enable=True"],
     "algorithm.filter_groups.enable=true (verl command line) has no equivalent: verl's fully async trainer streams"),
])
def test_a_fully_async_setting_reinforge_cannot_honour_stops_in_one_line(words, message):
    with pytest.raises(ConfigError) as refusal:
        translate_verl(["python3", "-m", FULLY_ASYNC, "actor_rollout_ref.rollout.n=4", *words])
    assert str(refusal.value).startswith(message) and "\n" not in str(refusal.value)


@pytest.mark.parametrize("staleness, expected", [("0.1", 0.1), ("0.5", 0.5), (None, 0.1)])
def test_a_fractional_staleness_threshold_is_the_same_bound(staleness, expected):
    """verl admits (1 + staleness_threshold) syncs' worth of prompts ahead, a fraction of a sync included (its
    scripts use 0.1 to 0.5, its default is 0.1): trainer.max_staleness takes the same number."""
    words = fully_async_dapo(staleness or "0.1")
    if staleness is None:
        words = [word for word in words if not word.startswith("async_training.staleness_threshold")]
    assert loaded(words).trainer.max_staleness == pytest.approx(expected)


def test_fully_async_defaults_epochs_and_saves_count_as_verl_counts_them():
    config = loaded(["python3", "-m", FULLY_ASYNC, "async_training.staleness_threshold=0",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
                     "trainer.save_freq=3", "trainer.test_freq=7", "async_training.compute_prox_log_prob=True"])
    trainer = config.trainer
    assert config.data.train_batch_size == 8  # verl's require_batches is 1
    assert (trainer.max_staleness, trainer.trigger_sync_steps) == (0, 4)  # verl's trigger_parameter_sync_step: 4
    assert trainer.total_epochs == 10  # the rollouter's 10 epochs end the run before the trainer's 30
    assert (trainer.save_every, trainer.test_every) == (3 * 4, 1 * 4)  # rollout.test_freq (1), not trainer.test_freq
    assert trainer.proximal == "recompute"


@pytest.mark.parametrize("words, message", [
    (["torchrun", "--standalone", "-m", "verl.trainer.fsdp_sft_trainer", "optim.lr=1e-4"],
     "-m verl.trainer.fsdp_sft_trainer (verl command line) is verl's SFT trainer, which --from-verl does not "
     "translate; fine-tune with `reinforge sft CONFIG.yaml"),
    (["python3", "-m", "recipe.spin.main_spin", "data.train_batch_size=8"],
     "-m recipe.spin.main_spin (verl command line) is not an entry point reinforge translates; it takes "
     "verl.trainer.main_ppo, "),
    (["rollout.nnodes=1"], f"rollout.nnodes (verl command line) is a key of {ONE_STEP_OFF} and {FULLY_ASYNC}, not of "
                           f"verl's PPO trainer; paste the command with its module: --from-verl python3 -m "
                           f"{ONE_STEP_OFF} ..."),
    (["async_training.require_batches=2"], f"async_training.require_batches (verl command line) is a key of "
                                           f"{FULLY_ASYNC}, not"),
    (["data.train_batch_size=8", "python3", "-m", ONE_STEP_OFF],
     f"data.train_batch_size=8 (verl command line) comes before -m {ONE_STEP_OFF}; verl's key=value words go after"),
    (["python3", "-m"], "-m (verl command line) needs the module it runs"),
])
def test_an_entry_point_or_key_reinforge_does_not_take_is_refused_naming_the_fix(words, message):
    with pytest.raises(ConfigError) as refusal:
        translate_verl(words)
    assert str(refusal.value).startswith(message) and "\n" not in str(refusal.value)


def test_train_from_verl_takes_the_command_with_its_entry_point(capsys):
    # No model.path: training stops before loading anything, after the translation printed its mapping.
    assert main(["train", "--from-verl", "python3", "-m", ONE_STEP_OFF, "algorithm.adv_estimator=grpo",
                 "actor_rollout_ref.rollout.n=4", "data.train_files=/x.parquet", "--", "rollout.n=6"]) == 2
    err = capsys.readouterr().err
    assert f"(-m {ONE_STEP_OFF}: verl's one-step-off trainer" in err and "->  trainer.mode=one_step_off" in err
    assert "error: model.path is not set" in err
