"""Random-weights model folders: config.json and a seed, the weights built where the model loads."""

from __future__ import annotations

import pytest
import torch

from reinforge.models import build_char_tokenizer, load_causal_lm, load_tokenizer
from reinforge.models.random_weights import RANDOM_WEIGHTS_FILE, write_random_weights_folder
from reinforge.models.tiny import tiny_config


def test_a_folder_without_weight_files_loads_the_same_seeded_model_every_time(tmp_path):
    folder = write_random_weights_folder(tmp_path / "model", tiny_config("qwen3_moe"), build_char_tokenizer(), seed=3)
    assert sorted(path.name for path in folder.iterdir() if "safetensors" in path.name or ".bin" in path.name) == []
    state = torch.random.get_rng_state()
    first = load_causal_lm(str(folder), dtype=torch.float32, device="cpu")
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator is left alone
    second = load_causal_lm(str(folder), dtype=torch.bfloat16, device="cpu")
    assert first.config.use_cache is False and type(first).__name__ == "Qwen3MoeForCausalLM"
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert a.dtype == torch.float32 and b.dtype == torch.bfloat16
        assert torch.equal(a.to(torch.bfloat16), b), name  # drawn in bf16, then cast
    experts = first.model.layers[0].mlp.experts.gate_up_proj
    assert experts.std() > 0
    assert load_tokenizer(str(folder)).pad_token is not None
    (folder / RANDOM_WEIGHTS_FILE).write_text('{"seed": 4}')
    other = load_causal_lm(str(folder), dtype=torch.float32, device="cpu")
    assert not torch.equal(other.model.layers[0].mlp.experts.gate_up_proj, experts)


def test_a_seedless_random_weights_file_is_refused_in_one_line(tmp_path):
    folder = write_random_weights_folder(tmp_path / "model", tiny_config("qwen2"), build_char_tokenizer())
    (folder / RANDOM_WEIGHTS_FILE).write_text("{}")
    with pytest.raises(ValueError, match=r"random_weights.json does not name a seed .*\{\"seed\": 0\}"):
        load_causal_lm(str(folder), dtype=torch.float32, device="cpu")


def test_the_30b_bench_shape_writes_no_weight_files(tmp_path):
    from reinforge.bench.shapes import shape_config
    from reinforge.bench.train import write_model
    from reinforge.engine.memory_plan import ModelShape

    folder = write_model(tmp_path, tiny=False, size="qwen3-30b-a3b")
    assert sum(path.stat().st_size for path in folder.iterdir()) < 2**20
    assert (folder / RANDOM_WEIGHTS_FILE).is_file()
    assert ModelShape.from_model_path(str(folder)) == ModelShape.from_hf_config(shape_config("qwen3-30b-a3b"))
