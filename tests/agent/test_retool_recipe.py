"""The ReTool recipe end to end on the CPU: reinforge/examples/retool.yaml, a tiny model, the real sandbox, two steps.

Everything is the recipe as shipped (GSM8K rows from ``reinforge data retool``, the
``tool_agent`` loop, ``examples/retool_tools.yaml``'s code_interpreter, the boxed-answer scorer
with ReTool's shaping, GRPO with clip-higher and no KL) except two things a random tiny model
forces: it never writes a Hermes call, so a test parser reads each assistant turn as a
``code_interpreter`` call whose code depends on the turn's text, and turns stop at any
lowercase letter so that they stay short. The code then really runs in the bubblewrap sandbox
and its output comes back as the tool turn the model reads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from reinforge.agent import TOOL_PARSERS, ToolCall, register_tool_parser
from reinforge.cli import main
from reinforge.data.retool import convert_retool
from reinforge.examples import FOLDER as EXAMPLES
from reinforge.sandbox import SandboxSettings
from reinforge.sandbox.server import SandboxServer

REPO = Path(__file__).resolve().parents[2]
GSM8K_SAMPLE = REPO / "tests" / "data" / "gsm8k"
LOWERCASE_IDS = [3 + byte for byte in range(ord("a"), ord("z") + 1)]  # the char tokenizer's ids of a..z


@pytest.fixture
def sandbox():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    server = SandboxServer(SandboxSettings(port=0, max_concurrent=2,
                                           uid_base=62000 + (os.getpid() % 2000) * 16)).start()
    yield server
    server.close()


@pytest.fixture
def every_turn_runs_code():
    @register_tool_parser("test_every_turn_runs_code")
    class EveryTurnRunsCode:
        def parse(self, text):
            return [ToolCall("code_interpreter", {"code": f"print('ran', {len(text)} * 6)"})]

    yield "test_every_turn_runs_code"
    del TOOL_PARSERS["test_every_turn_runs_code"]


def recipe_files(tmp_path: Path, sandbox_url: str, tool_settings: str = "") -> tuple[Path, Path]:
    """(converted GSM8K rows, the recipe's tool config pointed at ``sandbox_url``, ``tool_settings`` added to its
    config block)."""
    data = tmp_path / "retool_gsm8k"
    convert_retool(GSM8K_SAMPLE, data)
    tools = tmp_path / "tools.yaml"
    text = (EXAMPLES / "retool_tools.yaml").read_text().replace("http://127.0.0.1:8080", sandbox_url)
    tools.write_text(text.replace("run_timeout_s: 10", "run_timeout_s: 10" + tool_settings))
    return data, tools


def two_step_args(model_dir, data: Path, tools: Path, parser: str, run_dir: Path) -> list[str]:
    """``reinforge train examples/retool.yaml`` on the tiny model: two steps on the CPU, short turns."""
    return [
        "train", str(EXAMPLES / "retool.yaml"),
        f"model.path={model_dir}", f"data.train_files=[{data / 'train.parquet'}]", "data.val_files=[]",
        "data.max_prompt_length=360", "data.train_batch_size=2", "data.max_response_length=96", "rollout.n=4",
        f"rollout.stop_token_ids=[{','.join(map(str, LOWERCASE_IDS))}]",
        f"rollout.multi_turn.tool_config_path={tools}", f"rollout.multi_turn.format={parser}",
        "rollout.multi_turn.max_assistant_turns=3", "reward.num_workers=0", f"trainer.output_dir={run_dir}",
        "trainer.loggers=[jsonl]", "trainer.total_steps=2", "trainer.val_before_train=false",
        "trainer.test_every=0", "trainer.save_every=0", "trainer.device=cpu"]


@pytest.mark.slow
def test_two_steps_of_the_retool_recipe_through_the_real_sandbox(tiny_model_dir, sandbox, every_turn_runs_code,
                                                                 tmp_path):
    data, tools = recipe_files(tmp_path, sandbox.url)
    run_dir = tmp_path / "run"
    assert main(two_step_args(tiny_model_dir, data, tools, every_turn_runs_code, run_dir)) == 0

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for step in metrics:
        assert step["agent/num_tool_calls/mean"] >= 1 and step["num_turns/mean"] > 2
        assert step["agent/tool_errors"] == 0  # every call reached the sandbox and ran
        # no boxed answer from a random model: ReTool's shaping, -1 + 0.05 per extra turn, at most -0.6
        assert -0.95 <= step["critic/score/min"] <= step["critic/score/max"] <= -0.6
        assert step["actor/pg_loss"] == step["actor/pg_loss"]  # not NaN
    samples = (run_dir / "samples.jsonl").read_text()
    assert "ran " in samples  # the sandbox's output, in the trajectories the trainer saw


def test_the_retool_recipe_with_no_sandbox_stops_before_the_model_loads(tiny_model_dir, tmp_path, capsys, monkeypatch):
    data, tools = recipe_files(tmp_path, "http://127.0.0.1:9")  # nothing listens on the discard port
    run_dir = tmp_path / "run"
    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a))
    overrides = [f"model.path={tiny_model_dir}", f"data.train_files=[{data / 'train.parquet'}]",
                 f"rollout.multi_turn.tool_config_path={tools}", f"trainer.output_dir={run_dir}",
                 "trainer.device=cpu"]
    assert main(["train", str(EXAMPLES / "retool.yaml"), *overrides]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the code_interpreter tool's sandbox does not work" in error and "reinforge sandbox serve" in error
    assert not loaded and not run_dir.exists()  # no model loaded, nothing written


@pytest.mark.slow
def test_a_sandbox_that_dies_mid_run_stops_the_run_with_one_line(tiny_model_dir, sandbox, every_turn_runs_code,
                                                                 tmp_path, capsys, monkeypatch):
    from reinforge.agent.code_interpreter import CodeInterpreterTool

    checked = CodeInterpreterTool.check

    def check_then_die(self):  # the sandbox answers the check before training, then goes away
        checked(self)
        sandbox.close()

    monkeypatch.setattr(CodeInterpreterTool, "check", check_then_die)
    data, tools = recipe_files(tmp_path, sandbox.url, "\n      retry_budget_s: 0\n      max_failures_in_a_row: 2")
    run_dir = tmp_path / "run"
    assert main(two_step_args(tiny_model_dir, data, tools, every_turn_runs_code, run_dir)) != 0
    error = capsys.readouterr().err.strip().splitlines()
    assert "ToolUnavailable: the code sandbox failed 2 calls in a row" in error[-1], error[-5:]
    assert not any(line.startswith("Traceback") for line in error)
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
