"""reinforge rm: the exported folder is the reward model the worker loads, the update does not depend on the
micro-batch split, a resumed run equals an uninterrupted one, and bad rows or settings fail before a model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

import reinforge.trainer.preference.pairs as pairs_module
from reinforge.cli import main
from reinforge.config import ConfigError
from reinforge.config.preference_schema import load_dpo_config, load_rm_config
from reinforge.data.preference_dataset import PairLoader, PreferenceKeys, collate_pairs, tokenize_pair
from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.forward import last_token_scores
from reinforge.engine.packing import attach_plan
from reinforge.models.reward_model import load_reward_model
from reinforge.trainer.preference.rm_trainer import RewardModelTrainer, _row_rewards


def latest_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1]


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_rm_logs_trls_metrics_and_exports_a_folder_the_reward_worker_loads(pair_args, pairs_dir, tmp_path):
    run_dir = tmp_path / "rm"
    args = pair_args(run_dir, **{"data.val_files": f"[{pairs_dir / 'val.jsonl'}]", "rm.center_rewards_coefficient": 0.01})
    assert main(["rm", *args]) == 0
    records = metrics_of(run_dir)
    assert {"eval_accuracy", "eval_margin", "eval_min_reward", "eval_mean_reward", "eval_max_reward"} <= set(records[0])
    last = records[-1]
    for key in ("accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens", "train/loss",
                "eval_accuracy", "eval_loss"):
        assert key in last, key
    assert last["min_reward"] <= last["mean_reward"] <= last["max_reward"]

    folder = latest_checkpoint(run_dir) / "hf"
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == ["Qwen2ForSequenceClassification"] and config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert config.pad_token_id == tokenizer.pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    worker_model = load_reward_model(str(folder), dtype=torch.float32, device="cpu")  # what reward.reward_model loads
    use_varlen_attention(worker_model)

    # the packed scoring of training and the worker equals transformers' own forward on a right-padded batch
    keys = PreferenceKeys()
    row = {"prompt": [{"role": "user", "content": "question 7?"}], "chosen": [{"role": "assistant", "content": "yes"}],
           "rejected": [{"role": "assistant", "content": "no, sorry"}]}
    pair = tokenize_pair(tokenizer, row, keys)
    batch = attach_plan(collate_pairs([pair], [0], tokenizer.pad_token_id), share_prompts=True)
    with torch.no_grad():
        packed = last_token_scores(worker_model, batch).squeeze(-1)
        sequences = [pair.prompt_ids + pair.chosen_ids, pair.prompt_ids + pair.rejected_ids]
        width = max(map(len, sequences))
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in sequences])
        attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in sequences])
        padded = model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1)
    torch.testing.assert_close(packed, padded, atol=1e-4, rtol=1e-4)

    exported = tmp_path / "exported"  # reinforge export writes the same classifier from the trainer state
    assert main(["export", str(run_dir), str(exported)]) == 0
    again = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1), padded)


def _weights_after_one_step(pair_args, run_dir: Path, budget: int) -> dict[str, torch.Tensor]:
    config = load_rm_config(None, pair_args(run_dir, **{"trainer.total_steps": 1, "data.shuffle": False,
                                                        "trainer.max_tokens_per_micro_batch": budget}))
    trainer = RewardModelTrainer(config)
    trainer.fit()
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


def test_the_update_does_not_depend_on_the_micro_batch_split(pair_args, tmp_path):
    whole = _weights_after_one_step(pair_args, tmp_path / "whole", budget=4096)
    pair_by_pair = _weights_after_one_step(pair_args, tmp_path / "split", budget=96)  # one pair a micro-batch
    for name in whole:
        torch.testing.assert_close(whole[name], pair_by_pair[name], atol=2e-6, rtol=1e-5)


def test_a_resumed_run_equals_an_uninterrupted_one(pair_args, tmp_path, caplog):
    """The micro-batch budget is left to the memory plan: config.yaml records the planned number, and the resumed
    run, planning the same, finds no setting changed."""
    planned = {"trainer.total_steps": 4, "trainer.max_tokens_per_micro_batch": "auto"}
    straight = tmp_path / "straight"
    assert main(["rm", *pair_args(straight, **planned)]) == 0
    resumed = tmp_path / "resumed"
    assert main(["rm", *pair_args(resumed, **planned, **{"trainer.save_every": 2})]) == 0
    # the run is stopped after its step-2 checkpoint: drop the later one, and the log lines after step 2
    import shutil

    shutil.rmtree(latest_checkpoint(resumed))
    caplog.clear()
    assert main(["rm", *pair_args(resumed, **planned, **{"trainer.save_every": 2})]) == 0
    assert "changed settings" not in caplog.text
    budget = yaml.safe_load((resumed / "config.yaml").read_text())["trainer"]["max_tokens_per_micro_batch"]
    assert isinstance(budget, int)
    first, second = metrics_of(straight), metrics_of(resumed)
    assert [record["step"] for record in second] == [1, 2, 3, 4]
    for a, b in zip(first, second, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["num_tokens"] == b["num_tokens"]


def test_a_malformed_row_fails_in_one_line_before_the_tokenizer_or_model_loads(pair_args, tmp_path, monkeypatch,
                                                                              capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Q", "chosen": "yes"}) + "\n")

    def no_loading(*args, **kwargs):
        raise AssertionError("the tokenizer started loading before the rows were checked")

    monkeypatch.setattr(pairs_module, "load_tokenizer", no_loading)
    assert main(["rm", *pair_args(tmp_path / "run", **{"data.train_files": f"[{bad}]"})]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: row 0 of {bad} has no 'rejected' column (its columns: chosen, prompt); preference rows "
                    "hold 'chosen' and 'rejected' (and optionally 'prompt'); data.chosen_key / data.rejected_key name "
                    "other columns")


@pytest.mark.parametrize("command", ["rm", "dpo"])
def test_changed_pairs_are_refused_on_resume_before_the_model_loads(pair_args, pairs_dir, tmp_path, monkeypatch,
                                                                    capsys, command):
    from reinforge.trainer.preference.dpo_trainer import DPOTrainer

    from .conftest import write_pairs

    run_dir, train = tmp_path / "run", write_pairs(tmp_path / "train.jsonl", 8, seed=0)
    args = pair_args(run_dir, **{"data.train_files": f"[{train}]", "trainer.total_steps": 1})
    assert main([command, *args]) == 0
    write_pairs(train, 9, seed=0)  # the same path, one more pair
    trainer_class = RewardModelTrainer if command == "rm" else DPOTrainer

    def no_loading(self):
        raise AssertionError("the model started loading before the changed data was refused")

    monkeypatch.setattr(trainer_class, "load_model", no_loading)
    capsys.readouterr()
    assert main([command, *pair_args(run_dir, **{"data.train_files": f"[{train}]", "trainer.total_steps": 2})]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: the checkpoint's data had 8 pairs but this run's has 9: the data files changed")


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.max_tokens_per_micro_batch=100", "trainer.max_tokens_per_micro_batch=100 is smaller than 2 x "
     "data.max_length=2048, so one pair (its prompt and both completions) may not fit one micro-batch; raise it"),
    ("rm.center_rewards_coefficient=-1", "rm.center_rewards_coefficient=-1.0 must be a finite number >= 0"),
    ("trainer.router_aux_loss_coef=-0.01", "trainer.router_aux_loss_coef=-0.01 must be a finite number >= 0 (the "
     "weight of a mixture of experts' load-balancing loss; null: the model config's)"),
    ("trainer.router_aux_loss_coef=.nan", "trainer.router_aux_loss_coef=nan must be a finite number >= 0"),
    ("data.truncation=right", "data.truncation='right' is not one of drop, error"),
])
def test_settings_that_cannot_work_are_refused_as_the_config_loads(override, message):
    with pytest.raises(ConfigError) as error:
        load_rm_config(None, [override])
    assert str(error.value).startswith(message)


def a_packed_pair_and_its_padded_rows(tokenizer):
    """One pair packed as training packs it, and its two sequences right-padded as transformers reads them."""
    row = {"prompt": [{"role": "user", "content": "question 7?"}], "chosen": [{"role": "assistant", "content": "yes"}],
           "rejected": [{"role": "assistant", "content": "no, sorry"}]}
    pair = tokenize_pair(tokenizer, row, PreferenceKeys())
    batch = attach_plan(collate_pairs([pair], [0], tokenizer.pad_token_id), share_prompts=True)
    sequences = [pair.prompt_ids + pair.chosen_ids, pair.prompt_ids + pair.rejected_ids]
    width = max(map(len, sequences))
    padded = {"input_ids": torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in sequences]),
              "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in sequences])}
    return batch, padded


def test_rm_trains_lora_adapters_and_its_whole_score_head_and_exports_the_merged_classifier(pair_args, tmp_path):
    run_dir = tmp_path / "lora"
    lora = {"model.lora.rank": 4, "model.lora.alpha": 8, "optim.lr": 1e-2, "trainer.total_steps": 3}
    trainer = RewardModelTrainer(load_rm_config(None, pair_args(run_dir, **lora)))
    trainer.fit()
    trained = {name for name, parameter in trainer.model.named_parameters() if parameter.requires_grad}
    assert "score.weight" in trained and all("lora_" in name or name == "score.weight" for name in trained)
    records = metrics_of(run_dir)
    assert records[-1]["train/loss"] < records[0]["train/loss"]

    folder = latest_checkpoint(run_dir) / "hf"  # the adapters merged in, the trained head
    assert (folder.parent / "adapter" / "adapter_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch, padded = a_packed_pair_and_its_padded_rows(tokenizer)
    trainer.model.eval()
    with torch.no_grad():
        trained_scores = last_token_scores(trainer.model, batch).squeeze(-1)
        saved = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        torch.testing.assert_close(saved(**padded).logits.squeeze(-1), trained_scores, atol=1e-4, rtol=1e-4)
        exported = tmp_path / "exported"
        assert main(["export", str(run_dir), str(exported)]) == 0
        again = AutoModelForSequenceClassification.from_pretrained(exported).eval()
        torch.testing.assert_close(again(**padded).logits.squeeze(-1), trained_scores, atol=1e-4, rtol=1e-4)


def test_the_reward_models_fused_layers_score_as_transformers_own(tiny_model_dir):
    """What prepare_for_training swaps in on CUDA (fused norms and MLPs, q/k/v in the flash layout), run eagerly."""
    import copy

    from reinforge.engine.fused import fuse_elementwise, use_packed_attention_layout
    from reinforge.trainer.preference.rm_trainer import load_reward_model_for_training

    model = load_reward_model_for_training(str(tiny_model_dir), pad_token_id=0)
    use_varlen_attention(model)
    fused = copy.deepcopy(model)
    assert fuse_elementwise(fused, compile=False) > 0 and use_packed_attention_layout(fused) > 0
    batch, _ = a_packed_pair_and_its_padded_rows(AutoTokenizer.from_pretrained(tiny_model_dir))
    with torch.no_grad():
        torch.testing.assert_close(last_token_scores(fused, batch), last_token_scores(model, batch),
                                   atol=1e-5, rtol=1e-5)


def test_validation_scores_pairs_with_the_training_forward_to_the_metrics_of_a_no_grad_pass(pair_args, pairs_dir,
                                                                                          tmp_path):
    from reinforge.algorithms.preference_losses import bradley_terry_loss
    from reinforge.trainer.preference.rm_trainer import reward_metrics

    config = load_rm_config(None, pair_args(tmp_path / "run", **{"trainer.total_steps": 1,
                                                                  "data.val_files": f"[{pairs_dir / 'val.jsonl'}]",
                                                                  "data.val_batch_size": 6,
                                                                  "rm.center_rewards_coefficient": 0.01}))
    trainer = RewardModelTrainer(config)
    trainer.fit()
    chosen, rejected, losses = [], [], []
    trainer.model.eval()
    with torch.no_grad():  # what a separate evaluation pass gives, micro-batch by micro-batch
        for batch in trainer.val_loader.batches_of_one_pass():
            for micro in trainer.micro_batches(batch):
                rewards = last_token_scores(trainer.model, micro).squeeze(-1)
                chosen.append(rewards[0::2])
                rejected.append(rewards[1::2])
                losses.append(bradley_terry_loss(rewards[0::2], rewards[1::2], micro["margin"][0::2], 0.01))
    trainer.model.train()
    expected = reward_metrics(torch.cat(chosen), torch.cat(rejected)) | {"loss": float(torch.cat(losses).mean())}
    measured = trainer.validate()
    assert measured.keys() == {f"eval_{key}" for key in expected}
    for key, value in expected.items():
        assert measured[f"eval_{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def _outside_family_folder(tmp_path: Path, model_type: str, **sizes) -> Path:
    from transformers import AutoModelForCausalLM

    from reinforge.models.tiny import build_char_tokenizer, save_hf_folder

    tokenizer = build_char_tokenizer(())
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, **sizes)
    return save_hf_folder(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path / model_type)


def test_a_family_whose_classifier_has_no_sdpa_trains_with_eager_attention(pair_args, tmp_path):
    folder = _outside_family_folder(tmp_path, "mpt", d_model=64, n_layers=2, n_heads=4, max_seq_len=128)
    assert main(["rm", *pair_args(tmp_path / "run", **{"model.path": folder, "trainer.total_steps": 1})]) == 0


def test_a_family_without_a_sequence_classifier_is_refused_in_one_line(pair_args, tmp_path, capsys):
    folder = _outside_family_folder(tmp_path, "mamba", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                    state_size=8)
    assert main(["rm", *pair_args(tmp_path / "run", **{"model.path": folder})]) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "'mamba' model, for which transformers has no sequence-classification class" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("head", ["sequence", "token"])
def test_a_tokenizer_padding_with_its_eos_trains_the_reward_transformers_classifier_reads(pair_args, tmp_path, head):
    """A tokenizer without a pad token pads with its EOS, which ends every plain completion: transformers' sequence
    classifier reads the score at the last token that is not padding, so training reads it there too, and the
    exported folder scores each pair as training did. A token classifier scores every token, and its reward is the
    last token's, the EOS, as the reward-model worker and verl read it."""
    from transformers import AutoModelForTokenClassification, Qwen2ForTokenClassification

    from reinforge.models import save_tiny_model
    from tests.workers.test_reward_model import save_tiny_reward_model

    model_dir = (save_tiny_model(tmp_path / "model") if head == "sequence"
                 else save_tiny_reward_model(tmp_path / "model", Qwen2ForTokenClassification))
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"pad_token": None}))
    pairs = tmp_path / "plain.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q{index}: yes?", "chosen": " yes", "rejected": " no, sorry"})
                             + "\n" for index in range(8)))
    config = load_rm_config(None, pair_args(tmp_path / "run", **{
        "model.path": model_dir, "data.train_files": f"[{pairs}]", "trainer.total_steps": 1, "optim.lr": 0.05}))
    trainer = RewardModelTrainer(config)
    trainer.fit()
    folder = latest_checkpoint(tmp_path / "run") / "hf"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    auto_class = AutoModelForSequenceClassification if head == "sequence" else AutoModelForTokenClassification
    classifier = auto_class.from_pretrained(folder).eval()
    assert classifier.config.pad_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        trained = trainer.score_pairs(trainer.model, PairLoader(trainer.train_set.pairs[:2], 2, 0, shuffle=False),
                                      _row_rewards)
        texts = [f"Q{index}: yes?{completion}{tokenizer.eos_token}" for index in range(2)
                 for completion in (" yes", " no, sorry")]
        exported = [classifier(**tokenizer(text, add_special_tokens=False, return_tensors="pt")).logits.reshape(-1)[-1]
                    for text in texts]  # a token classifier's at the last token
    torch.testing.assert_close(trained.reshape(-1), torch.stack(exported), atol=1e-5, rtol=1e-5)


def test_a_classifier_of_several_labels_is_refused_in_one_line_before_it_loads(pair_args, tmp_path, capsys):
    from transformers import Qwen2ForSequenceClassification

    from reinforge.models.tiny import build_char_tokenizer, build_tiny_causal_lm, save_hf_folder

    tokenizer = build_char_tokenizer(())
    causal = build_tiny_causal_lm("qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    config = causal.config
    config.num_labels = 2
    folder = save_hf_folder(Qwen2ForSequenceClassification(config), tokenizer, tmp_path / "two_labels")
    assert main(["rm", *pair_args(tmp_path / "run", **{"model.path": folder})]) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert line == (f"error: model.path={folder} is a Qwen2ForSequenceClassification with num_labels=2; reinforge rm "
                    "trains a head of one label, so start from the causal LM it was made from, or from a classifier "
                    "with num_labels=1")


@pytest.mark.parametrize("start", ["token_classifier", "sequence_classifier", "causal_lm"])
def test_rm_continues_from_a_classifier_as_its_own_class_and_exports_that_class(pair_args, tiny_model_dir, tmp_path,
                                                                                  start):
    """A token classifier (verl's reward models) keeps its score head's bias: the first reward is the folder's own
    class's output at the last token, the bias trains (by the centring term), and the checkpoint and `reinforge export` write a token
    classifier that scores as training did. A sequence classifier continues as one; a causal LM gets a new head."""
    from transformers import (
        AutoModelForTokenClassification,
        Qwen2ForSequenceClassification,
        Qwen2ForTokenClassification,
    )

    from tests.workers.test_reward_model import save_tiny_reward_model

    heads = {"token_classifier": Qwen2ForTokenClassification, "sequence_classifier": Qwen2ForSequenceClassification}
    folder = save_tiny_reward_model(tmp_path / start, heads[start]) if start in heads else tiny_model_dir
    auto_class = AutoModelForTokenClassification if start == "token_classifier" else AutoModelForSequenceClassification
    run_dir = tmp_path / "run"
    # the bias cancels from r_chosen - r_rejected: only the centring term (no weight decay here) moves it
    settings = {"model.path": folder, "optim.lr": 1e-2, "optim.weight_decay": 0, "rm.center_rewards_coefficient": 0.1}
    trainer = RewardModelTrainer(load_rm_config(None, pair_args(run_dir, **settings)))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch, padded = a_packed_pair_and_its_padded_rows(tokenizer)
    last = padded["attention_mask"].sum(-1) - 1

    def own_scores(model) -> torch.Tensor:
        """transformers' own forward of ``model``'s class: a token classifier read at each row's last token."""
        logits = model(**padded).logits
        return logits[torch.arange(2), last, 0] if logits.dim() == 3 else logits[:, 0]

    with torch.no_grad():
        first = last_token_scores(trainer.model, batch).squeeze(-1)
        if start in heads:
            torch.testing.assert_close(first, own_scores(auto_class.from_pretrained(folder).eval()),
                                       atol=1e-5, rtol=1e-5)
    trainer.fit()
    trainer.model.eval()
    if start == "token_classifier":
        assert float(trainer.model.score.bias.detach()) != pytest.approx(0.25)  # trained
    saved = latest_checkpoint(run_dir) / "hf"
    exported = tmp_path / "exported"
    assert main(["export", str(run_dir), str(exported)]) == 0
    with torch.no_grad():
        trained = last_token_scores(trainer.model, batch).squeeze(-1)
        for out in (saved, exported):
            assert AutoConfig.from_pretrained(out).architectures == [
                "Qwen2ForTokenClassification" if start == "token_classifier" else "Qwen2ForSequenceClassification"]
            torch.testing.assert_close(own_scores(auto_class.from_pretrained(out).eval()), trained,
                                       atol=1e-5, rtol=1e-5)
            worker_model = load_reward_model(str(out), dtype=torch.float32, device="cpu")
            torch.testing.assert_close(own_scores(worker_model), trained, atol=1e-5, rtol=1e-5)


def test_a_mixture_of_experts_adds_the_aux_loss_its_config_asks_for(pair_args, tmp_path):
    """output_router_logits in the model's config adds router_aux_loss_coef x the routers' load-balancing loss to
    the reward loss (its gradient with it), as trainer.router_aux_loss_coef does on a config that does not ask (TRL's
    RewardTrainer adds none: its RewardConfig passes 0); the aux loss and the step's routing are logged either way."""
    from reinforge.models.tiny import save_tiny_model

    firsts = {}
    for run, asks, settings in (("asks", True, {}), ("no", False, {}),
                                ("knob", False, {"trainer.router_aux_loss_coef": 0.5})):
        model_dir = save_tiny_model(tmp_path / f"moe-{run}", arch="qwen3_moe", num_layers=2,
                                    output_router_logits=asks, router_aux_loss_coef=0.5)
        assert main(["rm", *pair_args(tmp_path / f"run-{run}", **{"model.path": model_dir, "trainer.total_steps": 1,
                                                                    **settings})]) == 0
        [firsts[run]] = metrics_of(tmp_path / f"run-{run}")
    for first in firsts.values():
        assert first["train/moe/aux_loss"] > 0
        assert first["train/moe/load_imbalance"] >= 1.0 and 0 <= first["train/moe/unused_experts"] < 4
    assert firsts["asks"]["train/loss"] == pytest.approx(firsts["no"]["train/loss"], rel=1e-6)  # the same new head
    assert firsts["asks"]["train/moe/aux_loss"] == pytest.approx(firsts["no"]["train/moe/aux_loss"], rel=1e-5)
    assert firsts["asks"]["train/grad_norm"] != pytest.approx(firsts["no"]["train/grad_norm"], rel=1e-4)
    assert firsts["knob"]["train/grad_norm"] == pytest.approx(firsts["asks"]["train/grad_norm"], rel=1e-5)


def test_the_recorded_aux_loss_is_transformers_own_over_the_padded_pairs(pair_args, tmp_path):
    """The packed pair runs its prompt once; the routers' statistics count it once for each completion, as the causal
    LM's own aux loss over the two padded rows does."""
    from transformers import AutoModelForCausalLM

    from reinforge.engine.forward import routed_token_weights
    from reinforge.models.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_layers=2, output_router_logits=True)
    trainer = RewardModelTrainer(load_rm_config(None, pair_args(tmp_path / "run", **{"model.path": model_dir})))
    micro = next(trainer.micro_batches(next(iter(trainer.train_loader.batches_of_one_pass()))))
    recorder = trainer.router_recorder
    with torch.no_grad():
        with recorder.recording_forward():
            trainer._pair_rewards(micro)
        recorded = recorder.take(with_grad=False, token_weights=routed_token_weights(trainer.model.base_model, micro))
        causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        mask = micro["attention_mask"]
        padded = causal_lm(input_ids=micro["input_ids"], attention_mask=mask, output_router_logits=True,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False)
    assert float(recorded.aux_loss) == pytest.approx(float(padded.aux_loss), rel=1e-5)


def test_a_causal_lms_new_score_head_is_one_line_and_other_missing_weights_keep_transformers_report(tiny_model_dir,
                                                                                                    tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    from reinforge.trainer.preference.rm_trainer import load_reward_model_for_training

    with caplog.at_level("INFO"):
        load_reward_model_for_training(str(tiny_model_dir), pad_token_id=0)
    assert "LOAD REPORT" not in caplog.text
    assert f"model.path={tiny_model_dir} has no score head (a causal LM)" in caplog.text
    folder = tmp_path / "cut"  # a folder that lost a layer's weights: transformers' report stays
    folder.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.name != "model.safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    state = load_file(tiny_model_dir / "model.safetensors")
    save_file({name: tensor for name, tensor in state.items() if "layers.0.mlp" not in name},
              folder / "model.safetensors", metadata={"format": "pt"})
    caplog.clear()
    with caplog.at_level("INFO"):
        load_reward_model_for_training(str(folder), pad_token_id=0)
    assert "LOAD REPORT" in caplog.text and "layers.0.mlp" in caplog.text and "has no score head" not in caplog.text


LONGROPE_FACTORS = {"short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
                    "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0]}


@pytest.mark.parametrize("command", ["rm", "dpo"])
def test_a_pair_unshared_for_its_rotary_weighs_its_routers_by_the_unshared_plan(pair_args, tmp_path, command):
    """A LongRoPE mixture of experts whose chosen completion ends below the original length and rejected one past it:
    the packed forward runs the two sequences apart (a shared prompt's keys take one set of factors), and the routers'
    statistics weigh what it ran, equal to transformers' aux loss over the two sequences, each run alone."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from reinforge.engine.forward import routed_token_weights
    from reinforge.engine.packing import plan_of
    from reinforge.models.tiny import build_char_tokenizer, save_tiny_model
    from reinforge.trainer.preference.dpo_trainer import DPOTrainer

    row = {"prompt": [{"role": "user", "content": "q?"}], "chosen": [{"role": "assistant", "content": "y"}],
           "rejected": [{"role": "assistant", "content": "no, sorry, not at all"}]}
    pair = tokenize_pair(build_char_tokenizer(), row, PreferenceKeys())
    original = len(pair.prompt_ids) + len(pair.chosen_ids)  # the chosen sequence fits it, the rejected one does not
    assert len(pair.prompt_ids) + len(pair.rejected_ids) > original
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
            "short_mscale": 1.0, "long_mscale": 1.0, **LONGROPE_FACTORS}
    model_dir = save_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_layers=2, max_position_embeddings=4 * original,
                                rope_parameters=rope, original_max_position_embeddings=original)
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text(json.dumps(row) + "\n")
    config = (load_rm_config if command == "rm" else load_dpo_config)(None, pair_args(
        tmp_path / "run", **{"model.path": model_dir, "data.train_files": f"[{pairs_file}]", "data.batch_size": 1}))
    trainer = RewardModelTrainer(config) if command == "rm" else DPOTrainer(config)
    micro = next(trainer.micro_batches(next(iter(trainer.train_loader.batches_of_one_pass()))))
    assert plan_of(micro).kv_index is not None  # planned with the prompt shared
    recorder, routed = trainer.router_recorder, trainer.model.base_model if command == "rm" else trainer.model
    with torch.no_grad():
        with recorder.recording_forward():
            trainer._pair_rewards(micro) if command == "rm" else trainer._sequence_logps(trainer.model, micro)
        assert plan_of(micro).kv_index is None  # run with each completion's own prompt
        recorded = recorder.take(with_grad=False, token_weights=routed_token_weights(routed, micro))
        causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        alone = [causal_lm(input_ids=ids[mask.bool()][None], output_router_logits=True, use_cache=False).router_logits
                 for ids, mask in zip(micro["input_ids"], micro["attention_mask"], strict=True)]
    layers = [torch.cat([logits[layer] for logits in alone]) for layer in range(2)]
    expected = load_balancing_loss_func(tuple(layers), causal_lm.config.num_experts, causal_lm.config.num_experts_per_tok)
    assert float(recorded.aux_loss) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("text_pad_token_id", [None, 5])
def test_a_vision_language_classifier_exports_the_pad_token_training_read_before(pair_args, tmp_path,
                                                                                 text_pad_token_id):
    """Gemma 3's and Qwen3.5's classifiers pool by their text config's pad_token_id: training reads each reward
    before the tokenizer's pad token, and the exported folder's text config names that token (it kept none, and
    transformers refused a batch of two, or another, and it read a padded row at its padding)."""
    from tests.workers.test_reward_model import save_tiny_vision_language_classifier

    folder = save_tiny_vision_language_classifier(tmp_path / "start", text_pad_token_id)
    run_dir = tmp_path / "run"
    settings = {"model.path": folder, "trainer.total_steps": 1, "data.batch_size": 4, "optim.lr": 1e-2}
    trainer = RewardModelTrainer(load_rm_config(None, pair_args(run_dir, **settings)))
    trainer.fit()
    trainer.model.eval()
    batch, padded = a_packed_pair_and_its_padded_rows(AutoTokenizer.from_pretrained(folder))
    with torch.no_grad():
        trained = last_token_scores(trainer.model, batch).squeeze(-1)
        exported = AutoModelForSequenceClassification.from_pretrained(latest_checkpoint(run_dir) / "hf").eval()
        assert exported.config.get_text_config().pad_token_id == trainer.tokenizer.pad_token_id
        torch.testing.assert_close(exported(**padded).logits[:, 0], trained, atol=1e-5, rtol=1e-5)
