import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from reinforge.models import atomic_folder, build_char_tokenizer, build_tiny_causal_lm, load_causal_lm, save_hf_folder
from reinforge.models.export import state_dict_in_dtype
from reinforge.models.tiny_vlm import build_tiny_vlm


def tiny_pair(arch="qwen2", tie_word_embeddings=True, seed=0):
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(arch, vocab_size=len(tokenizer), tie_word_embeddings=tie_word_embeddings, seed=seed,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return model, tokenizer


@pytest.mark.parametrize("arch, tie_word_embeddings", [("qwen2", True), ("llama", False)])
def test_export_loads_back_with_auto_classes(tmp_path, arch, tie_word_embeddings):
    model, tokenizer = tiny_pair(arch, tie_word_embeddings)
    model.config.use_cache = False
    out_dir = save_hf_folder(model, tokenizer, tmp_path / "hf")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]
    names = {path.name for path in out_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert json.loads((out_dir / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False, "the training model keeps use_cache off"

    loaded = AutoModelForCausalLM.from_pretrained(out_dir)
    loaded_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    input_ids = torch.randint(0, len(tokenizer), (2, 6))
    torch.testing.assert_close(loaded(input_ids=input_ids).logits, model(input_ids=input_ids).logits)
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == tie_word_embeddings
    assert loaded_tokenizer.decode(loaded_tokenizer("a b\n3")["input_ids"]) == "a b\n3"
    assert loaded_tokenizer.eos_token == "<|im_end|>"
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast", "a class transformers 4.x knows too"


def test_export_in_bfloat16_writes_tied_weight_once(tmp_path):
    model, tokenizer = tiny_pair("qwen2")
    out_dir = save_hf_folder(model, tokenizer, tmp_path / "hf", dtype=torch.bfloat16)
    with safe_open(out_dir / "model.safetensors", framework="pt") as weights:
        keys = list(weights.keys())
        assert all(weights.get_tensor(key).dtype == torch.bfloat16 for key in keys)
    assert "lm_head.weight" not in keys
    config = json.loads((out_dir / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert next(model.parameters()).dtype == torch.float32, "the model itself is not cast"

    loaded = load_causal_lm(str(out_dir), dtype=torch.float32, device="cpu")
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16).float())


ROUTER = ["model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"]
NORMS = ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
         "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight", "model.norm.weight"]


@pytest.mark.parametrize("arch, dtype, kept", [
    ("deepseek_v3", torch.bfloat16, ROUTER),  # _keep_in_fp32_modules_strict, the bias also built in float32
    ("deepseek_v3", torch.float16, ROUTER),
    ("gpt_oss", torch.float16, NORMS),  # _keep_in_fp32_modules: kept for float16 only
    ("gpt_oss", torch.bfloat16, []),
    ("qwen2_5_vl", torch.bfloat16, []),
], ids=["deepseek_v3-bf16", "deepseek_v3-fp16", "gpt_oss-fp16", "gpt_oss-bf16", "qwen2_5_vl-bf16"])
def test_a_folder_in_a_lower_dtype_loads_back_to_the_very_tensors_it_was_written_with(tmp_path, arch, dtype, kept):
    """What transformers keeps in float32 when it loads a model in ``dtype`` is written in float32, the rest in
    ``dtype``: ``from_pretrained(folder, dtype="auto")`` gives back the written tensors, dtype and bits."""
    if arch == "qwen2_5_vl":
        model, tokenizer, model_class = build_tiny_vlm(arch), None, AutoModelForImageTextToText
    else:
        (model, tokenizer), model_class = tiny_pair(arch), AutoModelForCausalLM
    written = state_dict_in_dtype(model, dtype)
    assert sorted(name for name, tensor in written.items() if tensor.dtype == torch.float32) == kept
    out_dir = save_hf_folder(model, tokenizer, tmp_path / "hf", dtype=dtype)
    assert json.loads((out_dir / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    loaded = model_class.from_pretrained(out_dir, dtype="auto").state_dict()
    assert loaded.keys() == written.keys()
    for name, tensor in written.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
        if tensor.is_floating_point():
            assert torch.equal(tensor, model.state_dict()[name].to(tensor.dtype)), name


def test_export_replaces_an_existing_folder(tmp_path):
    out_dir = tmp_path / "hf"
    save_hf_folder(*tiny_pair(seed=1), out_dir)
    (out_dir / "stale.txt").write_text("from the old save")
    model, tokenizer = tiny_pair(seed=2)
    save_hf_folder(model, tokenizer, out_dir)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]
    assert not (out_dir / "stale.txt").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out_dir)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)


def test_a_saved_folders_files_are_readable_as_the_umask_makes_new_files(tmp_path):
    """transformers writes model.safetensors through a private temporary file (0600); the folder's files all get the
    mode the umask gives a new file, so the weights are as readable as the config beside them."""
    model, tokenizer = build_tiny_causal_lm(), build_char_tokenizer()
    previous = os.umask(0o022)
    try:
        save_hf_folder(model, tokenizer, tmp_path / "hf")
    finally:
        os.umask(previous)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "hf").iterdir() if path.is_file()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes


def test_failed_save_keeps_the_old_folder_and_cleans_up(tmp_path):
    out_dir = tmp_path / "hf"
    out_dir.mkdir()
    (out_dir / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="disk full"), atomic_folder(out_dir) as staging:
        assert staging.name == f"hf.tmp-{os.getpid()}"
        (staging / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]
    assert sorted(path.name for path in out_dir.iterdir()) == ["config.json"]


def test_export_refuses_to_overwrite_a_file(tmp_path):
    (tmp_path / "hf").write_text("not a folder")
    with pytest.raises(FileExistsError, match="a file of that name exists"):
        save_hf_folder(*tiny_pair(), tmp_path / "hf")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_loads_in_auto_dtype_and_exports(tiny_model_dir, tmp_path):
    from reinforge.models import resolve_dtype

    device = torch.device("cuda")
    model = load_causal_lm(str(tiny_model_dir), dtype=resolve_dtype("auto", device), device=device)
    assert next(model.parameters()).dtype == torch.bfloat16 and next(model.parameters()).is_cuda
    out_dir = save_hf_folder(model, AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path / "hf", dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(out_dir)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight.float().cpu())


def test_a_loaded_tokenizer_is_saved_with_the_pad_token_and_padding_side_it_had(tmp_path):
    """load_tokenizer pads on the left, with its EOS token when there is no pad token; a saved folder's tokenizer is
    the model's own again."""
    from reinforge.models import load_tokenizer

    source = tmp_path / "source"
    build_char_tokenizer().save_pretrained(source)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    del tokenizer_config["pad_token"]
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"padding_side": "right"}))
    tokenizer = load_tokenizer(str(source))
    assert (tokenizer.pad_token, tokenizer.padding_side) == ("<|im_end|>", "left")
    model, _ = tiny_pair("llama")  # (transformers' Qwen2Tokenizer has a pad token of its own)
    saved = AutoTokenizer.from_pretrained(save_hf_folder(model, tokenizer, tmp_path / "hf"))
    assert (saved.pad_token, saved.padding_side, saved.eos_token) == (None, "right", "<|im_end|>")
    assert (tokenizer.pad_token, tokenizer.padding_side) == ("<|im_end|>", "left"), "the tokenizer itself is unchanged"


def test_a_vision_language_folder_keeps_the_processor_settings_of_the_folder_it_was_trained_from(tmp_path):
    """A processor loaded without its video processor (no torchvision) saves no video settings; the folder takes them
    from the source, so that AutoProcessor finds them as it finds the source's."""
    from transformers.models.auto.video_processing_auto import get_video_processor_config

    from reinforge.models.tiny_vlm import save_tiny_vlm
    from reinforge.models.vision import load_processor

    source = save_tiny_vlm(tmp_path / "source")
    processor = load_processor(source)
    out_dir = save_hf_folder(AutoModelForImageTextToText.from_pretrained(source), processor, tmp_path / "hf",
                             processor_files_from=source)
    assert get_video_processor_config(out_dir) == get_video_processor_config(source) != {}
    assert load_processor(out_dir).image_processor.to_dict() == processor.image_processor.to_dict()


def test_an_exported_vision_language_checkpoint_keeps_the_video_settings_of_its_hf_folder(tmp_path):
    """reinforge export of a full-weights VLM checkpoint: a processor loaded without torchvision saves no video
    settings, and AutoProcessor (where torchvision is installed) would then fail to load the folder."""
    from transformers.models.auto.video_processing_auto import get_video_processor_config

    from reinforge.models.tiny_vlm import save_tiny_vlm
    from reinforge.trainer.export import export_checkpoint

    checkpoint = tmp_path / "checkpoints" / "step_000001"
    hf_folder = save_tiny_vlm(checkpoint / "hf")
    model = AutoModelForImageTextToText.from_pretrained(hf_folder)
    torch.save({"model": model.state_dict()}, checkpoint / "actor_state.pt")
    torch.save({}, checkpoint / "trainer_state.pt")
    (checkpoint / "manifest.json").write_text(json.dumps({"files": {}}))
    out = export_checkpoint(checkpoint, tmp_path / "out")
    assert get_video_processor_config(out) == get_video_processor_config(hf_folder) != {}
