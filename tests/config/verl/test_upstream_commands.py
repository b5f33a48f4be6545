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
from tests.config.verl.upstream_commands import COMMANDS, REFUSED, TRANSLATED

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


FAKE_PATHS = {"MODEL": "/models/m", "REWARD_MODEL": "/models/rm", "TRAIN": "/data/train.parquet",
              "VAL": "/data/test.parquet", "TOOLS": "/tools.yaml", "RUN": "/runs/r"}
EXPECTED = {
    "gemma_ppo": {"algorithm.adv_estimator": "gae", "critic.model_path": "/models/m", "critic.optim.lr": 1e-5,
                  "trainer.backend": "ray"},
    "mistral_reward_model": {"reward.reward_model.enable": True, "reward.reward_model.model_path": "/models/rm",
                             "reward.num_workers": 8, "rollout.n": 5},
    "ppo_reward_model_seq_balance": {"reward.reward_model.enable": True, "critic.max_tokens_per_micro_batch": 98304,
                                     "actor.max_tokens_per_micro_batch": 24000},
    "deepseek_v3_megatron": {"actor.param_offload": True, "actor.optimizer_offload": True, "ref.param_offload": True,
                             "actor.max_tokens_per_micro_batch": 6144, "ref.max_tokens_per_micro_batch": 18432,
                             "trainer.nnodes": 32, "actor.router_aux_loss_coef": 0.0},
    "qwen3_moe_megatron_lora": {"model.lora.rank": 32, "model.lora.alpha": 64, "actor.router_aux_loss_coef": 0.0,
                                "actor.param_offload": True, "rollout.gpu_memory_utilization": 0.25},
    "qwen3_8b": {"actor.use_kl_loss": True, "actor.kl_loss_type": "low_var_kl", "rollout.n": 5},
    "gspo_qwen3_moe": {"actor.policy_loss.loss_mode": "gspo", "actor.policy_loss.clip_ratio_low": 0.0003,
                       "actor.policy_loss.clip_ratio_high": 0.0004, "data.max_response_length": 8192,
                       "reward.overlong_buffer.len": 4096},
    "dapo_qwen3_moe_fp8_rollout": {"algorithm.rollout_correction.rollout_is": "token", "trainer.project_name":
                                   "VERL-FP8-RL", "algorithm.filter_groups.enable": True},
    "dapo_qwen3_8b_reward_section": {"reward.overlong_buffer.enable": True, "data.max_response_length": 20480},
    "qwen2_5_vl_lora": {"model.lora.rank": 64, "actor.freeze_vision_tower": True},
    "multi_turn_qwen3": {"rollout.multi_turn.tool_config_path": "/tools.yaml", "rollout.n": 16},
    "qwen3_8b_megatron_engine": {"rollout.n": 5, "actor.max_tokens_per_micro_batch": 24576,
                                 "actor.optim.schedule": "constant", "trainer.backend": "ray"},
    "qwen3_30b_veomni": {"actor.optim.schedule": "cosine", "actor.param_offload": True, "actor.optimizer_offload": True,
                         "ref.param_offload": True, "ref.max_tokens_per_micro_batch": 30720, "trainer.total_steps": 100},
    "cispo_qwen3_8b": {"actor.policy_loss.loss_mode": "cispo", "actor.policy_loss.clip_ratio_low": 1.0,
                       "actor.policy_loss.clip_ratio_high": 0.2},
    "one_step_off_grpo": {"trainer.mode": "one_step_off", "trainer.separate_rollout": True, "rollout.n": 5,
                          "trainer.devices_per_node": 6, "data.train_batch_size": 1152},
    "one_step_off_dapo_ris": {"trainer.mode": "one_step_off", "trainer.separate_rollout": True,
                              "algorithm.rollout_correction.rollout_rs": "seq_mean_k1",
                              "algorithm.rollout_correction.rollout_is_threshold": "2.0", "trainer.total_steps": 400},
    "fully_async_dapo": {"trainer.mode": "async", "trainer.max_staleness": 0.1, "trainer.trigger_sync_steps": 4,
                         "trainer.separate_rollout": True},
}


def _value(config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


@pytest.mark.parametrize("name", list(TRANSLATED))
def test_a_verl_command_of_another_family_or_recipe_translates_every_key(name):
    """Each key is translated, already what reinforge does, or reported with its reason; the result validates."""
    from reinforge.config import load_config
    from reinforge.config.verl.translate import parse_verl_overrides, translate_verl
    from reinforge.trainer.preflight import check_config

    words = shlex.split(TRANSLATED[name][1].format(**FAKE_PATHS))
    translation = translate_verl(words)
    config = load_config(None, tree=translation.tree)
    check_config(config)
    for key, value in EXPECTED[name].items():
        assert _value(config, key) == pytest.approx(value) if isinstance(value, float) else _value(config, key) == value
    reported = {line.verl_key for line in (*translation.translated, *translation.already_ours,
                                           *translation.no_equivalent)}
    assert set(parse_verl_overrides(words)) <= reported
    assert all(line.reason for line in translation.no_equivalent)


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_verl_command_that_would_train_something_else_stops_in_one_line(name):
    from reinforge.config import ConfigError
    from reinforge.config.verl.translate import translate_verl

    _, text, key = REFUSED[name]
    with pytest.raises(ConfigError) as refusal:
        translate_verl(shlex.split(text.format(**FAKE_PATHS)))
    assert str(refusal.value).startswith((f"{key}=", f"{key} (verl command line)")) and "\n" not in str(refusal.value)
