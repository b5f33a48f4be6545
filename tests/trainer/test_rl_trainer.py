"""The RL trainer end to end on a tiny model, through the CLI as a user runs it."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reinforge.cli import main

sys.path.insert(0, str(Path(__file__).parents[1]))
import forked_python  # noqa: E402

CONTAINS_SEVEN = '''
def compute_score(solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if "7" in solution_str else 0.0
'''

RAISES = '''
def compute_score(solution_str, ground_truth, extra_info=None, **kwargs):
    if "3" in solution_str:
        raise ZeroDivisionError("scorer bug")
    return 0.5
'''


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def base_args(model: Path, data: Path, run_dir: Path, **overrides: object) -> list[str]:
    settings = {
        "model.path": model, "data.train_files": f"[{data / 'train.parquet'}]", "data.train_batch_size": 4,
        "data.max_prompt_length": 64, "data.max_response_length": 8, "rollout.n": 4,
        "trainer.output_dir": run_dir, "trainer.loggers": "[jsonl]", "trainer.total_steps": 2,
        "trainer.val_before_train": False, "actor.optim.lr": 2e-3,
    }
    settings.update(overrides)
    return [f"{key}={value}" for key, value in settings.items()]


@pytest.mark.slow
@pytest.mark.parametrize("estimator, steps", [("grpo", 30), ("gae", 36)])  # the critic learns first, then the actor
def test_mean_reward_rises_on_a_learnable_reward(tiny_model_dir, arithmetic_data_dir, tmp_path, estimator, steps):
    reward_file = tmp_path / "seven.py"
    reward_file.write_text(CONTAINS_SEVEN)
    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **{
        "trainer.total_steps": steps, "rollout.n": 8, "algorithm.adv_estimator": estimator,
        "critic.optim.lr": 1e-3, "reward.custom_function": f"{reward_file}:compute_score"})
    assert main(["train", *args]) == 0
    scores = [row["critic/score/mean"] for row in read_metrics(run_dir) if "critic/score/mean" in row]
    assert len(scores) == steps
    start, end = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert start < 0.25
    assert end > 0.6, scores


ESTIMATOR_AND_LOSS = [
    ("grpo", "vanilla"), ("grpo_passk", "gspo"), ("rloo", "gpg"), ("reinforce_plus_plus", "clip_cov"),
    ("reinforce_plus_plus_baseline", "kl_cov"), ("remax", "geo_mean"), ("opo", "cispo"), ("gpg", "sapo"),
    ("gae", "vanilla"), ("tir_optimal_token_baseline", "dppo_tv"), ("gdpo", "dro"),
]
EXTRA_SETTINGS = {"gdpo": {"algorithm.gdpo_reward_keys": "[acc,score]", "algorithm.gdpo_reward_weights": "[1.0,0.5]"},
                  "dro": {"actor.policy_loss.dro_beta": 0.1}}


@pytest.mark.parametrize("estimator, loss_mode", ESTIMATOR_AND_LOSS)
def test_every_estimator_and_policy_loss_trains(tiny_model_dir, arithmetic_data_dir, tmp_path, estimator, loss_mode):
    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **{
        "algorithm.adv_estimator": estimator, "actor.policy_loss.loss_mode": loss_mode, "trainer.total_steps": 1,
        "data.train_batch_size": 2, "rollout.n": 2, "actor.mini_batch_size": 1, "actor.ppo_epochs": 2,
        **EXTRA_SETTINGS.get(estimator, {}), **EXTRA_SETTINGS.get(loss_mode, {})})
    assert main(["train", *args]) == 0
    [row] = read_metrics(run_dir)
    # every optimizer step applied (a non-finite gradient is skipped and counted, not averaged in)
    assert row["actor/num_skipped_steps"] == 0 and math.isfinite(row["actor/pg_loss"])
    assert "timing_s/old_log_prob" in row  # two epochs over two mini-batches is off-policy
    # the old log-probs, scored at the rollout temperature, are the sampler's own (float32 on the CPU)
    assert row["training/rollout_probs_diff_max"] < 1e-3
    if estimator == "remax":
        assert "timing_s/gen_max" in row
    if estimator == "gae":
        assert "critic/vf_loss" in row and "critic/values/mean" in row


@pytest.mark.parametrize("overrides", [
    # on-policy otherwise: the optimal token baseline alone makes the step run the log-prob pass (for sum pi^2)
    {"algorithm.adv_estimator": "optimal_token_baseline", "actor.policy_loss.loss_mode": "dppo_kl"},
    {"algorithm.rollout_correction.bypass_mode": True, "algorithm.rollout_correction.loss_type": "reinforce",
     "algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_is_threshold": "0.5_2",
     "algorithm.rollout_correction.rollout_is_batch_normalize": True,
     "algorithm.rollout_correction.rollout_rs": "token_k1,seq_max_k3",
     "algorithm.rollout_correction.rollout_rs_threshold": "0.5_2.0,1.0"},
])
def test_verl_estimators_and_corrections_run_a_step(tiny_model_dir, arithmetic_data_dir, tmp_path, overrides):
    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **{"trainer.total_steps": 1, **overrides})
    assert main(["train", *args]) == 0
    [row] = read_metrics(run_dir)
    assert row["actor/num_skipped_steps"] == 0  # a non-finite gradient would be skipped and counted here
    if "algorithm.adv_estimator" in overrides:
        assert "timing_s/old_log_prob" in row
    else:  # bypass mode corrects inside the loss: no log-prob pass
        assert "timing_s/old_log_prob" not in row and "actor/rollout_corr/rollout_rs_masked_fraction" in row
        assert "actor/rollout_corr/rollout_is_batch_norm_factor" in row and "actor/rollout_corr/rollout_is_oob_ratio" in row


def test_kl_loss_kl_in_reward_and_validation(tiny_model_dir, arithmetic_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **{
        "actor.use_kl_loss": True, "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
        "data.val_files": f"[{arithmetic_data_dir / 'test.parquet'}]", "trainer.val_before_train": True,
        "rollout.val_kwargs.n": 2, "rollout.val_kwargs.temperature": 1.0})
    assert main(["train", *args]) == 0
    rows = read_metrics(run_dir)
    assert rows[0]["step"] == 0 and "val-core/arithmetic/acc/mean@2" in rows[0]
    assert "val-core/arithmetic/acc/maj@2" in rows[0] and "val-core/arithmetic/acc/best@2" in rows[0]
    last = rows[-1]
    assert "actor/kl_loss" in last and "actor/reward_kl_penalty" in last and "timing_s/ref" in last
    assert "val-core/arithmetic/acc/mean@2" in last  # validation after the last step
    assert (run_dir / "config.yaml").is_file() and (run_dir / "samples.jsonl").is_file()


def test_checkpoint_loads_with_auto_classes_and_export(tiny_model_dir, arithmetic_data_dir, tmp_path):
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "run"
    # a data.chat_template override is the template the checkpoints and the export are served with
    template = AutoTokenizer.from_pretrained(tiny_model_dir).chat_template + "{# the run's own template #}"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"data": {"chat_template": template}}))
    assert main(["train", str(config), *base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **{
        "trainer.keep_last": 1, "trainer.save_every": 1})]) == 0
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [path.name for path in checkpoints] == ["step_000002"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    AutoModelForCausalLM.from_pretrained(checkpoints[0] / "hf")
    assert AutoTokenizer.from_pretrained(checkpoints[0] / "hf").chat_template == template
    assert main(["export", str(run_dir), str(tmp_path / "exported")]) == 0
    AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert AutoTokenizer.from_pretrained(tmp_path / "exported").chat_template == template
    assert main(["export", str(run_dir), str(tmp_path / "half"), "--dtype", "bfloat16"]) == 0
    import torch

    half = AutoModelForCausalLM.from_pretrained(tmp_path / "half", dtype="auto")
    assert half.dtype == torch.bfloat16 and AutoModelForCausalLM.from_pretrained(tmp_path / "exported").dtype == torch.float32


def test_fit_resumed_at_the_final_step_reports_that_steps_metrics(tiny_model_dir, arithmetic_data_dir, tmp_path):
    from reinforge.config import load_config
    from reinforge.trainer.rl_trainer import RLTrainer

    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **{"trainer.total_steps": 1})
    assert main(["train", *args]) == 0
    logged = read_metrics(run_dir)[-1]
    metrics = RLTrainer(load_config(None, args)).fit()
    assert logged.pop("step") == 1
    assert metrics == logged
    assert len(read_metrics(run_dir)) == 1  # nothing trained or logged again


def test_a_raising_reward_function_costs_a_fallback_not_the_run(tiny_model_dir, arithmetic_data_dir, tmp_path):
    reward_file = tmp_path / "buggy.py"
    reward_file.write_text(RAISES)
    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **{
        "reward.custom_function": f"{reward_file}:compute_score", "reward.fallback_score": -1.0,
        "rollout.n": 8, "data.max_response_length": 16})
    assert main(["train", *args]) == 0
    rows = read_metrics(run_dir)
    assert len(rows) == 2
    assert sum(row["reward/errors"] for row in rows) > 0
    assert min(row["critic/score/min"] for row in rows) == -1.0


def test_unknown_config_key_is_one_clear_line(capsys):
    assert main(["train", "actor.optim.learning_rate=1e-6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: unknown key actor.optim.learning_rate (command line); did you mean actor.optim.lr?"


def test_row_without_prompt_is_one_clear_line(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"data_source": "arithmetic", "reward_model": {"ground_truth": "1"}}) + "\n")
    args = [f"model.path={tiny_model_dir}", f"data.train_files=[{bad}]", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 0" in err[0] and "prompt" in err[0] and "bad.jsonl" in err[0]


COMPARED_PREFIXES = ("timing_s/", "perf/", "rollout/tokens_per_s")
"""Metrics that measure speed, left out when two runs are compared (resume tests: test_run_loop.py)."""


def _train_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "reinforge", "train", *args]


def train_in_a_process(args: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess:
    """``reinforge train args`` in a process of its own, forked from a preloaded interpreter (forked_python.py), so
    that every run of one test hashes strings alike; ``returncode``, ``stdout`` and ``stderr`` as subprocess.run's."""
    return forked_python.run(["-m", "reinforge", "train", *args], timeout=timeout_s)


def sigkill_at_step(args: list[str], run_dir: Path, step: int, timeout_s: float) -> None:
    """Run ``reinforge train args`` (as ``train_in_a_process``) and SIGKILL it once its metrics.jsonl has ``step``
    (or after ``timeout_s``)."""
    process = forked_python.ForkedPython(["-m", "reinforge", "train", *args], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
    metrics_file = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if metrics_file.is_file() and any(json.loads(line).get("step") == step
                                          for line in metrics_file.read_text().splitlines() if line.strip()):
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL


@pytest.mark.parametrize("free_cache_engine", [True, False])
def test_native_rollout_engine_in_the_loop(tiny_model_dir, arithmetic_data_dir, tmp_path, free_cache_engine):
    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **{
        "rollout.name": "native", "rollout.n": 4, "rollout.free_cache_engine": str(free_cache_engine).lower()})
    assert main(["train", *args]) == 0
    rows = read_metrics(run_dir)
    assert len(rows) == 2
    for row in rows:
        # float32 on the CPU: the engine's probabilities are the trainer's, up to rounding
        assert row["training/rollout_probs_diff_max"] < 1e-3
        # the engine counted every sampled token of the 4 x 4 responses (EOS included, as the mask is)
        assert row["rollout/num_generated_tokens"] == pytest.approx(row["response_length/mean"] * 16)


@pytest.mark.slow
def test_the_command_exits_cleanly(tiny_model_dir, arithmetic_data_dir, tmp_path):
    """Worker threads that ran torch code are joined before exit; a live one would abort the interpreter's teardown."""
    args = base_args(tiny_model_dir, arithmetic_data_dir, tmp_path / "run", **{
        "trainer.total_steps": 1, "reward.num_workers": 0})
    finished = subprocess.run(_train_command(args), capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "terminate called" not in finished.stderr


def test_a_run_whose_every_optimizer_step_is_skipped_stops_and_does_not_exit_0(tiny_model_dir, arithmetic_data_dir,
                                                                                tmp_path, monkeypatch, capsys):
    """Gradients that are never finite (NaN weights, an infinite learning rate's first step) leave the weights as
    they are; the run stops after a few such steps with one line instead of training on to exit 0."""
    import torch

    from reinforge.engine import train_step
    from reinforge.trainer.run_loop import STALLED_STEPS

    monkeypatch.setattr(train_step, "clip_grad_norm_", lambda parameters, max_norm: torch.tensor(float("nan")))
    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **{
        "trainer.total_steps": STALLED_STEPS + 2, "reward.num_workers": 0})
    assert main(["train", *args]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and f"steps 1-{STALLED_STEPS}: every optimizer step of actor was skipped" in error
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, STALLED_STEPS + 1))  # what was logged stays
    assert all(row["actor/grad_norm"] is None for row in rows)  # NaN, which metrics.jsonl writes as null


def test_numpy_extras_of_a_scorer_are_averaged():
    """A scorer returning numpy bools or integers in its extras (acc from a comparison of arrays) gets reward/acc/mean;
    they were dropped silently."""
    import numpy as np

    from reinforge.trainer.metrics import mean_of_extras

    assert mean_of_extras({"acc": [np.bool_(True), np.bool_(False)], "steps": [np.int64(3), np.int64(5)],
                           "label": ["a", "b"]}) == {"reward/acc/mean": 0.5, "reward/steps/mean": 4.0}


def test_a_role_that_fails_to_start_stops_the_groups_started_before_it(rl_args, tiny_model_dir, tmp_path):
    """A critic whose weights do not load fails after the actor's group started: that group stops too (on Ray, its
    member processes, which would keep the pool's devices) and the run folder is unlocked, so the same process
    can start the run again once the critic is fixed."""
    import json
    import shutil
    import struct
    import threading

    from reinforge.config import load_config
    from reinforge.controller import WorkerCallError
    from reinforge.trainer.rl_trainer import RLTrainer

    broken = tmp_path / "critic"
    shutil.copytree(tiny_model_dir, broken)
    # whole (as many bytes as its header describes, which the start-up check reads), but two tensors share their bytes
    overlapping = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    header = json.dumps(overlapping).encode().ljust(88)
    (broken / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    args = rl_args(tmp_path / "run", **{"critic.enable": True, "algorithm.adv_estimator": "gae"})
    before = {thread.name for thread in threading.enumerate()}
    with pytest.raises(WorkerCallError, match=r"worker group 'critic' \(CriticWorker\) rank 0 of 1 raised in "
                                              r"__init__") as caught:
        RLTrainer(load_config(None, [*args, f"critic.model_path={broken}"]))
    assert {thread.name for thread in threading.enumerate()} - before == set()  # no member thread of the actor
    assert type(caught.value.__cause__).__name__ == "SafetensorError"  # the loader's own error, kept as the cause
    RLTrainer(load_config(None, args)).close()  # while caught's traceback still holds the trainer that failed
