"""reinforge dpo: the first step's policy is its reference, the packed pair equals its two sequences run apart,
the reference log-probs are scored once, from the initial model in a resumed run too, and never read from a file
that is not the run's, and the update does not depend on the micro-batch split."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from reinforge.atomic_files import temporary_beside
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

    # stopped before its first checkpoint: the rerun starts over, reads the reference back and logs the same lines
    shutil.rmtree(run_dir / "checkpoints")
    assert main(["dpo", *pair_args(run_dir, **{"data.val_files": f"[{pairs_dir / 'val.jsonl'}]"})]) == 0
    again = metrics_of(run_dir)
    assert [sorted(record) for record in again] == [sorted(record) for record in (before, first, last)]
    assert again[1]["timing_s/reference_pass"] == first["timing_s/reference_pass"]


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


@pytest.mark.parametrize("separate_reference", [False, True], ids=["policy", "reference_path"])
def test_a_resumed_run_without_its_reference_file_scores_the_initial_model_before_its_checkpoint_loads(
        pair_args, tiny_model_dir, tmp_path, monkeypatch, separate_reference):
    settings: dict = {"trainer.total_steps": 4}
    if separate_reference:
        settings["dpo.reference_path"] = shutil.copytree(tiny_model_dir, tmp_path / "reference")
    straight = tmp_path / "straight"
    assert main(["dpo", *pair_args(straight, **settings)]) == 0
    stored = torch.load(straight / REFERENCE_FILE, weights_only=True)
    resumed = tmp_path / "resumed"
    args = pair_args(resumed, **settings, **{"trainer.save_every": 2})
    assert main(["dpo", *args]) == 0
    shutil.rmtree(sorted((resumed / "checkpoints").glob("step_*"))[-1])  # stopped after the step-2 checkpoint
    (resumed / REFERENCE_FILE).unlink()  # and its reference file lost
    passes = []
    score_pairs = DPOTrainer.score_pairs

    def observed(self, model, loader, score):
        passes.append({"policy": model is self.model, "optimizer_state": len(self.optimizer.state), "step": self.step})
        return score_pairs(self, model, loader, score)

    monkeypatch.setattr(DPOTrainer, "score_pairs", observed)
    assert main(["dpo", *args]) == 0
    # the policy as loaded from model.path (or the reference model), scored beside no optimizer state
    assert passes == [{"policy": not separate_reference, "optimizer_state": 0, "step": 0}]
    assert torch.equal(torch.load(resumed / REFERENCE_FILE, weights_only=True)["train"], stored["train"])
    for a, b in zip(metrics_of(straight), metrics_of(resumed), strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-4, abs=1e-7)


def _cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _scored_for_ipo(path: Path) -> None:
    stored = torch.load(path, weights_only=True)
    torch.save({**stored, "key": {**stored["key"], "loss_type": "ipo"}}, path)


def _one_pair_short(path: Path) -> None:
    stored = torch.load(path, weights_only=True)
    torch.save({**stored, "train": stored["train"][:-1]}, path)


@pytest.mark.parametrize(("spoil", "problem"), [
    (_cut_short, "cannot be read (cut short, or not written by torch.save)"),
    (_scored_for_ipo, "holds the reference log-probs of loss_type 'ipo' (this run: 'sigmoid')"),
    (_one_pair_short, "holds (31, 2) train log-probs where the run's 32 train pairs need (32, 2)"),
], ids=["cut_short", "another_loss", "a_pair_short"])
def test_a_reference_file_cut_short_or_of_another_run_is_never_used_but_scored_again(pair_args, tmp_path, caplog,
                                                                                     spoil, problem):
    run_dir = tmp_path / "run"
    args = pair_args(run_dir, **{"trainer.total_steps": 4, "trainer.save_every": 2})
    assert main(["dpo", *args]) == 0
    reference_file = run_dir / REFERENCE_FILE
    scored, steps = torch.load(reference_file, weights_only=True), metrics_of(run_dir)
    shutil.rmtree(sorted((run_dir / "checkpoints").glob("step_*"))[-1])
    spoil(reference_file)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert main(["dpo", *args]) == 0
    assert [record.getMessage() for record in caplog.records if REFERENCE_FILE in record.getMessage()] == [
        f"{reference_file} {problem}; the reference log-probs are scored again and the file replaced"]
    rescored = torch.load(reference_file, weights_only=True)
    assert rescored["key"] == scored["key"] and torch.equal(rescored["train"], scored["train"])
    for a, b in zip(steps, metrics_of(run_dir), strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)


def test_the_reference_file_keys_the_dtype_the_forward_computes_in(pair_args, tmp_path, caplog):
    run_dir = tmp_path / "run"
    assert main(["dpo", *pair_args(run_dir, **{"trainer.total_steps": 1, "model.dtype": "float32"})]) == 0
    caplog.clear()
    with caplog.at_level("INFO"):  # a new run in the folder, at auto: float32 on the CPU, as the file was scored
        assert main(["dpo", *pair_args(run_dir, **{"trainer.total_steps": 1, "model.dtype": "auto",
                                                  "trainer.resume": "never"})]) == 0
    messages = [record.getMessage() for record in caplog.records if "reference log-probs" in record.getMessage()]
    assert messages == [f"reference log-probs read from {run_dir / REFERENCE_FILE}"]
    assert torch.load(run_dir / REFERENCE_FILE, weights_only=True)["key"]["dtype"] == "float32"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device whose every write fails")
def test_a_reference_file_that_cannot_be_written_stops_the_run_in_one_line_and_leaves_the_old_one_whole(
        pair_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["dpo", *pair_args(run_dir, **{"trainer.total_steps": 1})]) == 0
    reference_file = run_dir / REFERENCE_FILE
    written = reference_file.read_bytes()
    staging = temporary_beside(reference_file)
    staging.symlink_to("/dev/full")  # the disk is full by the time the file is written
    capsys.readouterr()
    args = pair_args(run_dir, **{"trainer.total_steps": 1, "trainer.resume": "never", "dpo.loss_type": "ipo"})
    assert main(["dpo", *args]) == 2  # another loss: the log-probs are scored again, then cannot be stored
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert line == (f"error: cannot write {reference_file} (the reference log-probs): No space left on device; free "
                    "space on its disk, or set trainer.output_dir to a folder on another disk, and run the same "
                    "command again")
    assert reference_file.read_bytes() == written and not staging.is_symlink() and not staging.exists()


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


@pytest.mark.parametrize(("row", "message"), [
    ({"chosen": "yes", "rejected": "no"},
     "'chosen' and 'rejected' share no beginning, so there is no prompt for the completions to follow; give a "
     "'prompt' column"),
    ({"prompt": "", "chosen": "yes", "rejected": "no"},  # the first token of each completion would have no predictor
     "'prompt' is an empty string, so there is no prompt for the completions to follow; give each row its prompt"),
])
def test_a_plain_pair_without_a_prompt_is_refused_for_dpo(pair_args, tmp_path, capsys, row, message):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(row) + "\n")
    assert main(["dpo", *pair_args(tmp_path / "run", **{"data.train_files": f"[{pairs}]"})]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"error: row 0 of {pairs}: {message}"


@pytest.mark.parametrize(("override", "message"), [
    ("dpo.loss_type=kto", "dpo.loss_type='kto' is not one of sigmoid, ipo, hinge, robust"),
    ("dpo.beta=0", "dpo.beta=0.0 must be a positive number"),
    ("dpo.label_smoothing=0.5", "dpo.label_smoothing=0.5 must be in [0, 0.5)"),
    ("trainer.router_aux_loss_coef=-1", "trainer.router_aux_loss_coef=-1.0 must be a finite number >= 0"),
])
def test_dpo_settings_that_cannot_work_are_refused_as_the_config_loads(override, message):
    with pytest.raises(ConfigError) as error:
        load_dpo_config(None, [override])
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_a_router_aux_loss_coef_on_a_model_without_experts_is_refused_before_it_loads(pair_args, tiny_model_dir,
                                                                                     tmp_path, capsys, command):
    """As TRL refuses it: a dense model has no router to balance. 0 (and null, declared) train as before."""
    assert main([command, *pair_args(tmp_path / "run", **{"trainer.router_aux_loss_coef": 0.01})]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: trainer.router_aux_loss_coef=0.01 weighs a mixture of experts' load-balancing loss, but "
                    f"model.path={tiny_model_dir} is a 'qwen2' model without experts, which has no router to balance; "
                    "remove trainer.router_aux_loss_coef or set it to 0")
    assert not (tmp_path / "run").exists()  # refused before the run folder, before the model
    assert main([command, *pair_args(tmp_path / "zero", **{"trainer.router_aux_loss_coef": 0,
                                                           "trainer.total_steps": 1})]) == 0


def test_trls_precomputed_reference_log_probs_in_the_rows_are_one_warning(pair_args, pairs_dir, tmp_path, caplog):
    """TRL's DPOTrainer reads ref_chosen_logps / ref_rejected_logps from the rows; reinforge scores its own."""
    rows = [json.loads(line) | {"ref_chosen_logps": -3.0, "ref_rejected_logps": -4.0}
            for line in (pairs_dir / "train.jsonl").read_text().splitlines()]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with caplog.at_level("WARNING"):
        assert main(["dpo", *pair_args(tmp_path / "run", **{"data.train_files": f"[{pairs}]",
                                                            "trainer.total_steps": 1})]) == 0
    assert (f"{pairs} has 'ref_chosen_logps' and 'ref_rejected_logps', TRL's precomputed reference log-probs; "
            "reinforge dpo leaves them aside and scores the reference itself") in caplog.text


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
def test_a_resumed_lora_run_equals_an_uninterrupted_one(pair_args, tmp_path, capsys):
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
    capsys.readouterr()
    for changed, named in ((8, "model.lora.rank: 4 -> 8"), (0, "model.lora.rank: 4 -> 0")):  # adapters the state lacks
        assert main(["dpo", *pair_args(resumed, **{**lora, "model.lora.rank": changed})]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert named in line and "cannot take" in line


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


def test_a_mixture_of_experts_adds_the_aux_loss_its_config_asks_for(pair_args, tmp_path):
    """As TRL's DPOTrainer: output_router_logits in the model's config adds router_aux_loss_coef x the routers'
    load-balancing loss to the DPO loss (its gradient with it), as trainer.router_aux_loss_coef does on a config that
    does not ask; the aux loss and the step's routing are logged either way."""
    from reinforge.models.tiny import save_tiny_model

    firsts = {}
    for run, asks, settings in (("asks", True, {}), ("no", False, {}),
                                ("knob", False, {"trainer.router_aux_loss_coef": 0.5})):
        model_dir = save_tiny_model(tmp_path / f"moe-{run}", arch="qwen3_moe", num_layers=2,
                                    output_router_logits=asks, router_aux_loss_coef=0.5)
        assert main(["dpo", *pair_args(tmp_path / f"run-{run}", **{"model.path": model_dir, "trainer.total_steps": 1,
                                                                    **settings})]) == 0
        [firsts[run]] = metrics_of(tmp_path / f"run-{run}")
    for first in firsts.values():
        assert first["train/moe/aux_loss"] > 0
        assert first["train/moe/load_imbalance"] >= 1.0 and 0 <= first["train/moe/unused_experts"] < 4
        assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # the DPO loss: the policy is its reference
    assert firsts["asks"]["train/moe/aux_loss"] == pytest.approx(firsts["no"]["train/moe/aux_loss"], rel=1e-5)
    assert firsts["asks"]["train/grad_norm"] != pytest.approx(firsts["no"]["train/grad_norm"], rel=1e-4)
    assert firsts["knob"]["train/grad_norm"] == pytest.approx(firsts["asks"]["train/grad_norm"], rel=1e-5)


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_a_checkpoints_dropout_is_switched_off_as_trls_trainers_do(pair_args, tmp_path, caplog, command):
    """GPT-2 asks for dropout 0.1: with it on, DPO's first step (the policy is its reference, scored without dropout)
    gave a loss of 0.6995 and rewards that were noise. The saved folder keeps the checkpoint's own rates."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from reinforge.models.tiny import build_char_tokenizer, save_hf_folder

    tokenizer = build_char_tokenizer(())
    config = AutoConfig.for_model("gpt2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, n_embd=64,
                                  n_layer=2, n_head=4, n_positions=128)
    assert config.resid_pdrop == config.attn_pdrop == config.embd_pdrop == 0.1
    folder = save_hf_folder(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path / "gpt2")
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO"):
        assert main([command, *pair_args(run_dir, **{"model.path": folder, "trainer.total_steps": 1})]) == 0
    [first] = metrics_of(run_dir)
    if command == "dpo":
        assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert first["rewards/chosen"] == first["rewards/margins"] == 0.0
    assert "dropout off for rm and dpo: gpt2 drops activations in training mode (config.resid_pdrop=0.1" in caplog.text
    saved = json.loads((run_dir / "checkpoints" / "step_000001" / "hf" / "config.json").read_text())
    assert saved["resid_pdrop"] == saved["attn_pdrop"] == saved["embd_pdrop"] == 0.1


def test_a_reference_that_reads_the_policys_ids_as_other_tokens_is_refused_before_any_model_loads(
        pair_args, tiny_model_dir, tmp_path, capsys):
    """A reference of another tokenizer (another family) scored the policy's ids as other tokens, silently."""
    from tests.model_folder_variants import with_fewer_rows, with_swapped_tokens

    other = with_swapped_tokens(tiny_model_dir, tmp_path / "other_tokenizer")
    small = with_fewer_rows(tiny_model_dir, tmp_path / "small_vocabulary")
    for folder, message in ((other, f"error: dpo.reference_path={other} has a tokenizer of its own, in which 2 of the "
                             "policy's 259 tokens (first 'a') have another id or none; DPO compares both models' "
                             "log-probs of the same token ids, so give a reference that shares the policy's tokenizer "
                             "(model.path's own starting weights if unset)"),
                            (small, f"error: dpo.reference_path={small} has vocab_size=100, fewer than the policy "
                             "tokenizer's 259 token ids; give a reference that shares the policy's tokenizer")):
        run_dir = tmp_path / f"run_{folder.name}"
        assert main(["dpo", *pair_args(run_dir, **{"dpo.reference_path": folder})]) == 2
        [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert line == message
        assert not (run_dir / REFERENCE_FILE).exists()
