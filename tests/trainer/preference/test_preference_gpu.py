"""The preference trainers on CUDA: bf16 compute, fused kernels, compiled layers and flash varlen attention."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from reinforge.cli import main
from reinforge.data.preference_dataset import PreferenceKeys, collate_pairs, tokenize_pair
from reinforge.engine.forward import response_log_probs
from reinforge.engine.fsdp import shard_model
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.packing import attach_plan
from reinforge.models import load_causal_lm, load_tokenizer

pytestmark = pytest.mark.gpu


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_packed_pair_scores_as_its_two_sequences_apart_in_bf16(tiny_model_dir):
    device = torch.device("cuda")
    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=device)
    prepare_for_training(model, device)
    shard_model(model, device, "bfloat16")
    row = {"prompt": [{"role": "user", "content": "question 3?"}], "chosen": [{"role": "assistant", "content": "yes"}],
           "rejected": [{"role": "assistant", "content": "no, sorry"}]}
    pair = tokenize_pair(tokenizer, row, PreferenceKeys())
    batch = attach_plan(collate_pairs([pair], [0], tokenizer.pad_token_id), share_prompts=True)
    with torch.no_grad():
        together, _ = response_log_probs(model, batch.to(device))
        apart = [response_log_probs(model, attach_plan(batch.index([row]), share_prompts=False).to(device))[0][0]
                 for row in range(2)]
    for row in range(2):
        torch.testing.assert_close(together[row], apart[row], atol=2e-2, rtol=2e-2)


def test_rm_and_dpo_train_on_cuda_in_bf16(pair_args, tmp_path):
    cuda = {"trainer.device": "cuda", "model.dtype": "bfloat16"}
    assert main(["rm", *pair_args(tmp_path / "rm", **cuda)]) == 0
    assert all(math.isfinite(record["train/loss"]) for record in metrics_of(tmp_path / "rm"))
    assert main(["dpo", *pair_args(tmp_path / "dpo", **cuda, **{"model.gradient_checkpointing": True})]) == 0
    first, last = metrics_of(tmp_path / "dpo")
    assert first["train/loss"] == pytest.approx(math.log(2), abs=2e-2)  # the policy is its reference at step 1
    assert last["train/loss"] < first["train/loss"]


def test_the_reference_pass_compiles_the_graphs_the_training_step_runs(pair_args, tmp_path):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from reinforge.config.preference_schema import load_dpo_config
    from reinforge.trainer.preference.dpo_trainer import DPOTrainer

    torch._dynamo.reset()
    counters.clear()
    config = load_dpo_config(None, pair_args(tmp_path / "dpo", **{"trainer.device": "cuda",
                                                                   "model.dtype": "bfloat16"}))
    trainer = DPOTrainer(config)
    try:
        trainer.resume()  # the reference pass, then the checkpoint (none here)
        compiled = counters["stats"]["unique_graphs"]
        assert compiled > 0  # the decoder layers, norms and gates of the reference pass
        trainer.train_step(trainer.train_loader.next_batch())
        assert counters["stats"]["unique_graphs"] == compiled
    finally:
        trainer.tracker.close()
        trainer.release_run_folder()


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_validation_runs_the_training_graphs_and_compiles_nothing_of_its_own(pair_args, pairs_dir, tmp_path, command):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from reinforge.config.preference_schema import load_dpo_config, load_rm_config
    from reinforge.trainer.preference.dpo_trainer import DPOTrainer
    from reinforge.trainer.preference.rm_trainer import RewardModelTrainer

    torch._dynamo.reset()
    counters.clear()
    load, trainer_class = (load_dpo_config, DPOTrainer) if command == "dpo" else (load_rm_config, RewardModelTrainer)
    config = load(None, pair_args(tmp_path / command, **{"trainer.device": "cuda", "model.dtype": "bfloat16",
                                                         "data.val_files": f"[{pairs_dir / 'val.jsonl'}]"}))
    trainer = trainer_class(config)
    try:
        trainer.resume()  # dpo scores its reference first
        trainer.train_step(trainer.train_loader.next_batch())
        compiled = counters["stats"]["unique_graphs"]
        metrics = trainer.validate()
        assert counters["stats"]["unique_graphs"] == compiled
        assert all(math.isfinite(value) for value in metrics.values()) and trainer.model.training
    finally:
        trainer.tracker.close()
        trainer.release_run_folder()


def test_the_plan_sizes_micro_batches_for_the_device_and_logs_one_line(pair_args, tmp_path, caplog):
    from reinforge.config.preference_schema import load_dpo_config
    from reinforge.trainer.preference.dpo_trainer import DPOTrainer

    config = load_dpo_config(None, pair_args(tmp_path / "dpo", **{"trainer.device": "cuda", "model.dtype": "bfloat16",
                                                                   "trainer.max_tokens_per_micro_batch": "auto"}))
    with caplog.at_level("INFO"):
        trainer = DPOTrainer(config)
    try:
        assert trainer.memory_plan.plan is not None and isinstance(config.trainer.max_tokens_per_micro_batch, int)
        assert config.model.gradient_checkpointing is False  # a tiny model fits any GPU whole
        [line] = [record.getMessage() for record in caplog.records if record.getMessage().startswith("memory plan")]
        assert line == trainer.memory_plan.line and "\n" not in line
    finally:
        trainer.tracker.close()
        trainer.release_run_folder()


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_the_reward_model_trains_sharded_with_compiled_layers_in_bf16(pair_args, tmp_path, lora):
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import AutoModelForSequenceClassification

    torch._dynamo.reset()
    counters.clear()
    run_dir = tmp_path / "rm"
    settings = {"trainer.device": "cuda", "model.dtype": "bfloat16", "model.lora.rank": lora, "model.lora.alpha": 8,
                "trainer.total_steps": 3, "optim.lr": 1e-2}
    assert main(["rm", *pair_args(run_dir, **settings)]) == 0
    assert counters["stats"]["unique_graphs"] > 0  # the decoder layers ran compiled
    records = metrics_of(run_dir)
    assert all(math.isfinite(record["train/loss"]) and 0 < record["train/grad_norm"] < math.inf for record in records)
    folder = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "hf"
    AutoModelForSequenceClassification.from_pretrained(folder)  # what reward.reward_model loads


def test_a_step_in_many_micro_batches_with_parameters_kept_gathered_equals_one_in_one(pair_args, tmp_path):
    from reinforge.config.preference_schema import load_dpo_config
    from reinforge.trainer.preference.dpo_trainer import DPOTrainer

    grad_norms = []
    for budget in (96, 4096):
        config = load_dpo_config(None, pair_args(tmp_path / str(budget), **{
            "trainer.device": "cuda", "model.dtype": "bfloat16", "trainer.total_steps": 1, "data.shuffle": False,
            "trainer.max_tokens_per_micro_batch": budget}))
        trainer = DPOTrainer(config)
        assert trainer.memory_plan.keep_gathered  # one GPU with room: gathered once, gradients reduced once a step
        grad_norms.append(trainer.fit()["train/grad_norm"])
    assert grad_norms[0] == pytest.approx(grad_norms[1], rel=2e-2)
