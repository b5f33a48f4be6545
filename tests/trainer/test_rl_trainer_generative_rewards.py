"""GRPO with a judge (the policy itself, or a model of its own) or a remote endpoint as the reward, and their
refusals before any model loads."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import reinforge.trainer.rl_trainer as rl_trainer
from reinforge.cli import main

TEMPLATE = "Is this right? {prompt} = {response} (ref {ground_truth}). Answer Y or N:"


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


class NoModelsHere:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a model started loading before the judge settings were checked")


@pytest.mark.slow
@pytest.mark.parametrize("judge", ["policy", "own model"])
def test_grpo_trains_with_a_yes_no_judge(rl_args, tiny_model_dir, tmp_path, judge):
    run_dir = tmp_path / "run"
    args = rl_args(run_dir, **{"trainer.total_steps": 1, "reward.judge.enable": True,
                               "reward.judge.model_path": "policy" if judge == "policy" else tiny_model_dir,
                               "reward.judge.template": f"'{TEMPLATE}'", "reward.judge.parse": "yes_no",
                               "reward.judge.yes_token": "Y", "reward.judge.no_token": "N"})
    assert main(["train", *args]) == 0
    [metrics] = metrics_of(run_dir)
    assert metrics["reward/judge/calls"] == 16 and metrics["reward/judge/malformed"] == 0
    assert 0 < metrics["critic/score/min"] < metrics["critic/score/max"] < 1  # probabilities, one per sample
    assert metrics["critic/score/mean"] == pytest.approx(metrics["reward/judge/score/mean"], abs=1e-6)
    assert metrics["timing_s/judge"] > 0 and "actor/pg_loss" in metrics


@pytest.mark.slow
def test_a_judge_whose_answers_never_parse_stops_the_run(rl_args, tmp_path, capsys):
    args = rl_args(tmp_path / "run", **{"trainer.total_steps": 1, "reward.judge.enable": True,
                                        "reward.judge.model_path": "policy", "reward.judge.template": f"'{TEMPLATE}'",
                                        "reward.judge.max_tokens": 4, "reward.judge.marker": "Score:"})
    assert main(["train", *args]) != 0
    assert "none of the judge's 16 answers has a number after 'Score:' (reward.judge.parse=marker)" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_grpo_trains_with_a_remote_reward_summed_with_the_rule(rl_args, tmp_path, monkeypatch):
    received, keys = [], []
    monkeypatch.setenv("REWARD_ENDPOINT_KEY", "secret-123")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(body)
            keys.append(self.headers.get("Authorization"))
            data = json.dumps({"scores": [len(query) / 100 for query in body["query"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        run_dir = tmp_path / "run"
        url = f"http://127.0.0.1:{httpd.server_address[1]}/get_reward"
        args = rl_args(run_dir, **{"trainer.total_steps": 1, "reward.remote.enable": True, "reward.remote.url": url,
                                   "reward.remote.batch_size": 5, "reward.combine.mode": "sum",
                                   "reward.remote.api_key_env": "REWARD_ENDPOINT_KEY"})
        assert main(["train", *args]) == 0
    finally:
        httpd.shutdown()
    [metrics] = metrics_of(run_dir)
    assert metrics["reward/remote/requests"] == 4 and metrics["reward/remote/failed"] == 0
    assert sum(len(body["query"]) for body in received) == 16
    assert all(label is not None for body in received for label in body["labels"])  # the rows' ground truths
    assert keys == ["Bearer secret-123"] * 4
    assert "secret-123" not in (run_dir / "config.yaml").read_text()  # the key stays in the environment


@pytest.mark.parametrize("overrides, line", [
    ({"reward.judge.enable": True, "reward.judge.model_path": "policy"},
     "error: reward.judge.enable=true but reward.judge.template is not set"),
    ({"reward.judge.enable": True, "reward.judge.model_path": "policy", "reward.judge.template": "'{prompt}'"},
     "error: reward.judge.template never shows the judge the response: add {response} where it goes"),
    ({"reward.judge.enable": True, "reward.judge.model_path": "policy", "reward.judge.template": "'{response}'",
      "reward.judge.parse": "yes_no"},
     "error: reward.judge.yes_token='Yes' is 3 tokens of the judge's vocabulary"),
    ({"reward.judge.enable": True, "reward.judge.model_path": "policy", "reward.judge.template": "'{response}'",
      "trainer.mode": "one_step_off"},
     "error: reward.judge.model_path=policy judges with the policy's own engine, which trainer.mode=one_step_off"),
    ({"reward.judge.enable": True, "reward.judge.model_path": "policy", "reward.judge.template": "'{response}'",
      "rollout.name": "native", "reward.judge.max_tokens": 72},
     "error: reward.judge.max_tokens=72 leaves the judge's prompts no room in the policy's native engine"),
    ({"reward.remote.enable": True}, "error: reward.remote.enable=true but reward.remote.url is not set"),
    ({"reward.remote.enable": True, "reward.remote.url": "http://a", "reward.remote.api_key_env": "REINFORGE_NO_SUCH_KEY"},
     "error: reward.remote.api_key_env=REINFORGE_NO_SUCH_KEY but the environment variable REINFORGE_NO_SUCH_KEY is not "
     "set; export REINFORGE_NO_SUCH_KEY=<the endpoint's key> before the run"),
    ({"reward.remote.enable": True, "reward.remote.url": "http://a", "reward.remote.api_key_env": "sk-live-1"},
     "error: reward.remote.api_key_env='sk-live-1' is not the name of an environment variable"),
    ({"reward.remote.enable": True, "reward.remote.url": "http://a", "reward.judge.enable": True},
     "error: reward.judge.enable and reward.remote.enable are both true"),
])
def test_judge_and_remote_settings_are_refused_before_any_model(rl_args, tmp_path, monkeypatch, capsys, overrides,
                                                                line):
    monkeypatch.setattr(rl_trainer, "ActorRolloutWorker", NoModelsHere)
    assert main(["train", *rl_args(tmp_path / "run", **overrides)]) == 2
    [error] = capsys.readouterr().err.strip().splitlines()
    assert error.startswith(line)


def test_a_judge_without_the_chat_template_it_is_asked_to_use_is_warned_about(tiny_model_dir, tmp_path, caplog):
    import shutil

    from reinforge.config import load_config
    from reinforge.trainer.preflight import check_judge_settings

    base_model = shutil.copytree(tiny_model_dir, tmp_path / "base")
    (base_model / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((base_model / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (base_model / "tokenizer_config.json").write_text(json.dumps(settings))
    judge = [f"model.path={tiny_model_dir}", "reward.judge.enable=true", f"reward.judge.model_path={base_model}",
             f"reward.judge.template='{TEMPLATE}'"]
    with caplog.at_level("WARNING"):
        check_judge_settings(load_config(None, judge))
    [warning] = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warning.startswith(f"reward.judge.chat_template=true, but the judge at {base_model} has no chat template")
    caplog.clear()
    with caplog.at_level("WARNING"):
        check_judge_settings(load_config(None, [*judge, "reward.judge.chat_template=false"]))
        check_judge_settings(load_config(None, [*judge[:2], f"reward.judge.model_path={tiny_model_dir}", judge[3]]))
    assert not [record for record in caplog.records if record.levelname == "WARNING"]


def timed_out(*args, **kwargs):
    from reinforge.controller import WorkerTimeoutError

    raise WorkerTimeoutError("deadline")


def judge_that_times_out():
    """The policy as a yes/no judge whose every call times out, its config, and a batch of two samples to judge."""
    import sys
    from types import SimpleNamespace

    from reinforge.config.schema import Config
    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.trainer.generative_rewards import JudgeScorer

    call = SimpleNamespace(with_timeout=lambda seconds: timed_out)
    config = Config()
    config.reward.judge.enable, config.reward.judge.model_path, config.reward.judge.parse = True, "policy", "yes_no"
    config.reward.judge.template = "Is {response} right for {prompt}? Answer Y or N."
    config.reward.judge.yes_token, config.reward.judge.no_token = "Y", "N"
    tokenizer = build_char_tokenizer()
    scorer = JudgeScorer(config, SimpleNamespace(compute_log_prob=call, generate=call), tokenizer)
    sys.path.insert(0, str(Path(__file__).parents[1] / "reward"))
    from test_judge import policy_batch

    return scorer, config, policy_batch(tokenizer, ["2+2?", "3*3?"], ["4", "it is 8"])


def test_a_judge_that_times_out_on_every_sample_three_steps_in_a_row_stops_the_run():
    """A batch scored only by fallbacks teaches nothing: once is a warning, three steps in a row end the run."""
    scorer, _, batch = judge_that_times_out()
    for _ in range(2):
        scores, metrics = scorer(batch, step=1)
        assert metrics["reward/judge/timeouts"] == len(batch)
    with pytest.raises(RuntimeError, match="on every sample of 3 steps in a row"):
        scorer(batch, step=3)


def test_a_run_shorter_than_three_steps_whose_judge_timed_out_on_every_call_does_not_end_as_a_success(monkeypatch):
    """Each step of a two-step run scored only fallbacks: the run ends in one line, not as a success."""
    from types import SimpleNamespace

    from reinforge.protocol import Batch

    scorer, config, batch = judge_that_times_out()
    trainer = rl_trainer.RLTrainer.__new__(rl_trainer.RLTrainer)
    trainer.config, trainer.mode, trainer.step, trainer.model_scorer = config, None, 0, scorer

    def run_steps(next_batch, **kwargs):
        for step in (1, 2):
            scorer(batch, step)
        return {}

    monkeypatch.setattr(trainer, "resume", lambda: None, raising=False)
    monkeypatch.setattr(trainer, "run_steps", run_steps, raising=False)
    monkeypatch.setattr(trainer, "close", lambda wait_s=None: None, raising=False)
    with pytest.raises(RuntimeError, match="timed out on every sample of each of the run's 2 judge calls"):
        trainer.fit()

    def answered(judge_batch):
        return Batch.from_dict(tensors={"old_log_probs": torch.zeros(len(judge_batch), 1)})

    calls = iter([timed_out, answered])  # a second run: the judge timed out once, then answered
    scorer.judge = SimpleNamespace(compute_log_prob=SimpleNamespace(with_timeout=lambda seconds: next(calls)))
    scorer.timeouts_in_a_row = 0
    assert trainer.fit() == {}


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_the_policys_native_engine_judges_prompts_cut_to_what_its_sequences_hold(engine, caplog):
    """The policy judging itself on the native engine generates in sequences of data.max_prompt_length +
    data.max_response_length tokens, which refuses a longer prompt: each judge prompt keeps its last tokens, so the
    judge has reward.judge.max_tokens of room to answer (counted in reward/judge/prompts_cut, one warning line)."""
    import sys
    from types import SimpleNamespace

    from reinforge.config.schema import Config
    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.protocol import Batch
    from reinforge.trainer.generative_rewards import JudgeScorer

    seen = []

    def generate(prompts, sampling, seed):
        seen.append(int(prompts["attention_mask"].sum(-1).max()))
        answer = torch.tensor([tokenizer.encode("Score: 7", add_special_tokens=False)] * len(prompts))
        return Batch.from_dict(tensors={"responses": answer, "response_mask": torch.ones_like(answer)})

    config = Config()
    config.rollout.name = engine
    config.data.max_prompt_length, config.data.max_response_length = 64, 8
    settings = config.reward.judge
    settings.enable, settings.model_path, settings.max_tokens, settings.chat_template = True, "policy", 4, False
    settings.template = "Judge carefully. " * 8 + "{prompt} = {response}"
    tokenizer = build_char_tokenizer()
    judge = SimpleNamespace(generate=SimpleNamespace(with_timeout=lambda seconds: generate))
    with caplog.at_level("WARNING"):
        scorer = JudgeScorer(config, judge, tokenizer)
    sys.path.insert(0, str(Path(__file__).parents[1] / "reward"))
    from test_judge import policy_batch

    scores, metrics = scorer(policy_batch(tokenizer, ["2+2?", "3*3?"], ["4", "it is 8"]), step=1)
    assert scores.tolist() == [7.0, 7.0]
    if engine == "hf":  # no limit of its own: the judge reads the whole prompt
        assert seen == [len("Judge carefully. " * 8 + "3*3? = it is 8")] and metrics["reward/judge/prompts_cut"] == 0
        assert not caplog.records
        return
    assert seen == [64 + 8 - 4] and metrics["reward/judge/prompts_cut"] == 2
    [warning] = [record.getMessage() for record in caplog.records]
    assert warning.startswith("reward.judge.max_prompt_length=2048 is cut to 68 tokens")


def test_a_judge_template_showing_a_ground_truth_the_rows_lack_is_refused_or_warned_about(rl_args, tmp_path,
                                                                                          monkeypatch, capsys, caplog):
    """{ground_truth} in the template where no row has one: the judge would read an empty reference answer for every
    sample, refused before any model loads; where some rows lack it, one warning line."""
    rows = tmp_path / "rows.jsonl"
    lines = [{"prompt": [{"role": "user", "content": f"say hi {index}"}], "data_source": "chat"} for index in range(8)]
    rows.write_text("".join(json.dumps(line) + "\n" for line in lines))
    judge = {"reward.judge.enable": True, "reward.judge.model_path": "policy",
             "reward.judge.template": "'{prompt} {response} (ref {ground_truth}) Score:'"}
    monkeypatch.setattr(rl_trainer, "ActorRolloutWorker", NoModelsHere)
    assert main(["train", *rl_args(tmp_path / "run", **judge, **{"data.train_files": f"[{rows}]"})]) == 2
    [error] = capsys.readouterr().err.strip().splitlines()
    assert error.startswith(f"error: no row of {rows} has a ground truth (reward_model.ground_truth or a ground_truth "
                            "column), which reward.judge.template shows ({ground_truth})")
    lines[3]["reward_model"] = {"ground_truth": "hi"}
    rows.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with caplog.at_level("WARNING"):  # checked: on to the workers (which the stand-in refuses to start)
        assert main(["train", *rl_args(tmp_path / "run2", **judge, **{"data.train_files": f"[{rows}]"})]) == 1
    assert any(record.getMessage().startswith("7 of 8 rows of the training data have no ground truth, which "
                                              "reward.judge.template shows") for record in caplog.records)
