"""Nine verl command lines, as verl's examples and recipes write them, train two steps here (``--from-verl``).

The commands are ``upstream_commands.COMMANDS`` with the model, data, tool and checkpoint paths
swapped for a tiny model, GSM8K rows from ``tests/data/gsm8k`` and this test's folder, and one
device. They ask for 7B-32B-model sizes (1024 prompts a step, 16 samples, 20k-token responses),
so every run gets the same CPU-sized shape from ``SMALL_RUN``, our own overrides after ``--``:
sizes only, which change no algorithm, loss or reward. What the translation makes of each verl
key is otherwise what trains.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from reinforge.cli import main
from reinforge.data.gsm8k import convert_gsm8k, make_gsm8k_row
from reinforge.data.retool import convert_retool
from tests.config.verl.upstream_commands import COMMANDS

REPO = Path(__file__).resolve().parents[3]
GSM8K_SAMPLE = REPO / "tests" / "data" / "gsm8k"

SMALL_RUN = ("data.train_batch_size=2", "rollout.n=2", "data.max_response_length=8",
             "actor.mini_batch_size=2", "data.max_val_samples=2",
             "rollout.val_kwargs.n=1", "trainer.total_steps=2", "reward.overlong_buffer.len=4")
"""One CPU-sized shape for every command: two prompts of two samples, eight response tokens, two steps."""
RANDOM_MODEL = {"dapo_32b": ("algorithm.filter_groups.enable=false", "data.gen_batch_size=null")}
"""DAPO's dynamic sampling off (and with it its generation batches): a random tiny model answers no GSM8K question,
so every group has one accuracy and dynamic sampling (in verl too) would keep none."""

GSM8K_TOOL = {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "native"}, "tool_schema": {
    "type": "function", "function": {"name": "calc_gsm8k_reward", "description": "Check a GSM8K answer.",
                                     "parameters": {"type": "object", "required": ["answer"],
                                                    "properties": {"answer": {"type": "string"}}}}}}
RETOOL_SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs):
    """The ReTool recipe's shape: +1/-1 on the boxed answer, a wrong one shaped by the turns taken."""
    from reinforge.reward.scorers.math_dapo import score_math_dapo

    result = score_math_dapo(solution_str, ground_truth, strict_box_verify=True)
    if result["score"] < 0:
        result["score"] = min(-0.6, result["score"] + (extra_info["num_turns"] - 2) / 2 * 0.1)
    return result
'''


def tool_rows(question: str, answer: str, split: str, index: int) -> dict:
    """verl's multi-turn GSM8K rows: the tool_agent loop and the calc_gsm8k_reward tool's ground truth."""
    row = make_gsm8k_row(question, answer, split, index)
    row["agent_name"] = "tool_agent"
    row["extra_info"]["tools_kwargs"] = {
        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": row["reward_model"]["ground_truth"]}}}
    return row


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> Path:
    """The tiny model with room for the commands' prompt lengths (up to 2048 characters of the char tokenizer)."""
    from reinforge.models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("model") / "model", max_position_embeddings=4096)


@pytest.fixture
def sandbox():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    from reinforge.sandbox import SandboxSettings
    from reinforge.sandbox.server import SandboxServer

    server = SandboxServer(SandboxSettings(port=0, max_concurrent=2,
                                           uid_base=63000 + (os.getpid() % 2000) * 16)).start()
    yield server
    server.close()


def paths_for(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    """The swapped paths of one command: its data (converted as its recipe needs), tools and reward function."""
    data = tmp_path / "data"
    if name == "retool":
        convert_retool(GSM8K_SAMPLE, data)
        sandbox_url = request.getfixturevalue("sandbox").url
        tools = {"class_name": "recipe.retool.retool.CustomSandboxFusionTool", "config": {
            "sandbox_fusion_url": f"{sandbox_url}/run_code", "num_workers": 4, "enable_global_rate_limit": True,
            "rate_limit": 4, "default_timeout": 30, "default_language": "python", "memory_limit_mb": 1024,
            "type": "native"}, "tool_schema": {"type": "function", "function": {
                "name": "code_interpreter", "description": "Run code.", "parameters": {
                    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}}
    else:
        convert_gsm8k(GSM8K_SAMPLE, data, tool_rows if name == "multi_turn_gsm8k" else make_gsm8k_row)
        tools = GSM8K_TOOL
    (tmp_path / "tools.yaml").write_text(yaml.safe_dump({"tools": [tools]}))
    (tmp_path / "retool_reward.py").write_text(RETOOL_SCORER)
    return {"TRAIN": str(data / "train.parquet"), "VAL": str(data / "test.parquet"), "TOOLS": str(tmp_path / "tools.yaml"),
            "REWARD": str(tmp_path / "retool_reward.py"), "RUN": str(tmp_path / "runs")}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_verl_command_as_written_upstream_trains_two_steps(name, long_context_model, tmp_path, monkeypatch,
                                                            request, capsys):
    monkeypatch.chdir(tmp_path)  # a command without trainer.default_local_dir writes checkpoints/{project}/{experiment}
    paths = {"MODEL": str(long_context_model), **paths_for(name, tmp_path, request)}
    words = shlex.split(COMMANDS[name][1].format(**paths))
    assert main(["train", "--from-verl", *words, "--", *SMALL_RUN, *RANDOM_MODEL.get(name, ()),
                 "trainer.device=cpu"]) == 0, \
        capsys.readouterr().err[-3000:]

    translated = {line.split("=", 1)[0] for line in words if "=" in line}
    run_dirs = [path.parent for path in tmp_path.rglob("metrics.jsonl")]
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    if "trainer.default_local_dir" not in translated:  # verl's own checkpoint folder, under the run's names
        assert run_dir.relative_to(tmp_path).parts[0] == "checkpoints"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "actor/pg_loss" in row]  # a validation before training is step 0
    assert [step["step"] for step in steps] == [1, 2]
    assert all(step["actor/pg_loss"] == step["actor/pg_loss"] for step in steps)  # not NaN
