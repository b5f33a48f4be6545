"""LoRA in the RL loop on a tiny model: learning, the reference as the adapter-free base, resume, export."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from reinforge.cli import main
from reinforge.models import save_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_trainer import (  # noqa: E402
    COMPARED_PREFIXES,
    CONTAINS_SEVEN,
    base_args,
    read_metrics,
    sigkill_at_step,
    train_in_a_process,
)

REPO = Path(__file__).resolve().parents[2]
LORA = {"model.lora.rank": 32, "model.lora.alpha": 64, "actor.optim.lr": 2e-2}


@pytest.mark.slow
def test_reward_rises_with_lora(arithmetic_data_dir, tmp_path):
    """LoRA leaves the output projection frozen. The tiny model's tied embedding is initialised with std 0.02,
    so no change of the hidden state can move a token's logit by more than about 1.3: too little to learn
    "say 7" from any adapter. Scaled by 5 (logits still near uniform: entropy 5.5 nats) the base can express it."""
    model_dir = save_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(5.0)
    model.save_pretrained(model_dir)
    reward_file = tmp_path / "seven.py"
    reward_file.write_text(CONTAINS_SEVEN)
    run_dir = tmp_path / "run"
    # on a 2-core CPU the mean reward went from near 0 to 0.97 at step 11 and 1.0 from step 13: 20 steps leave room
    args = base_args(model_dir, arithmetic_data_dir, run_dir, **LORA, **{
        "trainer.total_steps": 20, "rollout.n": 8, "reward.num_workers": 0,
        "reward.custom_function": f"{reward_file}:compute_score"})
    assert main(["train", *args]) == 0
    rows = read_metrics(run_dir)
    scores = [row["critic/score/mean"] for row in rows if "critic/score/mean" in row]
    assert len(scores) == 20
    start, end = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert start < 0.25
    assert end > 0.6, scores
    assert all(row["timing_s/gen/lora_merge"] > 0 for row in rows if "timing_s/gen/lora_merge" in row)


def test_lora_run_with_kl_checkpoint_and_export(tiny_model_dir, arithmetic_data_dir, tmp_path):
    """One LoRA run with a KL loss (reference = the actor without adapters), a checkpoint and both exports."""
    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **LORA, **{
        "actor.use_kl_loss": True, "actor.kl_loss_type": "k1", "rollout.name": "native"})
    assert main(["train", *args]) == 0
    rows = read_metrics(run_dir)
    assert rows[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the adapters start at zero: actor == base
    assert abs(rows[-1]["actor/kl_loss"]) > 1e-6
    assert all("timing_s/gen/lora_merge" in row for row in rows)
    checkpoint = run_dir / "checkpoints" / "step_000002"
    saved = torch.load(checkpoint / "actor_state.pt", weights_only=True)
    assert [name for name in saved["model"] if ".lora_A." not in name and ".lora_B." not in name] == []

    out = tmp_path / "exported"
    assert main(["export", str(run_dir), str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    tokens = torch.tensor([[5, 17, 33, 8, 60, 61, 2, 9]])
    with torch.no_grad():
        expected = adapted(tokens).logits
        torch.testing.assert_close(merged(tokens).logits, expected, atol=2e-5, rtol=1e-4)
        with adapted.disable_adapter():
            assert (adapted(tokens).logits - expected).abs().max() > 1e-3  # the adapters did learn something
    checkpoint_hf = AutoModelForCausalLM.from_pretrained(checkpoint / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(checkpoint_hf(tokens).logits, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_lora_resume_after_sigkill_matches_an_uninterrupted_run(tiny_model_dir, arithmetic_data_dir, tmp_path):
    common = {**LORA, "trainer.total_steps": 5, "trainer.save_every": 2, "trainer.keep_last": 3,
              "actor.mini_batch_size": 2, "actor.shuffle": True, "actor.use_kl_loss": True,
              "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive"}
    reference_dir = tmp_path / "reference"
    finished = train_in_a_process(base_args(tiny_model_dir, arithmetic_data_dir, reference_dir, **common))
    assert finished.returncode == 0, finished.stderr[-2000:]

    killed_dir = tmp_path / "killed"
    args = base_args(tiny_model_dir, arithmetic_data_dir, killed_dir, **common)
    sigkill_at_step(args, killed_dir, 3, timeout_s=120)
    assert (killed_dir / "checkpoints" / "latest").read_text().strip() in ("step_000002", "step_000004")
    finished = train_in_a_process(args)
    assert finished.returncode == 0, finished.stderr[-2000:]

    def comparable(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if not k.startswith(COMPARED_PREFIXES)} for row in rows]

    assert comparable(read_metrics(killed_dir)) == comparable(read_metrics(reference_dir))


@pytest.mark.slow
@pytest.mark.parametrize("separate_rollout", [False, True])
def test_lora_in_one_step_off_mode(tiny_model_dir, arithmetic_data_dir, tmp_path, separate_rollout):
    """The rollout's own weight copy (in this worker or a separate one) receives the merged weights by plain name."""
    run_dir = tmp_path / "run"
    args = base_args(tiny_model_dir, arithmetic_data_dir, run_dir, **LORA, **{
        "trainer.mode": "one_step_off", "trainer.separate_rollout": separate_rollout, "trainer.total_steps": 3,
        "reward.num_workers": 0})
    assert main(["train", *args]) == 0
    rows = read_metrics(run_dir)
    assert [row["async/staleness_max"] for row in rows] == [0.0, 1.0, 1.0]


def test_a_vision_language_lora_run_exports_a_model_folder_with_its_processor(tmp_path):
    """The merged export of a LoRA run on a VLM keeps the processor beside the model, as the checkpoint's hf/ does:
    it is a model folder the next run (and transformers) loads, images and all."""
    from reinforge.demo.vision_task import VisionDemoTask
    from reinforge.models.tiny_vlm import save_tiny_vlm
    from reinforge.models.vision import load_processor

    model_dir = save_tiny_vlm(tmp_path / "vlm", "qwen2_5_vl")
    files = VisionDemoTask(num_train=2, num_test=1, num_sft=1).write(tmp_path / "data")
    run_dir = tmp_path / "run"
    args = {"model.path": model_dir, "data.train_files": f"[{files['train']}]", "data.train_batch_size": 2,
            "data.max_prompt_length": 64, "data.max_response_length": 2, "rollout.n": 2, "model.lora.rank": 4,
            "trainer.output_dir": run_dir, "trainer.total_steps": 1, "trainer.val_before_train": False,
            "trainer.loggers": "[jsonl]", "reward.num_workers": 0, "actor.entropy_coeff": 0.5, "actor.optim.lr": 1e-2,
            "reward.custom_function": f"{REPO / 'reinforge/demo/vision_reward.py'}:compute_score"}
    assert main(["train", *(f"{key}={value}" for key, value in args.items())]) == 0
    out = tmp_path / "exported"
    assert main(["export", str(run_dir), str(out)]) == 0
    processor = load_processor(out)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor" and (out / "adapter" / "adapter_config.json").is_file()
    from transformers import AutoModelForImageTextToText

    [checkpoint_hf] = run_dir.glob("checkpoints/*/hf")
    merged, saved = (AutoModelForImageTextToText.from_pretrained(folder).state_dict() for folder in (out, checkpoint_hf))
    assert all(torch.equal(merged[name], saved[name]) for name in saved)


@pytest.mark.parametrize("installed", [None, "0.17.1"])
def test_lora_without_a_peft_that_makes_the_adapters_is_refused_in_one_line_before_the_model_loads(
        tiny_model_dir, arithmetic_data_dir, tmp_path, monkeypatch, capsys, installed):
    import importlib.metadata

    real_version = importlib.metadata.version

    def version(name):
        if name != "peft":
            return real_version(name)
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: pytest.fail("the model loaded"))
    args = base_args(tiny_model_dir, arithmetic_data_dir, tmp_path / "run", **LORA)
    assert main(["train", *args]) != 0
    [line] = [line for line in capsys.readouterr().err.splitlines() if "peft" in line]
    found = "peft is not installed here" if installed is None else \
        "peft 0.17.1 is installed here, older than 0.18, the first that makes them on transformers 5"
    assert line.endswith(f"model.lora.rank=32 trains LoRA adapters with peft, and {found}; pip install -U "
                         "'peft>=0.18' (or reinforge[lora]), or set model.lora.rank=0 to train every weight")


def test_exporting_adapters_whose_base_model_moved_names_the_adapter_config(tmp_path):
    """The base's path comes from the checkpoint's adapter_config.json: the line said to check model.path."""
    import json

    from reinforge.trainer.export import _export_lora

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16,
                                                             "base_model_name_or_path": str(tmp_path / "moved")}))
    with pytest.raises(FileNotFoundError) as refusal:
        _export_lora(adapter, {}, None, tmp_path / "out", torch.float32)
    assert str(refusal.value) == (f"{adapter}/adapter_config.json names the base model {tmp_path / 'moved'}, which "
                                  "does not exist (any more); the adapters are merged into it: put the base model back "
                                  "there")
    assert not (tmp_path / "out").exists()
