"""The hf/ folder of a checkpoint: the trained weights in the run's compute dtype, whatever dtype the model it
started from was saved in, for a causal LM and for a reward model's sequence classifier."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from reinforge.models import build_char_tokenizer, build_tiny_causal_lm, load_causal_lm, save_hf_folder
from reinforge.models.tiny import tiny_config
from reinforge.workers.checkpointing import save_sharded_hf_folder


def float32_model(kind: str, tokenizer, tmp_path):
    """The master weights as training holds them: a causal LM loaded in float32 from a float16 folder, or a
    classifier built in float32."""
    if kind == "classifier":
        config = tiny_config("qwen2", vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id)
        return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    base = build_tiny_causal_lm("qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    base_dir = save_hf_folder(base, tokenizer, tmp_path / "float16_base", dtype=torch.float16)
    assert json.loads((base_dir / "config.json").read_text())["dtype"] == "float16"
    return load_causal_lm(str(base_dir), dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("kind", ["causal_lm", "classifier"])
def test_the_checkpoint_holds_the_weights_in_the_compute_dtype_and_says_so(tmp_path, kind):
    tokenizer = build_char_tokenizer()
    model = float32_model(kind, tokenizer, tmp_path)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    save_sharded_hf_folder(model, type(model), tokenizer, tmp_path / "hf", dtype=torch.bfloat16)
    assert all(torch.equal(tensor, before[name]) and tensor.dtype == torch.float32
               for name, tensor in model.state_dict().items()), "the training model keeps its float32 weights"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    written = load_file(tmp_path / "hf" / "model.safetensors")  # a classifier's body too, not float32 as it trained
    assert {name for name, tensor in written.items() if tensor.dtype != torch.bfloat16} == set()
    model_class = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
    loaded = model_class.from_pretrained(tmp_path / "hf", dtype="auto").state_dict()
    trained = model.state_dict()
    assert loaded.keys() == trained.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, trained[name].to(torch.bfloat16)), name


@pytest.mark.parametrize(("arch", "dtype"), [("gpt_oss", torch.float16), ("deepseek_v3", torch.bfloat16)])
def test_the_checkpoint_builds_its_model_once_and_writes_what_save_hf_folder_writes(tmp_path, monkeypatch, arch, dtype):
    """The meta model that takes the gathered weights also says which of them stay float32 (gpt-oss's norms in
    float16; DeepSeek's router and its float32 bias): one build per save, and the folder is the one save_hf_folder
    writes from the unsharded model, byte for byte."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(arch, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    expected = save_hf_folder(model, tokenizer, tmp_path / "expected", dtype=dtype)
    model_class = type(model)
    builds = []
    build = model_class.__init__

    def counted_build(self, config, *args, **kwargs):
        builds.append(config)
        build(self, config, *args, **kwargs)

    monkeypatch.setattr(model_class, "__init__", counted_build)
    save_sharded_hf_folder(model, model_class, tokenizer, tmp_path / "hf", dtype=dtype)
    assert len(builds) == 1
    written = {path.name: path.read_bytes() for path in (tmp_path / "hf").iterdir()}
    assert written == {path.name: path.read_bytes() for path in expected.iterdir()}
