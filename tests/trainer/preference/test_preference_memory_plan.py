"""The memory plan of rm and dpo runs: the micro-batch budget and recompute for the device, model and pairs, the
one-line refusal before the model loads, and micro-batches of whole pairs, as few and as even as the budget allows."""

from __future__ import annotations

import functools

import pytest
import torch

from reinforge.bench.shapes import SHAPES
from reinforge.cli import main
from reinforge.config.preference_schema import load_dpo_config, load_rm_config
from reinforge.data.preference_dataset import PreferencePair, collate_pairs
from reinforge.engine.memory_plan import GiB, MemoryPlanError, ModelShape
from reinforge.trainer.preference import pairs as pairs_module
from reinforge.trainer.preference.memory_plan import (
    PairShape,
    apply_preference_plan,
    estimate_pairs,
    micro_batches_of,
    plan_pairs,
    step_cost,
)
from reinforge.trainer.preference.pairs import pair_micro_batches

QWEN_1_5B = ModelShape.from_hf_config(SHAPES["1.5b"].config)
STANDARD = PairShape(pairs=64, prompt_length=128, completion_length=512)
"""The bench workload: 64 pairs a step of a 128-token prompt and two 512-token completions."""


def test_more_device_memory_never_gives_more_micro_batches_or_more_recompute():
    plans = [plan_pairs(QWEN_1_5B, STANDARD, {}, gib * GiB) for gib in (32, 40, 48, 64, 80, 96, 120, 141)]
    costs = [step_cost(QWEN_1_5B, STANDARD, plan.settings) for plan in plans]
    assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1] == 0.0
    counts = [micro_batches_of(STANDARD, plan.settings.micro_batch_tokens)[0] for plan in plans]
    recomputed = [plan.settings.checkpoint_layers for plan in plans]
    for smaller in range(len(plans)):  # a larger device never cuts more micro-batches and recomputes more layers
        for larger in range(smaller + 1, len(plans)):
            assert counts[larger] <= counts[smaller] or recomputed[larger] < recomputed[smaller]
            assert recomputed[larger] <= recomputed[smaller] or counts[larger] < counts[smaller]
    assert all(plan.peak[1] <= plan.gpu_budget for plan in plans)
    # an H200 holds the whole workload in two micro-batches of 32 pairs, no layer recomputed, logits kept
    h200 = plans[-1].settings
    assert (micro_batches_of(STANDARD, h200.micro_batch_tokens), h200.checkpoint_layers) == ((2, 32 * 1152), 0)
    assert h200.logits_buffer_gib > 0


def test_a_tight_device_recomputes_every_layer():
    tight = plan_pairs(QWEN_1_5B, STANDARD, {}, 40 * GiB).settings
    assert tight.checkpoint_layers == QWEN_1_5B.num_layers


def test_a_run_that_cannot_fit_is_refused_in_one_line_naming_the_fix():
    with pytest.raises(MemoryPlanError) as error:
        plan_pairs(QWEN_1_5B, STANDARD, {}, 24 * GiB)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("the dpo run does not fit the device: pairs of up to 128 + 2 x 512 tokens need ")
    assert "optimizer state" in message and message.endswith(
        "it would fit with model.lora.rank=32 or 2 devices (torchrun --nproc_per_node)")


def test_a_budget_the_user_set_that_cannot_fit_is_refused_with_auto_as_the_fix():
    given = {"micro_batch_tokens": 65536, "checkpoint_layers": 0}
    with pytest.raises(MemoryPlanError) as error:
        plan_pairs(QWEN_1_5B, STANDARD, given, 80 * GiB)
    assert str(error.value).endswith(
        "it would fit with trainer.max_tokens_per_micro_batch=auto and model.gradient_checkpointing=auto")


def test_a_reward_model_keeps_no_logits_and_a_loaded_reference_has_a_phase_of_its_own_before_any_optimizer_state():
    settings = plan_pairs(QWEN_1_5B, STANDARD, {}, 141 * GiB).settings
    reward = estimate_pairs(QWEN_1_5B, PairShape(64, 128, 512, vocabulary_logits=False), settings)
    assert "logits" not in reward["update"] and set(reward) == {"update"}
    dpo = estimate_pairs(QWEN_1_5B, PairShape(64, 128, 512, reference_model=True), settings)
    reference = dpo["reference pass"]
    assert "gradients" not in reference and reference["reference model"] == 4 * QWEN_1_5B.num_params
    assert "optimizer state" not in reference  # a resumed run scores before its checkpoint's state loads


def test_the_plan_is_applied_to_the_configs_auto_settings_only(pair_args, tmp_path):
    pairs = [PreferencePair([1] * 100, [2] * 400, [3] * 300)]
    config = load_dpo_config(None, pair_args(tmp_path / "run", **{"trainer.max_tokens_per_micro_batch": "auto",
                                                                   "data.max_length": 512}))
    on_cpu = apply_preference_plan(config, pairs, torch.device("cpu"), 1)
    assert config.trainer.max_tokens_per_micro_batch == 16384 and on_cpu.plan is None  # the CPU's fixed budget
    assert config.model.gradient_checkpointing == "auto"
    config.trainer.max_tokens_per_micro_batch = "auto"
    planned = apply_preference_plan(config, pairs, torch.device("cpu"), 1, gpu_bytes=8 * GiB)
    # a step of 8 pairs of up to 900 tokens takes one micro-batch of the largest budget
    assert planned.plan is not None and config.trainer.max_tokens_per_micro_batch == 65536
    assert config.model.gradient_checkpointing is False
    assert planned.line.startswith("memory plan: trainer.max_tokens_per_micro_batch=65536 (auto; 1 micro-batch(es) a "
                                   "step of up to 7200 tokens, 8 pairs of up to 100 + 2 x 400), "
                                   "model.gradient_checkpointing=False (auto), logits kept, parameters kept gathered "
                                   "for the backward; peak ")
    rm = load_rm_config(None, pair_args(tmp_path / "rm", **{"trainer.max_tokens_per_micro_batch": 2048,
                                                            "model.gradient_checkpointing": True}))
    apply_preference_plan(rm, pairs, torch.device("cpu"), 1, gpu_bytes=8 * GiB)
    assert (rm.trainer.max_tokens_per_micro_batch, rm.model.gradient_checkpointing) == (2048, True)


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_a_run_that_cannot_fit_fails_before_its_model_loads_and_frees_its_folder(pair_args, tmp_path, monkeypatch,
                                                                                 capsys, command):
    monkeypatch.setattr(pairs_module, "apply_preference_plan",
                        functools.partial(apply_preference_plan, gpu_bytes=2**20))  # a 1 MiB device
    monkeypatch.setattr(pairs_module.PreferenceRun, "load_model", lambda self: pytest.fail("the model loaded"))
    args = pair_args(tmp_path / "run", **{"trainer.max_tokens_per_micro_batch": "auto"})
    for _ in range(2):  # the run folder's lock is released: the same command runs again
        assert main([command, *args]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: the {command} run does not fit the device: pairs of up to ")


def test_budgets_that_are_no_number_are_refused_as_the_config_loads():
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch='most' must be a number of tokens or auto"):
        load_dpo_config(None, ["trainer.max_tokens_per_micro_batch=most"])
    assert load_dpo_config(None, []).trainer.max_tokens_per_micro_batch == "auto"


def _pairs_batch(lengths: list[tuple[int, int, int]]):
    pairs = [PreferencePair([1] * prompt, [2] * chosen, [3] * rejected) for prompt, chosen, rejected in lengths]
    return collate_pairs(pairs, range(len(pairs)), pad_token_id=0)


def test_a_steps_pairs_split_into_the_fewest_micro_batches_of_even_sizes():
    batch = _pairs_batch([(128, 512, 512)] * 64)
    for budget, sizes in ((16384, [13, 13, 13, 13, 12]), (49152, [32, 32]), (65536, [32, 32]), (1152, [1] * 64)):
        micro = list(pair_micro_batches(batch, budget, "response_mask"))
        assert sorted((len(piece) // 2 for piece in micro), reverse=True) == sizes
        assert len(micro) == micro_batches_of(STANDARD, budget)[0]  # the planner counts them as they are cut
    mixed = _pairs_batch([(10 + pair % 7, 50 + 13 * pair % 61, 40 + 29 * pair % 53) for pair in range(40)])
    costs = [10 + pair % 7 + 50 + 13 * pair % 61 + 40 + 29 * pair % 53 for pair in range(40)]
    micro = list(pair_micro_batches(mixed, 1000, "response_mask"))
    loads = [int(piece["attention_mask"].sum()) - sum(int(piece["attention_mask"][row, :piece["prompts"].shape[1]]
                                                          .sum()) for row in range(1, len(piece), 2)) for piece in micro]
    assert len(micro) == -(-sum(costs) // 1000) and max(loads) <= 1000 and max(loads) - min(loads) <= max(costs)
    assert sorted(row for piece in micro for row in piece.meta["rows"]) == list(range(80))  # every pair, whole


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_parameters_kept_gathered_and_gradients_reduced_once_a_step_give_the_same_update(pair_args, tmp_path,
                                                                                       monkeypatch, command):
    from reinforge.trainer.preference.dpo_trainer import DPOTrainer
    from reinforge.trainer.preference.rm_trainer import RewardModelTrainer

    load, trainer_class = (load_dpo_config, DPOTrainer) if command == "dpo" else (load_rm_config, RewardModelTrainer)

    def weights_after_one_step(run_dir, gpu_bytes):
        planned = functools.partial(apply_preference_plan, gpu_bytes=gpu_bytes)
        monkeypatch.setattr(pairs_module, "apply_preference_plan", planned)
        trainer = trainer_class(load(None, pair_args(run_dir, **{"trainer.total_steps": 1,
                                                                 "trainer.max_tokens_per_micro_batch": 96})))
        batch = trainer.train_loader.batches_of_one_pass()[0]
        assert len(list(pair_micro_batches(batch, 96, "response_mask"))) > 2  # gradients accumulated over several
        trainer.fit()
        weights = {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}
        return trainer.memory_plan.keep_gathered, weights

    kept, gathered_once = weights_after_one_step(tmp_path / "kept", 8 * GiB)  # one device with room: kept
    resharded, gathered_twice = weights_after_one_step(tmp_path / "resharded", None)  # the CPU: gathered again
    assert kept and not resharded
    for name, value in gathered_once.items():
        torch.testing.assert_close(value, gathered_twice[name], atol=1e-6, rtol=1e-6)
