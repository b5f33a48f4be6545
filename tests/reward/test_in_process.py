"""Scoring in the trainer's process (reward.num_workers=0): exits are caught, a crash is named on the last line."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reinforge.config.schema import RewardConfig
from reinforge.protocol import Batch
from reinforge.reward.in_process import ScorerSentinel
from reinforge.reward.manager import RewardManager

sys.path.insert(0, str(Path(__file__).parents[1]))
import forked_python  # noqa: E402


def make_batch(tokenizer, texts):
    """Right-padded responses of ``texts``, data_source x."""
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(map(len, encoded))
    responses = torch.tensor([ids + [0] * (width - len(ids)) for ids in encoded])
    response_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in encoded])
    return Batch.from_dict(tensors={"responses": responses, "response_mask": response_mask},
                           non_tensors={"data_source": ["x"] * len(texts), "ground_truth": ["x"] * len(texts)})

SCORERS = '''
import ctypes
import os
import sys

calls = []


def exits(solution_str, ground_truth, extra_info=None):
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "sys.exit":
        sys.exit(4)
    return 1.0


def forks(solution_str, ground_truth, extra_info=None):
    """A child that ends with os._exit, as multiprocessing's forked children do."""
    pid = os.fork()
    if pid == 0:
        os._exit(5)
    return float(os.waitpid(pid, 0)[1] >> 8)


def exits_on_the_second_call(solution_str, ground_truth, extra_info=None):
    calls.append(1)
    if len(calls) == 2:
        os._exit(3)
    return float(len(solution_str) % 2)


def segfaults(solution_str, ground_truth, extra_info=None):
    calls.append(1)
    if len(calls) == 3:
        ctypes.string_at(0)
    return float(len(solution_str) % 2)
'''


@pytest.fixture
def scorers(tmp_path):
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS)
    return path


def test_a_scorer_calling_exit_in_this_process_fails_its_sample_not_the_run(byte_tokenizer, scorers, caplog):
    manager = RewardManager(RewardConfig(num_workers=0, fallback_score=-1.0, custom_function=f"{scorers}:exits"),
                            byte_tokenizer)
    with manager, caplog.at_level(logging.WARNING, logger="reinforge.reward.manager"):
        output = manager.score(make_batch(byte_tokenizer, ["exit", "ok", "sys.exit"]))
    assert output.scores.tolist() == [-1.0, 1.0, -1.0]
    assert output.metrics["reward/errors"] == 2.0
    assert "the scorer called os._exit(3)" in caplog.text


def test_a_process_the_scorer_forks_still_ends_with_os_exit(byte_tokenizer, scorers):
    manager = RewardManager(RewardConfig(num_workers=0, custom_function=f"{scorers}:forks"), byte_tokenizer)
    with manager:
        assert manager.score(make_batch(byte_tokenizer, ["a"])).scores.tolist() == [5.0]


def test_os_exit_outside_a_scorer_still_ends_the_process(byte_tokenizer, scorers):
    code = ("import os, sys; from reinforge.reward.in_process import intercept_scorer_exits; "
            "intercept_scorer_exits(); os._exit(7)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 7


def test_the_sentinel_is_silent_unless_the_process_ends_during_a_call():
    code = ("import os, sys; from reinforge.reward.in_process import ScorerSentinel; s = ScorerSentinel(); "
            "s.begin('first call'); s.end(); s.begin('scoring sample 5'); "
            "os._exit(9) if sys.argv[1] == 'die' else (s.end(), s.close())")
    ended = subprocess.run([sys.executable, "-c", code, "die"], capture_output=True, text=True, timeout=60)
    assert ended.returncode == 9 and ended.stderr.strip().splitlines()[-1] == "error: scoring sample 5"
    finished = subprocess.run([sys.executable, "-c", code, "finish"], capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0 and finished.stderr == ""
    ScorerSentinel().close()  # a closed sentinel exits without a word


def _train_args(model: Path, data: Path, run_dir: Path, scorer: str) -> list[str]:
    settings = {
        "model.path": model, "data.train_files": f"[{data / 'train.parquet'}]", "data.train_batch_size": 2,
        "data.max_prompt_length": 64, "data.max_response_length": 4, "rollout.n": 2,
        "trainer.output_dir": run_dir, "trainer.loggers": "[jsonl]", "trainer.total_steps": 2,
        "trainer.val_before_train": False, "reward.num_workers": 0, "reward.custom_function": scorer,
    }
    return [f"{key}={value}" for key, value in settings.items()]


@pytest.mark.slow
def test_train_goes_on_past_a_scorer_that_calls_os_exit(tiny_model_dir, arithmetic_data_dir, tmp_path, scorers):
    run_dir = tmp_path / "run"
    args = _train_args(tiny_model_dir, arithmetic_data_dir, run_dir, f"{scorers}:exits_on_the_second_call")
    finished = forked_python.run(["-m", "reinforge", "train", *args], timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert sum(row.get("reward/errors", 0) for row in rows) == 1
    assert "os._exit(3)" in finished.stderr


@pytest.mark.slow
def test_a_segfaulting_scorer_is_named_on_the_runs_last_line(tiny_model_dir, arithmetic_data_dir, tmp_path, scorers):
    """A fresh interpreter: the sentinel's line comes after the trainer died, read until the pipe closes."""
    args = _train_args(tiny_model_dir, arithmetic_data_dir, tmp_path / "run", f"{scorers}:segfaults")
    finished = subprocess.run([sys.executable, "-m", "reinforge", "train", *args], capture_output=True, text=True,
                              timeout=600)
    assert finished.returncode == -11, finished.stderr[-3000:]
    last_line = finished.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: the trainer process ended while reward.custom_function=")
    assert f"{scorers}:segfaults was scoring sample 2 of a batch of 4 (data_source 'arithmetic', uid " in last_line
    assert "reward.num_workers>0" in last_line


def test_an_async_scorer_past_its_time_limit_is_cancelled_on_the_scorer_loop():
    """Async scorers share one event loop kept for the process: one stopped at its time limit must not go on there."""
    import asyncio
    import threading

    from reinforge.reward.in_process import run_job_in_thread
    from reinforge.reward.scoring_pool import ScoringJob

    cancelled = threading.Event()

    async def hangs(**kwargs):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def answers(**kwargs):
        return 1.0

    assert run_job_in_thread(ScoringJob(hangs, {}), 0.3).timed_out
    assert cancelled.wait(5)
    assert run_job_in_thread(ScoringJob(answers, {}), 5).value == 1.0
