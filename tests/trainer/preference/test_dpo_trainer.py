"""reinforge dpo: the first step's policy is its reference, the packed pair equals its two sequences run apart,
the reference log-probs are scored once and never from a resumed policy, and the update does not depend on the
micro-batch split."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from reinforge.cli import main
from reinforge.config import ConfigError
from reinforge.config.preference_schema import load_dpo_config
from reinforge.data.preference_dataset import PreferenceKeys, collate_pairs, tokenize_pair
from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.forward import response_log_probs
from reinforge.engine.packing import attach_plan, pack_rows
from reinforge.models import load_causal_lm, load_tokenizer
from reinforge.trainer.preference.dpo_trainer import REFERENCE_FILE, DPOTrainer


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_dpo_starts_at_its_reference_and_logs_trls_metrics(pair_args, pairs_dir, tmp_path):
    run_dir = tmp_path / "dpo"
    assert main(["dpo", *pair_args(run_dir, **{"data.val_files": f"[{pairs_dir / 'val.jsonl'}]"})]) == 0
    before, first, last = metrics_of(run_dir)
    assert before["eval_rewards/chosen"] == 0.0 and before["eval_rewards/margins"] == 0.0
    assert before["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is its reference at step 1
    assert first["reference/num_pairs"] == 32 + 16  # the training and the validation pairs, logged once
    assert 0 < first["timing_s/reference_first_micro_batch"] < first["timing_s/reference_pass"]
    assert first["perf/reference_pairs_per_s"] > 0 and "reference/num_pairs" not in last
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "num_tokens", "eval_rewards/accuracies"):
        assert key in last, key
    assert last["rewards/margins"] == pytest.approx(last["rewards/chosen"] - last["rewards/rejected"], abs=1e-6)
    assert last["train/loss"] < first["train/loss"]


def test_a_pair_runs_its_prompt_once_and_scores_as_its_two_sequences_apart(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device="cpu")
    use_varlen_attention(model)
    row = {"prompt": [{"role": "user", "content": "question 3?"}], "chosen": [{"role": "assistant", "content": "yes"}],
           "rejected": [{"role": "assistant", "content": "no, sorry"}]}
    pair = tokenize_pair(tokenizer, row, PreferenceKeys())
    batch = attach_plan(collate_pairs([pair], [0], tokenizer.pad_token_id), share_prompts=True)
    assert pack_rows(batch).num_tokens == len(pair.prompt_ids) + len(pair.chosen_ids) + len(pair.rejected_ids)
    with torch.no_grad():
        together, _ = response_log_probs(model, batch)
        apart = [response_log_probs(model, attach_plan(batch.index([row]), share_prompts=False))[0][0]
                 for row in range(2)]
    for row in range(2):
        torch.testing.assert_close(together[row], apart[row], atol=1e-5, rtol=1e-5)


def test_the_reference_is_scored_once_and_a_resumed_run_never_scores_it_with_its_policy(pair_args, tmp_path):
    straight = tmp_path / "straight"
    assert main(["dpo", *pair_args(straight, **{"trainer.total_steps": 4})]) == 0
    stored = torch.load(straight / REFERENCE_FILE, weights_only=True)
    resumed = tmp_path / "resumed"
    args = pair_args(resumed, **{"trainer.total_steps": 4, "trainer.save_every": 2})
    assert main(["dpo", *args]) == 0
    shutil.rmtree(sorted((resumed / "checkpoints").glob("step_*"))[-1])  # stopped after the step-2 checkpoint
    (resumed / REFERENCE_FILE).unlink()  # and its reference file lost: the reference model is loaded again
    assert main(["dpo", *args]) == 0
    torch.testing.assert_close(torch.load(resumed / REFERENCE_FILE, weights_only=True)["train"], stored["train"])
    for a, b in zip(metrics_of(straight), metrics_of(resumed), strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-4, abs=1e-7)


def _weights_after_one_step(pair_args, run_dir: Path, budget: int, loss_type: str) -> dict[str, torch.Tensor]:
    config = load_dpo_config(None, pair_args(run_dir, **{"trainer.total_steps": 1, "data.shuffle": False,
                                                         "trainer.max_tokens_per_micro_batch": budget,
                                                         "dpo.loss_type": loss_type}))
    trainer = DPOTrainer(config)
    trainer.fit()
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_the_update_does_not_depend_on_the_micro_batch_split(pair_args, tmp_path, loss_type):
    whole = _weights_after_one_step(pair_args, tmp_path / "whole", 4096, loss_type)
    pair_by_pair = _weights_after_one_step(pair_args, tmp_path / "split", 96, loss_type)
    for name in whole:
        torch.testing.assert_close(whole[name], pair_by_pair[name], atol=2e-6, rtol=1e-5)


def test_an_implicit_plain_pair_without_a_common_beginning_is_refused_for_dpo(pair_args, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"chosen": "yes", "rejected": "no"}) + "\n")
    assert main(["dpo", *pair_args(tmp_path / "run", **{"data.train_files": f"[{pairs}]"})]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: row 0 of {pairs}: 'chosen' and 'rejected' share no beginning, so there is no prompt for "
                    "the completions to follow; give a 'prompt' column")


@pytest.mark.parametrize(("override", "message"), [
    ("dpo.loss_type=kto", "dpo.loss_type='kto' is not one of sigmoid, ipo, hinge, robust"),
    ("dpo.beta=0", "dpo.beta=0.0 must be a positive number"),
    ("dpo.label_smoothing=0.5", "dpo.label_smoothing=0.5 must be in [0, 0.5)"),
])
def test_dpo_settings_that_cannot_work_are_refused_as_the_config_loads(override, message):
    with pytest.raises(ConfigError) as error:
        load_dpo_config(None, [override])
    assert str(error.value).startswith(message)


def test_label_smoothing_without_the_robust_loss_is_one_warning(pair_args, tmp_path, caplog):
    from reinforge.trainer.preference.pairs import preflight_preference

    config = load_dpo_config(None, pair_args(tmp_path / "run", **{"dpo.label_smoothing": 0.1}))
    with caplog.at_level("WARNING"):
        preflight_preference(config)
    assert [record.getMessage() for record in caplog.records if "label_smoothing" in record.getMessage()] == [
        "dpo.label_smoothing=0.1 has no effect with dpo.loss_type=sigmoid (only the robust loss reads it, as in "
        "TRL); set dpo.loss_type=robust or remove dpo.label_smoothing"]


def test_dpo_trains_lora_adapters_from_its_reference_and_saves_them_merged_and_apart(pair_args, tmp_path):
    run_dir = tmp_path / "lora"
    lora = {"model.lora.rank": 4, "model.lora.alpha": 8, "optim.lr": 1e-2, "trainer.total_steps": 3}
    assert main(["dpo", *pair_args(run_dir, **lora)]) == 0
    records = metrics_of(run_dir)
    assert records[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # lora_B starts at zero
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert (checkpoint / "adapter" / "adapter_config.json").is_file() and (checkpoint / "hf" / "config.json").is_file()


def test_lora_adapters_that_match_no_layer_are_refused_before_the_model_loads(pair_args, tmp_path, capsys):
    args = pair_args(tmp_path / "run", **{"model.lora.rank": 4, "model.lora.target_modules": "[attention_dense]"})
    assert main(["dpo", *args]) == 2
    assert "model.lora.target_modules" in capsys.readouterr().err


@pytest.mark.slow
def test_a_resumed_lora_run_equals_an_uninterrupted_one(pair_args, tmp_path):
    lora = {"model.lora.rank": 4, "model.lora.alpha": 8, "optim.lr": 1e-2, "trainer.total_steps": 4}
    straight = tmp_path / "straight"
    assert main(["dpo", *pair_args(straight, **lora)]) == 0
    resumed = tmp_path / "resumed"
    args = pair_args(resumed, **lora, **{"trainer.save_every": 2})
    assert main(["dpo", *args]) == 0
    shutil.rmtree(sorted((resumed / "checkpoints").glob("step_*"))[-1])
    assert main(["dpo", *args]) == 0
    for a, b in zip(metrics_of(straight), metrics_of(resumed), strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)


def test_validation_scores_pairs_with_the_training_forward_to_the_metrics_of_a_no_grad_pass(pair_args, pairs_dir,
                                                                                          tmp_path):
    from reinforge.algorithms.preference_losses import dpo_loss
    from reinforge.trainer.preference.dpo_trainer import dpo_metrics

    config = load_dpo_config(None, pair_args(tmp_path / "run", **{"trainer.total_steps": 1,
                                                                   "data.val_files": f"[{pairs_dir / 'val.jsonl'}]",
                                                                   "data.val_batch_size": 6}))
    trainer = DPOTrainer(config)
    trainer.fit()  # one step: the policy has moved from its reference
    values: dict[str, list[torch.Tensor]] = {"chosen": [], "rejected": [], "logp_chosen": [], "logp_rejected": [],
                                             "loss": []}
    trainer.model.eval()
    with torch.no_grad():  # what a separate evaluation pass gives, micro-batch by micro-batch
        for batch in trainer.val_loader.batches_of_one_pass():
            for micro in trainer.micro_batches(batch):
                logps = trainer._sequence_logps(trainer.model, micro)
                reference = trainer.reference["val"][micro["pair_index"][0::2]]
                loss, chosen, rejected = dpo_loss(logps[0::2], logps[1::2], reference[:, 0], reference[:, 1],
                                                  beta=config.dpo.beta)
                for name, value in (("chosen", chosen), ("rejected", rejected), ("logp_chosen", logps[0::2]),
                                    ("logp_rejected", logps[1::2]), ("loss", loss)):
                    values[name].append(value)
    trainer.model.train()
    together = {name: torch.cat(parts) for name, parts in values.items()}
    expected = {f"eval_{key}": value for key, value in dpo_metrics(together).items()}
    expected["eval_loss"] = float(together["loss"].mean())
    measured = trainer.validate()
    assert measured.keys() == expected.keys() and expected["eval_rewards/margins"] != 0.0
    for key, value in expected.items():
        assert measured[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert trainer.model.training


def test_each_steps_pairs_are_cut_once_the_next_steps_while_the_device_runs_the_last_micro_batch(
        pair_args, tmp_path, monkeypatch):
    from reinforge.trainer.preference import pairs as pairs_module

    cut: list = []  # the batches themselves: their ids could be reused once freed
    original = pairs_module.pair_micro_batches

    def counted(batch, max_tokens, mask_key):
        cut.append(batch)
        return original(batch, max_tokens, mask_key)

    monkeypatch.setattr(pairs_module, "pair_micro_batches", counted)
    trainer = DPOTrainer(load_dpo_config(None, pair_args(tmp_path / "run", **{"trainer.total_steps": 3,
                                                                               "trainer.max_tokens_per_micro_batch": 96})))
    trained: list = []
    original_update = trainer.update

    def update(batch):
        trained.append(batch)
        return original_update(batch)

    trainer.update = update
    trainer.fit()
    assert len(trained) == 3 and all(sum(piece is batch for piece in cut) == 1 for batch in trained)
