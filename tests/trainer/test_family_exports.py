"""What a one-step GRPO run writes, family by family: the checkpoint's hf/ and ``reinforge export``'s folder load with
the Auto classes, keep the input's config, generation config, tokenizer and chat template, and hold the trained
weights (a LoRA run's merged: W + scale * B A, on fused projections and MoE models too); a mixture of experts
resumed from its checkpoint goes on as the run that was not stopped."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from reinforge.cli import main
from reinforge.models import save_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_trainer import COMPARED_PREFIXES  # noqa: E402

GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "eos_token_id": [2, 1]}
"""Sampling defaults a released model ships with, which the folders must keep."""

FAMILIES = ["qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3", "qwen3_moe",
            "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_neox"]
LORA_RANK, LORA_ALPHA = 4, 64.0


def train(root: Path, arch: str, data: Path, lora: bool, model_dir: Path | None = None, run_dir: Path | None = None,
          **overrides: object) -> tuple[Path, Path]:
    """(the input model, the run folder) of a one-step run on a tiny ``arch`` model (or ``model_dir``)."""
    if model_dir is None:
        model_dir = save_tiny_model(root / "model", arch)
        generation_file = model_dir / "generation_config.json"
        generation_file.write_text(json.dumps(json.loads(generation_file.read_text()) | GENERATION))
    run_dir = run_dir or root / "run"
    args = {"model.path": model_dir, "data.train_files": f"[{data / 'train.parquet'}]", "data.train_batch_size": 2,
            "data.max_prompt_length": 64, "data.max_response_length": 4, "rollout.n": 2,
            "trainer.output_dir": run_dir, "trainer.loggers": "[jsonl]", "trainer.total_steps": 1,
            "trainer.val_before_train": False, "actor.optim.lr": 1e-2, "actor.entropy_coeff": 0.5,
            "reward.num_workers": 0}
    if lora:
        args |= {"model.lora.rank": LORA_RANK, "model.lora.alpha": LORA_ALPHA}
    assert main(["train", *(f"{key}={value}" for key, value in {**args, **overrides}.items())]) == 0
    return model_dir, run_dir


def train_and_export(root: Path, arch: str, data: Path, lora: bool) -> tuple[Path, Path, Path]:
    """(the input model, the checkpoint, the exported folder) of a one-step run on a tiny ``arch`` model."""
    model_dir, run_dir = train(root, arch, data, lora)
    assert main(["export", str(run_dir), str(root / "exported")]) == 0
    [checkpoint] = (run_dir / "checkpoints").glob("step_*")
    return model_dir, checkpoint, root / "exported"


def expected_weights(model_dir: Path, checkpoint: Path) -> dict[str, torch.Tensor]:
    """The trained weights by plain name: the state itself, or the base with each adapter merged in."""
    state = torch.load(checkpoint / "actor_state.pt", weights_only=True)["model"]
    if not (checkpoint / "adapter").is_dir():
        return state
    weights = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    for name, lora_a in state.items():
        if ".lora_A." in name:
            prefix = name.split(".lora_A.")[0].removeprefix("base_model.model.")
            lora_b = state[name.replace(".lora_A.", ".lora_B.")]
            weights[f"{prefix}.weight"] = weights[f"{prefix}.weight"] + LORA_ALPHA / LORA_RANK * (lora_b @ lora_a)
    return weights


def assert_same_model_folder(model_dir: Path, folder: Path, expected: dict[str, torch.Tensor]) -> None:
    def config(path: Path) -> dict:
        return {key: value for key, value in json.loads(path.read_text()).items() if key != "transformers_version"}

    assert config(folder / "config.json") == config(model_dir / "config.json")
    assert config(folder / "generation_config.json") == config(model_dir / "generation_config.json")
    assert (folder / "chat_template.jinja").read_text() == (model_dir / "chat_template.jinja").read_text()
    tokenizer, source_tokenizer = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(model_dir)
    text = "<|im_start|>user\n2+3?<|im_end|>\n"
    assert tokenizer(text)["input_ids"] == source_tokenizer(text)["input_ids"]
    assert (tokenizer.eos_token, tokenizer.pad_token) == (source_tokenizer.eos_token, source_tokenizer.pad_token)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight is model.get_input_embeddings().weight, "the tiny models tie their embeddings"
    weights = model.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)


def test_export_keeps_the_generation_config_of_the_checkpoint(arithmetic_data_dir, tmp_path):
    model_dir, checkpoint, exported = train_and_export(tmp_path, "qwen2", arithmetic_data_dir, lora=False)
    for folder in (checkpoint / "hf", exported):
        saved = json.loads((folder / "generation_config.json").read_text())
        assert {key: saved.get(key) for key in GENERATION} == GENERATION, folder


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_checkpoint_and_export_are_the_trained_model(arithmetic_data_dir, tmp_path, arch, lora):
    model_dir, checkpoint, exported = train_and_export(tmp_path, arch, arithmetic_data_dir, lora)
    expected = expected_weights(model_dir, checkpoint)
    assert not any("lora_" in name or "base_model" in name for name in expected)
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    changed = {name.removesuffix(".weight").rsplit(".", 1)[-1] for name in base if not torch.equal(expected[name], base[name])}
    assert changed, "one step changed some weight"
    if arch == "phi3" and lora:
        assert {"qkv_proj", "gate_up_proj"} <= changed, "the fused projections are adapted and merged"
    for folder in (checkpoint / "hf", exported):
        assert_same_model_folder(model_dir, folder, expected)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bfloat16_run_writes_bfloat16_folders_and_exports_its_float32_master_weights_on_request(
        arithmetic_data_dir, tmp_path, lora):
    """A run computing in bfloat16 writes hf/ and (by default) its export in bfloat16, as its config.json says: the
    trained weights rounded once, DeepSeek V3's router kept in float32 as transformers loads it. actor_state.pt keeps
    the float32 master weights, which ``--dtype float32`` exports."""
    model_dir, run_dir = train(tmp_path, "deepseek_v3", arithmetic_data_dir, lora, **{"model.dtype": "bfloat16"})
    [checkpoint] = (run_dir / "checkpoints").glob("step_*")
    assert main(["export", str(run_dir), str(tmp_path / "exported")]) == 0
    assert main(["export", str(run_dir), str(tmp_path / "master"), "--dtype", "float32"]) == 0
    state = torch.load(checkpoint / "actor_state.pt", weights_only=True)["model"]
    assert {tensor.dtype for tensor in state.values()} == {torch.float32}
    expected = expected_weights(model_dir, checkpoint)
    hf, exported, master = ({"config": json.loads((folder / "config.json").read_text()),
                             "weights": AutoModelForCausalLM.from_pretrained(folder, dtype="auto").state_dict()}
                            for folder in (checkpoint / "hf", tmp_path / "exported", tmp_path / "master"))
    assert [folder["config"]["dtype"] for folder in (hf, exported, master)] == ["bfloat16", "bfloat16", "float32"]
    router = {name for name in expected if name.endswith(("mlp.gate.weight", "e_score_correction_bias"))}
    assert router and {hf["weights"][name].dtype for name in router} == {torch.float32}
    assert {tensor.dtype for name, tensor in hf["weights"].items() if name not in router} == {torch.bfloat16}
    for name, tensor in hf["weights"].items():
        assert torch.equal(exported["weights"][name], tensor), name
        assert torch.equal(tensor, expected[name].to(tensor.dtype)) or lora, name  # LoRA merged into a bfloat16 base
        torch.testing.assert_close(master["weights"][name], expected[name], rtol=0, atol=0 if not lora else 1e-6)


def test_a_lora_export_interrupted_while_copying_the_adapters_leaves_no_folder(arithmetic_data_dir, tmp_path,
                                                                              monkeypatch):
    """The merged model and its adapter/ appear together: a failure half-way through the adapters leaves no
    model folder without them (a fresh export) and the previous export whole (one written over with --force)."""
    _, run_dir = train(tmp_path, "qwen2", arithmetic_data_dir, lora=True)
    previous = tmp_path / "previous"
    assert main(["export", str(run_dir), str(previous)]) == 0
    before = {path.relative_to(previous): path.read_bytes() for path in previous.rglob("*") if path.is_file()}
    copytree = shutil.copytree

    def fails_half_way(source, target, **kwargs):
        Path(target).mkdir(parents=True)
        shutil.copyfile(Path(source) / "adapter_config.json", Path(target) / "adapter_config.json")
        raise OSError("no space left on device")

    monkeypatch.setattr(shutil, "copytree", fails_half_way)
    for out, force in ((tmp_path / "fresh", []), (previous, ["--force"])):
        assert main(["export", str(run_dir), str(out), *force]) != 0
    monkeypatch.setattr(shutil, "copytree", copytree)
    assert not (tmp_path / "fresh").exists()
    assert {path.relative_to(previous): path.read_bytes() for path in previous.rglob("*") if path.is_file()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model", "previous", "run"]


@pytest.mark.parametrize("arch, lora", [("mixtral", False), ("deepseek_v3", True)], ids=["mixtral-full", "deepseek_v3-lora"])
def test_a_mixture_of_experts_resumed_from_its_checkpoint_continues_as_the_uninterrupted_run(
        arithmetic_data_dir, tmp_path, arch, lora):
    """A run stopped after step 1's checkpoint (step 2's never written) and run again ends as the run that went on."""
    model_dir, run_dir = train(tmp_path, arch, arithmetic_data_dir, lora, **{
        "trainer.total_steps": 2, "trainer.save_every": 1, "actor.mini_batch_size": 1, "actor.use_kl_loss": True})
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    (resumed / "checkpoints" / "latest").write_text("step_000001\n")
    with open(resumed / "metrics.jsonl") as metrics:
        first = metrics.readline()
    (resumed / "metrics.jsonl").write_text(first)
    train(tmp_path, arch, arithmetic_data_dir, lora, model_dir=model_dir, run_dir=resumed, **{
        "trainer.total_steps": 2, "trainer.save_every": 1, "actor.mini_batch_size": 1, "actor.use_kl_loss": True})

    def compared(folder: Path) -> list[dict]:
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return [{key: value for key, value in row.items() if not key.startswith(COMPARED_PREFIXES)} for row in rows]

    assert compared(resumed) == compared(run_dir)
    states = [torch.load(folder / "checkpoints" / "step_000002" / "actor_state.pt", weights_only=True)
              for folder in (run_dir, resumed)]
    assert all(torch.equal(states[0]["model"][name], states[1]["model"][name]) for name in states[0]["model"])
