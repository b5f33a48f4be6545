"""DAPO in the trainer: dynamic sampling and overlong shaping end to end, and an exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from reinforge.cli import main
from reinforge.protocol import Batch
from reinforge.trainer.dynamic_sampling import group_metric, kept_group_rows

from .test_rl_trainer import COMPARED_PREFIXES, base_args, read_metrics

ODD_SUM = '''
def compute_score(solution_str, ground_truth, extra_info=None, **kwargs):
    score = float(sum(map(ord, solution_str)) % 2)
    return {"score": score, "acc": score > 0}
'''


def dapo_args(model: Path, data: Path, run_dir: Path, reward_file: Path, **overrides: object) -> list[str]:
    return base_args(model, data, run_dir, **{
        "reward.custom_function": f"{reward_file}:compute_score", "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.max_num_gen_batches": 0, "data.gen_batch_size": 3, "rollout.n": 2,
        "reward.overlong_buffer.enable": True, "reward.overlong_buffer.len": 4, "trainer.total_steps": 3,
        "trainer.num_logged_samples": 4, **overrides})


def prompts_logged(run_dir: Path) -> list[tuple[int, str]]:
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    return [(row["step"], row["prompt"]) for row in rows]


@pytest.mark.slow
def test_dynamic_sampling_and_overlong_shaping_train_and_resume_exactly(tiny_model_dir, arithmetic_data_dir,
                                                                        tmp_path):
    reward_file = tmp_path / "odd.py"
    reward_file.write_text(ODD_SUM)
    reference = tmp_path / "reference"
    assert main(["train", *dapo_args(tiny_model_dir, arithmetic_data_dir, reference, reward_file)]) == 0
    rows = read_metrics(reference)
    assert len(rows) == 3
    for row in rows:
        assert row["train/num_gen_batches"] >= 2  # 4 groups needed, at most 3 per generation batch
        assert 0 < row["train/kept_group_fraction"] <= 1
        assert row["train/num_kept_groups"] >= 4
        assert "reward/overlong/count" in row and "reward/overlong_penalty/mean" in row
        assert row["critic/score/mean"] is not None  # not NaN (metrics.jsonl writes it as null)
    assert any(row["train/kept_group_fraction"] < 1 for row in rows)  # some groups were dropped

    resumed = tmp_path / "resumed"
    args = dapo_args(tiny_model_dir, arithmetic_data_dir, resumed, reward_file)
    assert main(["train", *args, "trainer.total_steps=1", "trainer.save_every=1"]) == 0
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert main(["train", *args]) == 0

    def comparable(run_rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if not k.startswith(COMPARED_PREFIXES)} for row in run_rows]

    assert comparable(read_metrics(resumed)) == comparable(rows)
    assert prompts_logged(resumed) == prompts_logged(reference)


def test_acc_of_a_scorer_that_returns_a_float_is_its_score_as_in_verl():
    """verl's DAPO reward manager records acc = score for a float scorer; the default metric (acc) must work."""
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    batch = Batch.from_dict(tensors={"token_level_scores": scores},
                            non_tensors={"uid": ["a", "a", "b", "b"],
                                         "reward_overlong_penalty": [0.0, 0.0, 0.0, -0.5]})
    batch["token_level_scores"] = scores + torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, -0.5]])
    values = group_metric(batch, "acc")
    assert values.tolist() == [1.0, 0.0, 1.0, 1.0]  # before overlong shaping, like verl's acc
    assert kept_group_rows(batch["uid"], values)[1] == 1  # a varies, b does not
    # a sample without acc (a failed one) among samples with it counts its score
    batch.non_tensors["reward_acc"] = np.array([True, None, False, False], dtype=object)
    assert group_metric(batch, "acc").tolist() == [1.0, 0.0, 0.0, 0.0]


def merged_metrics(run_dir: Path) -> dict[int, dict]:
    """Each step's records of metrics.jsonl merged (a run that ends with its data logs its final step twice)."""
    merged: dict[int, dict] = {}
    for row in read_metrics(run_dir):
        merged.setdefault(row["step"], {}).update(row)
    return merged


@pytest.mark.slow
@pytest.mark.parametrize(("prompts", "epochs", "runs_out_inside_a_step"), [
    (12, 2, True),  # 4 generation batches of 3 an epoch: steps 1 and 2 take 3 each, step 3 finds 2
    (18, 1, False),  # 6 generation batches: steps 1-3 take 2 each
])
def test_with_total_steps_unset_dynamic_sampling_ends_when_its_epochs_data_is_used_up_and_resumes_exactly(
        tiny_model_dir, arithmetic_data_dir, tmp_path, prompts, epochs, runs_out_inside_a_step):
    """A step draws several generation batches, so len(loader) x total_epochs steps would make more passes over
    the data than total_epochs: the run ends when the data of its epochs is drawn, as verl's loop over epochs does,
    with its final step validated and saved, whether the data ran out with a step or inside one."""
    reward_file = tmp_path / "odd.py"
    reward_file.write_text(ODD_SUM)
    settings = {"trainer.total_steps": "null", "trainer.total_epochs": epochs, "data.max_train_samples": prompts}
    batches = prompts // 3 * epochs
    reference = tmp_path / "reference"
    assert main(["train", *dapo_args(tiny_model_dir, arithmetic_data_dir, reference, reward_file, **settings)]) == 0
    steps = merged_metrics(reference)
    last = max(steps)
    assert 1 <= last < batches and sorted(steps) == list(range(1, last + 1))
    used = sum(row["train/num_gen_batches"] for row in steps.values())
    assert used < batches if runs_out_inside_a_step else used == batches
    assert max(row["training/epoch"] for row in steps.values()) < epochs
    assert steps[last]["training/data_used_up"] == 1.0
    assert not any("training/data_used_up" in row for step, row in steps.items() if step < last)
    assert (reference / "checkpoints" / "latest").read_text().strip() == f"step_{last:06d}"
    loader = torch.load(reference / "checkpoints" / f"step_{last:06d}" / "trainer_state.pt",
                        weights_only=False)["loader"]
    assert loader["epoch"] * (prompts // 3) + loader["position"] == batches  # every batch of the epochs drawn

    again = (reference / "metrics.jsonl").read_text()  # a finished run resumed trains nothing and succeeds
    assert main(["train", *dapo_args(tiny_model_dir, arithmetic_data_dir, reference, reward_file, **settings)]) == 0
    assert (reference / "metrics.jsonl").read_text() == again

    resumed = tmp_path / "resumed"
    args = dapo_args(tiny_model_dir, arithmetic_data_dir, resumed, reward_file, **settings)
    assert main(["train", *args, "trainer.total_steps=1", "trainer.save_every=1"]) == 0
    assert main(["train", *args]) == 0

    def comparable(run_rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if not k.startswith(COMPARED_PREFIXES)} for row in run_rows]

    assert comparable(read_metrics(resumed))[1:] == comparable(read_metrics(reference))[1:]
    assert prompts_logged(resumed) == prompts_logged(reference)


def test_dynamic_sampling_that_keeps_no_group_before_its_data_is_used_up_fails_as_nothing_trained(
        tiny_model_dir, arithmetic_data_dir, tmp_path, capsys):
    reward_file = tmp_path / "constant.py"
    reward_file.write_text("def compute_score(solution_str, ground_truth, extra_info=None, **kwargs):\n"
                           "    return 1.0\n")
    run_dir = tmp_path / "run"
    args = dapo_args(tiny_model_dir, arithmetic_data_dir, run_dir, reward_file, **{
        "trainer.total_steps": "null", "data.max_train_samples": 6, "algorithm.filter_groups.max_num_gen_batches": 5})
    assert main(["train", *args]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: NothingTrained: nothing was trained (the first step was not complete): dynamic "
                            "sampling used up trainer.total_epochs=1 epoch(s) of data (2 generation batches of "
                            "data.gen_batch_size=3 prompts) while the step in progress had kept only 0 of the "
                            "data.train_batch_size=4 prompt groups it needs (its 2 generation batch(es) are dropped); "
                            "add data, raise trainer.total_epochs"), error
    assert not (run_dir / "checkpoints" / "latest").exists()
