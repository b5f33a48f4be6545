"""trainer.mode=one_step_off end to end on the tiny model: it trains one version behind with the decoupled loss,
and a resumed run trains the batch its checkpoint generated ahead, as the uninterrupted run did."""

from __future__ import annotations

import json

import pytest
import torch

from .test_async_mode import final_actor_weights, reproduced, run


@pytest.mark.parametrize("separate_rollout", [False, True])
def test_one_step_off_trains_one_version_behind_with_truncated_importance_weights(
        tiny_model_dir, arithmetic_data_dir, tmp_path, separate_rollout):
    rows = run(tiny_model_dir, arithmetic_data_dir, tmp_path / "run", **{
        "trainer.mode": "one_step_off", "trainer.separate_rollout": separate_rollout})
    assert [row["async/staleness_max"] for row in rows] == [0.0, 1.0, 1.0]
    assert "rollout_corr/rollout_is_mean" not in rows[0]  # the first batch is on-policy
    for row in rows[1:]:
        assert 0 < row["rollout_corr/rollout_is_mean"] and row["rollout_corr/rollout_is_max"] <= 2.0
        assert "timing_s/old_log_prob" not in row or row["timing_s/old_log_prob"] >= 0
        assert row["actor/num_skipped_steps"] == 0  # a non-finite gradient would be skipped and counted here


def test_the_loglinear_proximal_policy_of_one_step_off_ignores_the_async_sync_interval(
        tiny_model_dir, arithmetic_data_dir, tmp_path):
    """one_step_off syncs after every update: trainer.trigger_sync_steps, an async setting, changes nothing."""
    runs = [run(tiny_model_dir, arithmetic_data_dir, tmp_path / f"run-{trigger}", **{
        "trainer.mode": "one_step_off", "trainer.proximal": "loglinear", "trainer.trigger_sync_steps": trigger,
        "actor.entropy_coeff": 0.5}) for trigger in (1, 2)]
    for every, second in zip(*runs, strict=True):
        for key in ("actor/ppo_kl", "actor/pg_loss", "actor/grad_norm"):
            assert second[key] == every[key], key
        assert all(value == value and abs(value) != float("inf") for value in second.values()
                   if isinstance(value, float))


def test_a_resumed_one_step_off_run_trains_the_same_batches_as_an_uninterrupted_one(tiny_model_dir,
                                                                                    arithmetic_data_dir, tmp_path):
    """The checkpoint holds the batch generated ahead, by the weights before its last update: the resumed run trains
    it one version stale, as the uninterrupted run does, to the same metrics, samples and weights."""
    settings = {"trainer.mode": "one_step_off", "trainer.num_logged_samples": 16, "trainer.total_steps": 4}
    whole = run(tiny_model_dir, arithmetic_data_dir, tmp_path / "whole", **settings)
    resumed = tmp_path / "resumed"
    run(tiny_model_dir, arithmetic_data_dir, resumed, **{**settings, "trainer.total_steps": 2})
    state = torch.load(resumed / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)["mode"]
    assert state["pending"]["version"] == 1 and len(state["pending"]["generated"]) == 16  # 4 prompts x 4 samples
    rows = run(tiny_model_dir, arithmetic_data_dir, resumed, **settings)
    assert [row["async/staleness_max"] for row in rows] == [0.0, 1.0, 1.0, 1.0]
    assert reproduced(rows) == reproduced(whole)
    for name in ("samples.jsonl", "metrics.jsonl"):
        assert [json.loads(line)["step"] for line in (resumed / name).read_text().splitlines()] == \
            [json.loads(line)["step"] for line in (tmp_path / "whole" / name).read_text().splitlines()]
    assert (resumed / "samples.jsonl").read_text() == (tmp_path / "whole" / "samples.jsonl").read_text()
    weights = [final_actor_weights(run_dir) for run_dir in (tmp_path / "whole", resumed)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


class _Group:
    def __init__(self):
        self.shut_down = False

    def shutdown(self, wait_s):
        self.shut_down = True


class _Tracker:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_a_failed_generation_ahead_leaves_the_trainer_free_to_shut_its_workers_down():
    """The batch generated ahead failed (its error is the run's, raised by next_batch): stopping the mode must not
    raise it again from the trainer's close, which then skipped the worker groups' shutdown and the trackers."""
    from concurrent.futures import Future

    from reinforge.trainer.modes.one_step_off import OneStepOffMode
    from reinforge.trainer.rl_trainer import RLTrainer

    failed: Future = Future()
    failed.set_exception(RuntimeError("the rollout worker died"))
    mode = OneStepOffMode(None, None)  # stop() needs neither the config nor the calls
    mode._pending = (None, failed, 0, 0.0)
    trainer = object.__new__(RLTrainer)
    trainer.mode, trainer.actor_rollout, trainer.tracker = mode, _Group(), _Tracker()
    trainer.close()
    assert trainer.actor_rollout.shut_down and trainer.tracker.closed


def test_a_generation_ahead_that_does_not_end_within_the_stops_wait_is_abandoned_and_the_line_says_so(monkeypatch):
    """Ctrl-C while the batch ahead generates (minutes at long responses): the trainer's close waits wait_s for it,
    not without limit, shuts the groups down, and the run's last line says the generation was abandoned."""
    import threading
    import time
    from concurrent.futures import Future

    from reinforge import stop_signals
    from reinforge.trainer.modes.one_step_off import OneStepOffMode
    from reinforge.trainer.rl_trainer import RLTrainer

    monkeypatch.setattr(stop_signals, "stop_signal", ["SIGTERM"])
    monkeypatch.setattr(stop_signals, "abandoned", [])
    generation = Future()
    ends = threading.Timer(10.0, generation.set_result, [None])  # long after the stop's wait
    ends.daemon = True
    ends.start()
    mode = OneStepOffMode(None, None)
    mode._pending = (None, generation, 0, 0.0)
    trainer = object.__new__(RLTrainer)
    trainer.mode, trainer.actor_rollout, trainer.tracker = mode, _Group(), _Tracker()
    start = time.monotonic()
    trainer.close(wait_s=0.05)
    ends.cancel()
    assert time.monotonic() - start < 5
    assert trainer.actor_rollout.shut_down and trainer.tracker.closed and mode._pending is None
    assert stop_signals.stopped_message() == (
        "stopped by SIGTERM: the run keeps its latest checkpoint (the generation under way did not end within 0.05 s "
        "and was abandoned; nothing of it is saved); run the same command to resume (a second Ctrl-C exits at once)")


def test_a_lowered_max_response_length_is_refused_when_the_batch_generated_ahead_is_longer():
    """The checkpoint's batch generated ahead is trained as it is: with a lower limit it trained longer responses."""
    from reinforge.protocol import Batch
    from reinforge.rollout.base import SamplingParams
    from reinforge.trainer.modes.one_step_off import OneStepOffMode
    from reinforge.trainer.modes.trainer_calls import TrainerCalls

    def calls(max_tokens: int) -> TrainerCalls:
        return TrainerCalls(next_prompts=None, generate=None, score=None, compute_log_prob=None, train_on_batch=None,
                            sync_rollout_weights=None, trained_steps=None, sampling=SamplingParams(max_tokens=max_tokens),
                            pad_token_id=0, run_dir=None)

    generated = Batch.from_dict(tensors={"responses": torch.zeros(2, 8, dtype=torch.long)})
    state = {"version": 1, "drawn": 2, "pending": {"batch": None, "generated": generated, "version": 0}}
    OneStepOffMode(None, calls(8)).load_state_dict(state, 1)
    with pytest.raises(ValueError, match=r"^data.max_response_length=4 but the checkpoint's batch generated ahead has "
                                         r"responses of up to 8 tokens"):
        OneStepOffMode(None, calls(4)).load_state_dict(state, 1)
