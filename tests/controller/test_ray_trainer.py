"""GRPO through the Ray backend gives the local backend's metrics, and survives a killed member.

The local run of one config is the reference for both tests; the Ray runs share the Ray instance
of this folder's tests (``ray_cluster``). Every member holds one of its four CPUs.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ray = pytest.importorskip("ray")

from reinforge.cli import main  # noqa: E402
from reinforge.config import load_config  # noqa: E402
from reinforge.controller import ResourcePool, RolePlacement, WorkerCallError  # noqa: E402
from reinforge.controller.ray_pool import _PLACED, release_all_pools  # noqa: E402
from reinforge.trainer.rl_trainer import RLTrainer  # noqa: E402

pytestmark = pytest.mark.slow

NOT_COMPARED = ("timing_s/", "perf/", "rollout/tokens_per_s")

LOWERCASE_SHARE = '''
def compute_score(solution_str, ground_truth, extra_info=None, **kwargs):
    return sum(character.islower() for character in solution_str) / max(1, len(solution_str))
'''
"""A reward that tells the tiny model's samples apart: GRPO's advantages are not zero, so the actor trains (the
arithmetic scorer gives its random answers 0 each, and a run of such steps stops as stalled)."""


@pytest.fixture(scope="module")
def reward_function(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reward") / "lowercase_share.py"
    path.write_text(LOWERCASE_SHARE)
    return f"{path}:compute_score"


def grpo_args(model: Path, data: Path, run_dir: Path, reward: str, **overrides: object) -> list[str]:
    """GRPO with a KL loss (so a reference policy) and a critic that trains alongside (critic/* metrics)."""
    settings = {
        "model.path": model, "data.train_files": f"[{data / 'train.parquet'}]", "data.train_batch_size": 2,
        "reward.custom_function": reward, "reward.num_workers": 1,  # a scorer process per reward worker (not 4)
        "data.max_prompt_length": 64, "data.max_response_length": 8, "rollout.n": 2,
        "algorithm.adv_estimator": "grpo", "actor.use_kl_loss": True, "critic.enable": True,
        "trainer.output_dir": run_dir, "trainer.loggers": "[jsonl]", "trainer.total_steps": 2,
        "trainer.save_every": 1, "trainer.val_before_train": False, "trainer.call_timeout_s": 120,
        "actor.optim.lr": 2e-3, "critic.optim.lr": 1e-3,
    }
    settings.update(overrides)
    return [f"{key}={value}" for key, value in settings.items()]


def read_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{key: value for key, value in row.items() if not key.startswith(NOT_COMPARED)} for row in rows]


def assert_same_metrics(actual: list[dict], expected: list[dict]) -> None:
    assert [row["step"] for row in actual] == [row["step"] for row in expected]
    for got, want in zip(actual, expected, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == (pytest.approx(value, rel=1e-4, abs=1e-5) if isinstance(value, float) else value), key


@pytest.fixture(scope="module")
def local_run(tiny_model_dir, arithmetic_data_dir, reward_function, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("local") / "run"
    assert main(["train", *grpo_args(tiny_model_dir, arithmetic_data_dir, run_dir, reward_function)]) == 0
    return run_dir


def last_logits(run_dir: Path) -> torch.Tensor:
    """The last checkpoint's exported model, loaded by transformers, on a few tokens."""
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_000002" / "hf").eval()
    with torch.no_grad():
        return model(torch.tensor([[3, 5, 7, 9, 11]])).logits


@pytest.fixture(scope="module")
def local_metrics(local_run) -> list[dict]:
    metrics = read_metrics(local_run)
    assert all(row["actor/grad_norm"] > 0 for row in metrics)  # the actor trains: its updates are compared too
    return metrics


def test_ray_backend_matches_local_with_colocated_actor_and_reference_and_a_critic_pool(
        ray_cluster, tiny_model_dir, arithmetic_data_dir, reward_function, tmp_path, local_run, local_metrics):
    """The actor's pool of two members shards its roles' models; the critic's pool of one member takes each step's
    samples whole, where the actor's pool splits them in two."""
    config = load_config(None, grpo_args(tiny_model_dir, arithmetic_data_dir, tmp_path / "run", reward_function,
                                         **{"trainer.backend": "ray"}))
    actor_pool, critic_pool = ResourcePool("actor", [2]), ResourcePool("critic", [1])
    placement = RolePlacement({"actor": actor_pool, "critic": critic_pool},
                              {"actor_rollout": "actor", "ref": "actor", "reward": "actor", "critic": "critic"})
    trainer = RLTrainer(config, placement)
    try:
        assert sorted(_PLACED["actor"].roles) == ["actor_rollout", "ref", "reward"]
        assert sorted(_PLACED["critic"].roles) == ["critic"]
        trainer.fit()
    finally:
        release_all_pools()
    assert_same_metrics(read_metrics(tmp_path / "run"), local_metrics)
    assert sorted(path.name for path in (tmp_path / "run" / "logs").iterdir()) == ["actor_rank0.log", "actor_rank1.log",
                                                                               "critic_rank0.log"]
    # the weights rank 0 gathered from the two members' shards are the one-process run's
    torch.testing.assert_close(last_logits(tmp_path / "run"), last_logits(local_run), rtol=1e-4, atol=1e-5)


def test_pools_the_cluster_cannot_hold_together_are_refused_before_any_model_loads(
        ray_cluster, tiny_model_dir, arithmetic_data_dir, reward_function, tmp_path):
    """Each pool fits the four CPUs alone, not both: the run stops at once, not after the actor loaded and the
    critic's pool waited trainer's startup deadline for devices the actor's pool holds."""
    config = load_config(None, grpo_args(tiny_model_dir, arithmetic_data_dir, tmp_path / "run", reward_function,
                                         **{"trainer.backend": "ray"}))
    placement = RolePlacement({"actor": ResourcePool("actor", [2]), "critic": ResourcePool("critic", [4])},
                              {"actor_rollout": "actor", "ref": "actor", "reward": "actor", "critic": "critic"})
    with pytest.raises(ValueError, match=r"the resource pools \('actor' 2, 'critic' 4\) need 6 CPU slots together, "
                                         r"but the Ray cluster's nodes hold 4 .*; lower trainer.devices_per_node"):
        RLTrainer(config, placement)
    assert _PLACED == {}
    assert not (tmp_path / "run" / "logs").exists()  # no member started


def test_more_members_than_the_cluster_holds_are_refused_before_the_memory_plan_splits_the_host_over_them(
        ray_cluster, tiny_model_dir, arithmetic_data_dir, reward_function, tmp_path):
    """8 CPU members on 8 GiB of host memory do not fit, and the cluster holds 4: the refusal names the cluster and
    trainer.devices_per_node, not a larger device."""
    config = load_config(None, grpo_args(tiny_model_dir, arithmetic_data_dir, tmp_path / "run", reward_function,
                                         **{"trainer.backend": "ray", "trainer.device": "cpu", "critic.enable": False,
                                            "trainer.devices_per_node": 8, "data.train_batch_size": 4,
                                            "trainer.host_memory_gib": 8}))
    with pytest.raises(ValueError, match=r"^resource pool 'global' cannot be placed: the Ray cluster's nodes hold 4 "
                                         r"CPU slots .* fewer than trainer.nnodes x trainer.devices_per_node = 8; lower "
                                         r"trainer.devices_per_node"):
        RLTrainer(config)
    assert _PLACED == {} and not (tmp_path / "run").exists()


def test_killed_member_stops_the_run_clearly_and_resume_continues_it(
        ray_cluster, tiny_model_dir, arithmetic_data_dir, reward_function, tmp_path, local_metrics, monkeypatch):
    monkeypatch.setenv("REINFORGE_DEBUG", "1")  # the exception itself is inspected, not the CLI's one-line report
    run_dir = tmp_path / "run"
    args = ["train", *grpo_args(tiny_model_dir, arithmetic_data_dir, run_dir, reward_function,
                                **{"trainer.backend": "ray"})]
    failure: list[BaseException] = []

    def train() -> None:
        try:
            main(args)
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            failure.append(error)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not (latest.is_file() and latest.read_text().strip() == "step_000001") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert latest.is_file(), "the Ray run did not reach its first checkpoint"
    os.kill(_PLACED["global"].members[0].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive() and time.monotonic() - killed_at < 30
    [error] = failure
    assert isinstance(error, WorkerCallError)
    message = str(error)
    assert "rank 0 of 1 raised in" in message and "MemberDiedError: the member process died" in message
    assert "runs on node" in message and "global_rank0.log" in message and "building" in message
    assert latest.read_text().strip() == "step_000001"
    release_all_pools()

    assert main(args) == 0
    release_all_pools()
    assert_same_metrics(read_metrics(run_dir), local_metrics)


def test_async_on_ray_with_two_members(ray_cluster, tiny_model_dir, arithmetic_data_dir, reward_function, tmp_path,
                                      local_metrics):
    """async at max_staleness=0 gives the local sync run's metrics on two FSDP members, the rollout copy synced on
    every member (sync_rollout_weights, ONE_TO_ALL). one_step_off on Ray, a version behind, is the next test's."""
    run_dir = tmp_path / "run"
    args = grpo_args(tiny_model_dir, arithmetic_data_dir, run_dir, reward_function, **{
        "trainer.backend": "ray", "trainer.devices_per_node": 2, "trainer.mode": "async", "trainer.max_staleness": 0,
        "rollout.segment_tokens": 4})
    try:
        assert main(["train", *args]) == 0
    finally:
        release_all_pools()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["async/staleness_max"] for row in rows] == [0.0, 0.0]
    compared = [{key: value for key, value in row.items() if not key.startswith("async/")}
                for row in read_metrics(run_dir)]
    assert_same_metrics(compared, local_metrics)


def test_one_step_off_with_a_rollout_worker_on_its_own_pool(ray_cluster, tiny_model_dir, arithmetic_data_dir,
                                                            reward_function, tmp_path):
    """trainer.separate_rollout on Ray: the rollout group has its own pool (its own process); weights reach it
    from the actor at every sync, and the run trains one version behind as on one worker."""
    config = load_config(None, grpo_args(tiny_model_dir, arithmetic_data_dir, tmp_path / "run", reward_function, **{
        "trainer.backend": "ray", "trainer.mode": "one_step_off", "trainer.separate_rollout": True}))
    train_pool, rollout_pool = ResourcePool("train", [1]), ResourcePool("gen", [1])
    placement = RolePlacement({"train": train_pool, "gen": rollout_pool},
                              {"actor_rollout": "train", "ref": "train", "reward": "train", "critic": "train",
                               "rollout": "gen"})
    trainer = RLTrainer(config, placement)
    try:
        assert sorted(_PLACED["gen"].roles) == ["rollout"]
        trainer.fit()
    finally:
        release_all_pools()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]
    assert [row["async/staleness_max"] for row in rows] == [0.0, 1.0]
    assert all("rollout_corr/rollout_is_mean" in row for row in rows[1:])
    assert all(row["actor/num_skipped_steps"] == 0 for row in rows)  # no non-finite gradient
