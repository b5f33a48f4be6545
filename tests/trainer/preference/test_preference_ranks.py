"""reinforge rm and dpo on two gloo processes: FSDP2 shards, each rank its share of every batch's pairs, and the
metrics, checkpoints and exported reward model of one process within rounding."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from reinforge.config.preference_schema import load_dpo_config, load_rm_config
from reinforge.trainer.preference.dpo_trainer import REFERENCE_FILE, DPOTrainer
from reinforge.trainer.preference.rm_trainer import RewardModelTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine"))
from test_fsdp import run_gloo_ranks  # noqa: E402

RANK_SCRIPT = textwrap.dedent("""
    import sys
    from reinforge.config.preference_schema import load_dpo_config, load_rm_config
    from reinforge.trainer.preference.dpo_trainer import DPOTrainer
    from reinforge.trainer.preference.rm_trainer import RewardModelTrainer

    command, overrides = sys.argv[1], sys.argv[2:]
    if command == "rm":
        RewardModelTrainer(load_rm_config(None, overrides)).fit()
    else:
        DPOTrainer(load_dpo_config(None, overrides)).fit()
""")
TRAINERS = {"rm": (load_rm_config, RewardModelTrainer), "dpo": (load_dpo_config, DPOTrainer)}


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def scores(folder: Path) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    inputs = tokenizer(["question 3? yes", "question 4? no, sorry"], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**inputs).logits.squeeze(-1)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["rm", "dpo"])
def test_two_gloo_processes_train_like_one(command, pair_args, pairs_dir, tmp_path):
    # 7 pairs a step: rank 1 gets 3 of them, and of the last batch of 4 pairs each rank 2
    settings = {"data.val_files": f"[{pairs_dir / 'val.jsonl'}]", "data.batch_size": 7, "trainer.total_steps": 3,
                "data.max_train_samples": 18, "trainer.save_every": 2}
    load, trainer_class = TRAINERS[command]
    one = tmp_path / "one"
    trainer_class(load(None, pair_args(one, **settings))).fit()
    two = tmp_path / "two"
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    run_gloo_ranks(script, command, *pair_args(two, **settings))

    first, second = metrics_of(one), metrics_of(two)  # rank 0 alone wrote the second run's
    assert [record["step"] for record in second] == [record["step"] for record in first] == [0, 1, 2, 3]
    for a, b in zip(first, second, strict=True):
        assert set(a) == set(b)
        for key, value in a.items():
            if not key.startswith(("timing_s/", "perf/")):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    if command == "rm":
        folder = sorted((two / "checkpoints").glob("step_*"))[-1] / "hf"
        reference = sorted((one / "checkpoints").glob("step_*"))[-1] / "hf"
        torch.testing.assert_close(scores(folder), scores(reference), atol=1e-5, rtol=1e-4)
        # stopped after its step-2 checkpoint, the two-rank run resumes there and ends as before
        shutil.rmtree(folder.parent)
        run_gloo_ranks(script, command, *pair_args(two, **settings))
        assert [record["step"] for record in metrics_of(two)] == [0, 1, 2, 3]
        assert metrics_of(two)[-1]["train/loss"] == pytest.approx(second[-1]["train/loss"], rel=1e-5)
        torch.testing.assert_close(scores(folder), scores(reference), atol=1e-5, rtol=1e-4)
    else:
        torch.testing.assert_close(torch.load(two / REFERENCE_FILE, weights_only=True)["train"],
                                   torch.load(one / REFERENCE_FILE, weights_only=True)["train"])
