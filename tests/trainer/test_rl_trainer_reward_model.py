"""GRPO with a reward model: alone (verl's replace), summed with or gated by the rule-based score, and refused in
one line before any model loads when its path is not a one-label classifier."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import reinforge.trainer.rl_trainer as rl_trainer
from reinforge.cli import main

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from test_reward_model import save_tiny_reward_model  # noqa: E402

CONSTANT = '''
def compute_score(solution_str, ground_truth, extra_info=None, **kwargs):
    return {value}
'''


class NoModelsHere:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a model started loading before the reward model was checked")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm")


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_grpo_trains_a_step_with_the_reward_model_as_its_only_reward(rl_args, reward_model_dir, tmp_path):
    # rows without ground truth or a scorer: replace mode runs no rule-based scorer in training
    rows = [{"prompt": [{"role": "user", "content": f"say {index}"}], "data_source": "my/task"} for index in range(4)]
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    run_dir = tmp_path / "run"
    args = rl_args(run_dir, **{"data.train_files": f"[{train}]", "trainer.total_steps": 1,
                               "reward.reward_model.enable": True, "reward.reward_model.model_path": reward_model_dir})
    assert main(["train", *args]) == 0
    [metrics] = metrics_of(run_dir)
    assert metrics["critic/score/mean"] == pytest.approx(metrics["reward_model/score/mean"], abs=1e-6)
    assert metrics["critic/score/max"] > metrics["critic/score/min"]  # a score per sample, not one constant
    assert metrics["reward_model/truncated"] == 0
    assert 0 < metrics["reward_model/share_of_step"] < 1
    assert metrics["timing_s/reward"] >= metrics["timing_s/reward_model"] > 0
    assert "actor/pg_loss" in metrics


@pytest.mark.parametrize("mode, rule, settings, expected", [
    ("sum", 1.0, {"reward.combine.rm_weight": 0.5, "reward.combine.rule_weight": 2.0}, lambda rm: 0.5 * rm + 2.0),
    ("gate", 1.0, {"reward.combine.gate_threshold": 0.5}, lambda rm: rm),  # every sample passes: the model's score
    ("gate", 0.25, {"reward.combine.gate_threshold": 0.5}, lambda rm: 0.25),  # none passes: the rule's score
])
def test_the_reward_models_score_combines_with_the_rules(rl_args, reward_model_dir, tmp_path, mode, rule, settings,
                                                         expected):
    scorer = tmp_path / "constant.py"
    scorer.write_text(CONSTANT.format(value=rule))
    run_dir = tmp_path / "run"
    args = rl_args(run_dir, **{"trainer.total_steps": 1, "reward.custom_function": f"{scorer}:compute_score",
                               "reward.reward_model.enable": True, "reward.reward_model.model_path": reward_model_dir,
                               "reward.combine.mode": mode, **settings})
    assert main(["train", *args]) == 0
    [metrics] = metrics_of(run_dir)
    assert metrics["critic/score/mean"] == pytest.approx(expected(metrics["reward_model/score/mean"]), abs=1e-5)


def test_a_reward_model_path_that_is_no_classifier_fails_before_any_model(rl_args, tiny_model_dir, reward_model_dir,
                                                                          tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rl_trainer, "ActorRolloutWorker", NoModelsHere)
    args = rl_args(tmp_path / "run", **{"reward.reward_model.enable": True,
                                        "reward.reward_model.model_path": tiny_model_dir})
    assert main(["train", *args]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: reward.reward_model.model_path={tiny_model_dir} is not a classification model "
                    "(Qwen2ForCausalLM in its config.json); the reward model must be an "
                    "AutoModelForSequenceClassification or AutoModelForTokenClassification folder with num_labels=1, "
                    "such as one `reinforge rm` exports; a causal LM that writes its judgement (verl's generative "
                    "reward model) is reward.judge.model_path, with reward.judge.template")
    args = rl_args(tmp_path / "run", **{"reward.reward_model.enable": True,
                                        "reward.reward_model.model_path": reward_model_dir,
                                        "reward.reward_model.input_tokenizer": tmp_path / "nowhere"})
    assert main(["train", *args]) == 2
    assert capsys.readouterr().err.strip() == (f"error: reward.reward_model.input_tokenizer={tmp_path / 'nowhere'} is "
                                               "not a folder; give the policy's tokenizer folder, auto (the policy's) "
                                               "or null (never re-render responses)")
    args = rl_args(tmp_path / "run", **{"reward.reward_model.enable": True})
    assert main(["train", *args]) == 2
    assert capsys.readouterr().err.strip().startswith("error: reward.reward_model.enable=true but "
                                                      "reward.reward_model.model_path is not set")


NO_SYSTEM_ROLE = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ raise_exception('System role "
                  "not supported') }}{% endif %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant] {% endif %}")
"""Gemma's refusal of a system message, in a template unlike the policy's (so responses are re-rendered in it)."""


def test_a_prompt_the_reward_models_template_refuses_fails_before_any_model(rl_args, tmp_path, monkeypatch, capsys):
    """It failed in the first step's scoring, after the models had loaded and the rollout had run."""
    monkeypatch.setattr(rl_trainer, "ActorRolloutWorker", NoModelsHere)
    rm_dir = save_tiny_reward_model(tmp_path / "rm", chat_template=NO_SYSTEM_ROLE)
    capsys.readouterr()  # the saving's progress bar
    rows = [{"prompt": [{"role": "user", "content": f"say {index}"}], "data_source": "my/task"} for index in range(4)]
    rows[1]["prompt"].insert(0, {"role": "system", "content": "be brief"})
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    args = rl_args(tmp_path / "run", **{"data.train_files": f"[{train}]", "reward.reward_model.enable": True,
                                        "reward.reward_model.model_path": rm_dir})
    assert main(["train", *args]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: row 1 of {train}: the reward model's chat template refuses its prompt with an answer "
                    "after it (System role not supported); merge the system message into the first user message (this "
                    "model has no system role), or set the chat_template of reward.reward_model.model_path="
                    f"{rm_dir} to a template that accepts one")


@pytest.mark.parametrize("key", ["model.path", "reward.judge.model_path"])
def test_a_classification_model_as_the_policy_or_the_judge_fails_before_any_model(rl_args, reward_model_dir, tmp_path,
                                                                                  monkeypatch, capsys, key):
    monkeypatch.setattr(rl_trainer, "ActorRolloutWorker", NoModelsHere)
    judge = {"reward.judge.enable": True, "reward.judge.model_path": "policy",
             "reward.judge.template": "'{response} Score:'"}
    args = rl_args(tmp_path / "run", **{**(judge if key.startswith("reward.judge") else {}), key: reward_model_dir})
    assert main(["train", *args]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: {key}={reward_model_dir} is Qwen2ForSequenceClassification (in its config.json), a "
                    "classification model that writes no text; point it at a causal LM folder (...ForCausalLM), and "
                    "give a reward model to reward.reward_model.model_path")


def test_a_reward_model_reading_past_its_positions_is_warned_about(tiny_model_dir, reward_model_dir, caplog):
    from reinforge.config import load_config
    from reinforge.trainer.preflight import check_reward_model_settings

    settings = [f"model.path={tiny_model_dir}", "reward.reward_model.enable=true",
                f"reward.reward_model.model_path={reward_model_dir}", "data.max_prompt_length=200",
                "data.max_response_length=100"]  # the tiny reward model has 256 positions
    with caplog.at_level("WARNING"):
        check_reward_model_settings(load_config(None, settings))
    [warning] = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warning.startswith("the reward model's input, data.max_prompt_length + data.max_response_length = 300 "
                              "tokens, more than the 256 positions the model at ")
    assert "what it computes past them is unreliable" in warning  # a reward model writes nothing
    caplog.clear()
    with caplog.at_level("WARNING"):
        check_reward_model_settings(load_config(None, [*settings, "reward.reward_model.max_length=256"]))
    assert not [record for record in caplog.records if record.levelname == "WARNING"]


def test_a_reward_model_with_a_learned_position_table_shorter_than_the_unset_limit_is_refused_naming_its_fix(
        tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from reinforge.config import load_config
    from reinforge.models import build_char_tokenizer, save_hf_folder
    from reinforge.trainer.preflight import check_reward_model_settings

    tokenizer = build_char_tokenizer()
    config = AutoConfig.for_model("gpt2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, num_labels=1,
                                  n_embd=32, n_layer=1, n_head=2, n_positions=64)
    rm_dir = save_hf_folder(AutoModelForSequenceClassification.from_config(config), tokenizer, tmp_path / "rm")
    settings = [f"model.path={tiny_model_dir}", "reward.reward_model.enable=true",
                f"reward.reward_model.model_path={rm_dir}", "data.max_prompt_length=64", "data.max_response_length=8"]
    with pytest.raises(ValueError) as refusal:
        check_reward_model_settings(load_config(None, settings))
    assert str(refusal.value).endswith(
        "with no row past them; reward.reward_model.max_length is unset, so the reward model reads that many; set it "
        "to 64 or fewer (a longer input loses its end, counted in reward_model/truncated), or lower "
        "data.max_prompt_length + data.max_response_length to 64 or fewer")
    assert str(refusal.value).startswith("the reward model's input, data.max_prompt_length + data.max_response_length "
                                         "= 72 tokens, more than the 64 positions")
    check_reward_model_settings(load_config(None, [*settings, "reward.reward_model.max_length=64"]))
    # 56 + 8 tokens fit the table, but the unset limit has room for the newline ChatML writes after a finished turn
    with pytest.raises(ValueError, match=r"^the reward model's input, data.max_prompt_length \+ "
                                         r"data.max_response_length, plus the 1 token\(s\) the chat template writes "
                                         r"after a finished turn = 65 tokens, more than the 64 positions"):
        check_reward_model_settings(load_config(None, [*settings, "data.max_prompt_length=56"]))


def test_reward_model_inputs_cut_to_max_length_are_warned_about_once_a_run(caplog):
    import logging
    from types import SimpleNamespace

    import torch

    from reinforge.config import Config
    from reinforge.protocol import Batch

    scored = Batch.from_dict(tensors={"rm_scores": torch.tensor([[0.0, 1.0], [2.0, 0.0]]),
                                      "rm_truncated": torch.tensor([True, False])})
    trainer = SimpleNamespace(reward_model=SimpleNamespace(compute_rm_score=lambda batch: scored), model_scorer=None,
                              config=Config(), rm_truncation_warned=False)
    batch = Batch.from_dict(tensors={"responses": torch.ones(2, 2, dtype=torch.long),
                                     "response_mask": torch.tensor([[1, 1], [1, 0]])})
    with caplog.at_level(logging.WARNING, logger=rl_trainer.logger.name):
        for _ in range(3):
            result = rl_trainer.RLTrainer.score(trainer, batch)
    warnings = [record.getMessage() for record in caplog.records if "reward.reward_model.max_length" in
                record.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(
        "1 of 2 reward-model inputs were longer than the reward model's limit, data.max_prompt_length + "
        "data.max_response_length (reward.reward_model.max_length is unset) and lost their end")
    assert "; set reward.reward_model.max_length above that sum (" in warnings[0]
    assert result.meta["reward_metrics"]["reward_model/truncated"] == 1.0
    assert result["token_level_scores"].sum(-1).tolist() == [1.0, 2.0]
