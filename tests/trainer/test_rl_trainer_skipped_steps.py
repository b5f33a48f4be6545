"""A step whose tools all failed (their service down) is skipped: nothing of it reaches the weights or the optimizer,
it is logged as ``training/skipped_step``, redone on the same prompts, and never checkpointed past.

The tool is real: a function tool that raises while a flag file exists. The scorer (in this process) counts the samples
it scores and raises or lowers the flag at set counts, so the service goes down between two steps and comes back
after some attempts. The tiny model never writes a Hermes call, so a parser reads every assistant turn as a call.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reinforge.agent import TOOL_PARSERS, ToolCall, register_tool_parser
from reinforge.cli import main

LETTER_IDS = [3 + byte for byte in range(ord("a"), ord("z") + 1)]
SAMPLES_PER_STEP = 8  # data.train_batch_size=4 x rollout.n=2

TOOLS_PY = '''
import os


def echo(text: str) -> str:
    """Echo the text.

    Args:
        text: The text.
    """
    if os.path.exists({flag!r}):
        raise ConnectionError("the echo service does not answer")
    return "echo:" + text
'''

SCORER_PY = '''
import os


def compute_score(solution_str, ground_truth, **kwargs):
    count = int(open({count!r}).read()) + 1 if os.path.exists({count!r}) else 1
    with open({count!r}, "w") as handle:
        handle.write(str(count))
    if count == {down_after}:
        open({flag!r}, "w").close()
    if count == {up_after} and os.path.exists({flag!r}):
        os.remove({flag!r})
    return float(len(solution_str) % 3)
'''


@pytest.fixture(autouse=True)
def every_turn_calls_echo():
    @register_tool_parser("test_skipped_steps")
    class EveryTurn:
        def parse(self, text):
            return [ToolCall("echo", {"text": text[:4]})]

    yield
    del TOOL_PARSERS["test_skipped_steps"]


def run_args(folder: Path, model_dir: Path, *, down_after: int, up_after: int, total_steps: int = 2) -> list[str]:
    """A tool_agent run in ``folder`` whose tool service goes down once the scorer has scored ``down_after`` samples
    and comes back at ``up_after`` (0: never)."""
    folder.mkdir(exist_ok=True)
    flag, count = str(folder / "service_down"), str(folder / "scored")
    (folder / "echo_tools.py").write_text(TOOLS_PY.format(flag=flag))
    (folder / "tools.yaml").write_text(f"tools:\n  - class_name: {folder / 'echo_tools.py'}:echo\n")
    (folder / "score.py").write_text(SCORER_PY.format(count=count, flag=flag, down_after=down_after,
                                                      up_after=up_after))
    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": f"{i}+{i}"}], "agent_name": "tool_agent",
             "reward_model": {"ground_truth": str(2 * i)}, "extra_info": {}} for i in range(8)]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return [f"model.path={model_dir}", f"data.train_files=[{folder / 'train.jsonl'}]", "data.train_batch_size=4",
            "data.shuffle=false", f"reward.custom_function={folder / 'score.py'}:compute_score", "reward.num_workers=0",
            "data.max_prompt_length=32", "data.max_response_length=96", "rollout.n=2", "rollout.name=hf",
            f"rollout.stop_token_ids=[{','.join(map(str, LETTER_IDS))}]",
            f"rollout.multi_turn.tool_config_path={folder / 'tools.yaml'}", "rollout.multi_turn.format=test_skipped_steps",
            "rollout.multi_turn.max_assistant_turns=2", f"trainer.output_dir={folder / 'run'}",
            "trainer.loggers=[jsonl]", f"trainer.total_steps={total_steps}", "trainer.save_every=1",
            "trainer.val_before_train=false", "trainer.device=cpu", "actor.optim.lr=1e-2",
            "actor.optim.weight_decay=0.1"]


def saved_state(folder: Path, step: int) -> dict:
    """The actor's weights and optimizer state in the run's checkpoint of ``step``."""
    return torch.load(folder / "run" / "checkpoints" / f"step_{step:06d}" / "actor_state.pt", weights_only=True)


def assert_same(left, right, where: str = "") -> None:
    if isinstance(left, torch.Tensor):
        assert torch.equal(left, right), where
    elif isinstance(left, dict):
        assert left.keys() == right.keys(), where
        for key in left:
            assert_same(left[key], right[key], f"{where}/{key}")
    elif isinstance(left, list | tuple):
        assert len(left) == len(right), where
        for index, (one, other) in enumerate(zip(left, right, strict=True)):
            assert_same(one, other, f"{where}/{index}")
    else:
        assert left == right, where


def metrics_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_steps_whose_tools_failed_leave_weights_and_optimizer_as_an_uninterrupted_run(tiny_model_dir, tmp_path,
                                                                                        capsys):
    """Step 2's first two attempts meet the service down; the third trains. Skipped attempts applied nothing (no
    momentum, no weight decay), so step 2's checkpoint equals that of a run whose service never failed."""
    steady = tmp_path / "steady"
    assert main(["train", *run_args(steady, tiny_model_dir, down_after=0, up_after=0)]) == 0
    outage = tmp_path / "outage"
    assert main(["train", *run_args(outage, tiny_model_dir, down_after=SAMPLES_PER_STEP,
                                     up_after=3 * SAMPLES_PER_STEP)]) == 0
    assert_same(saved_state(outage, 2), saved_state(steady, 2))
    assert not torch.equal(saved_state(steady, 1)["model"]["lm_head.weight"],
                           saved_state(steady, 2)["model"]["lm_head.weight"])  # the step trains something
    records = metrics_of(outage)
    assert [(row["step"], row.get("training/skipped_step", 0.0)) for row in records] == [(1, 0.0), (2, 1.0), (2, 1.0),
                                                                                           (2, 0.0)]
    skipped = records[1]
    assert skipped["agent/tool_raised"] == skipped["agent/tool_errors"] > 0 and "actor/grad_norm" not in skipped
    samples = [json.loads(line) for line in (outage / "run" / "samples.jsonl").read_text().splitlines()]
    # the skipped attempts' samples are told apart from those step 2 trained
    assert [(row["step"], row.get("skipped_step", False)) for row in samples] == [
        (1, False)] * 4 + [(2, True)] * 8 + [(2, False)] * 4
    assert int((outage / "scored").read_text()) == 4 * SAMPLES_PER_STEP  # step 2's prompts were generated thrice


@pytest.mark.slow
def test_a_service_that_stays_down_stops_the_run_before_the_step_and_the_rerun_trains_it(tiny_model_dir, tmp_path,
                                                                                          capsys):
    steady = tmp_path / "steady"
    assert main(["train", *run_args(steady, tiny_model_dir, down_after=0, up_after=0)]) == 0
    outage = tmp_path / "outage"
    args = run_args(outage, tiny_model_dir, down_after=SAMPLES_PER_STEP, up_after=0)
    assert main(["train", *args]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert ("step 2 was skipped 3 time(s) in a row: every one of the" in error or "ToolFailure: every one of" in error
            ), error
    checkpoints = sorted(path.name for path in (outage / "run" / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_000001"]  # nothing past the step that was not trained
    assert [row.get("training/skipped_step", 0.0) for row in metrics_of(outage)] == [0.0, 1.0, 1.0]

    (outage / "service_down").unlink()  # the service is back: the same command trains step 2 from step 1's state
    assert main(["train", *args]) == 0
    assert_same(saved_state(outage, 2), saved_state(steady, 2))
    assert [(row["step"], row.get("training/skipped_step", 0.0)) for row in metrics_of(outage)] == [(1, 0.0), (2, 0.0)]
