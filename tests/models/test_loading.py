import json
import logging
import re
import shutil
import warnings

import pytest
import torch

from reinforge.models import check_model_folder, load_causal_lm, load_tokenizer, loading, resolve_dtype, save_tiny_model
from reinforge.models.tiny import build_tiny_causal_lm


def test_resolve_dtype():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; use auto, float32, bfloat16, float16"):
        resolve_dtype("fp8", torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_causal_lm(tiny_model_dir, dtype):
    model = load_causal_lm(str(tiny_model_dir), dtype=dtype, device="cpu")
    assert next(model.parameters()).dtype == dtype
    assert model.config.use_cache is False
    assert model.generation_config.use_cache is True
    # transformers' own modules, not layers swapped for kernels from the Hub (its default since 5.25)
    assert model.use_kernels is False


def test_load_causal_lm_with_gradient_checkpointing(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device="cpu", gradient_checkpointing=True)
    model.train()
    num_layer_calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *args: num_layer_calls.append(1))
    input_ids = torch.randint(0, model.config.vocab_size, (2, 5))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert len(num_layer_calls) == 2, "backward recomputes the checkpointed layer"
    assert model.get_input_embeddings().weight.grad is not None


def test_load_tokenizer_pads_left(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "<|endoftext|>"


def test_load_tokenizer_falls_back_to_eos_for_padding(tmp_path, caplog):
    # llama: transformers 5 loads a qwen2 folder with Qwen2Tokenizer, whose pad token defaults to <|endoftext|>
    folder = save_tiny_model(tmp_path / "no-pad", arch="llama")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("pad_token")
    config["padding_side"] = "right"
    config_path.write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="reinforge.models.loading"):
        tokenizer = load_tokenizer(str(folder))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.padding_side == "left"
    assert "no pad token; padding with its EOS token '<|im_end|>'" in caplog.text


def test_missing_folder_is_one_clear_line(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"model folder {missing} does not exist"):
        load_causal_lm(str(missing), dtype=torch.float32, device="cpu")
    with pytest.raises(FileNotFoundError, match=f"tokenizer folder {missing} does not exist"):
        load_tokenizer(str(missing))


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json; point model.path at a Hugging Face model folder"):
        check_model_folder(tmp_path)
    checkpoint = tmp_path / "step_000002"  # a run's checkpoint, whose model is its hf/ folder
    (checkpoint / "hf").mkdir(parents=True)
    (checkpoint / "hf" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as refusal:
        check_model_folder(checkpoint, "critic.model_path")
    assert str(refusal.value) == (f"model folder {checkpoint} has no config.json; a checkpoint's model is its hf/ "
                                  f"folder: set critic.model_path={checkpoint / 'hf'}")
    build_tiny_causal_lm("qwen2", vocab_size=20).config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="has config.json but no weights"):
        check_model_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match="has no tokenizer files"):
        load_tokenizer(str(tmp_path))


def test_half_written_folders_are_refused(tiny_model_dir, tmp_path):
    with_marker = shutil.copytree(tiny_model_dir, tmp_path / "marker")
    (with_marker / "model.safetensors.incomplete").touch()
    with pytest.raises(FileNotFoundError, match="looks half-written \\(found model.safetensors.incomplete\\)"):
        check_model_folder(with_marker)

    sharded = shutil.copytree(tiny_model_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="1 missing shard\\(s\\), first model-00002-of-00002.safetensors"):
        check_model_folder(sharded)

    for name, keep in (("cut", 0.5), ("cut-in-header", 12)):  # a copy cut off: in its tensors, in its header
        cut = shutil.copytree(tiny_model_dir, tmp_path / name)
        data = (cut / "model.safetensors").read_bytes()
        (cut / "model.safetensors").write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
        found = (f"model.safetensors holds {int(len(data) * 0.5)} bytes where its header describes {len(data)}"
                 if keep < 1 else "model.safetensors's header is cut off or unreadable")
        with pytest.raises(FileNotFoundError, match=f"^model folder {cut} is half-written: {re.escape(found)}; copy "
                                                    "or download it again, or save the model again$"):
            check_model_folder(cut)

    staging = shutil.copytree(tiny_model_dir, tmp_path / "model.tmp-1234")
    with pytest.raises(FileNotFoundError, match="temporary folder of an unfinished save"):
        check_model_folder(staging)

    check_model_folder(tiny_model_dir)


def test_unreachable_hub_id_is_one_line(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(OSError, match="^'no-such-org/no-such-model' is not a local folder and could not be loaded "
                                      "from the hub \\(We couldn't connect to 'https://huggingface.co' to load the files.\\);"):
        load_tokenizer("no-such-org/no-such-model")


def test_a_run_longer_than_the_models_positions_is_warned_of_once(tmp_path, caplog):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    with caplog.at_level(logging.WARNING):
        assert not loading.warn_if_beyond_context(str(folder), 128, "a + b")
        assert loading.warn_if_beyond_context(str(folder), 129, "a + b")
    assert len(caplog.records) == 1 and "a + b = 129 tokens, more than the 128 positions" in caplog.text
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 128,
                                                    "rope_scaling": {"type": "yarn", "factor": 4.0}}))
    assert not loading.warn_if_beyond_context(str(folder), 512, "a + b")  # rope scaling stretches the context
    assert not loading.warn_if_beyond_context("Qwen/Qwen2.5-0.5B", 10**6, "a + b")  # nothing local to read


def tiny_family_config(model_type: str, **positions):
    """A one-layer config of ``model_type`` (transformers' own class), its positions given by ``positions``."""
    from transformers import AutoConfig

    sizes = {"gpt2": dict(n_embd=16, n_layer=1, n_head=2), "gptj": dict(n_embd=16, n_layer=1, n_head=2, rotary_dim=4),
             "opt": dict(hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2,
                         word_embed_proj_dim=16),
             "mpt": dict(d_model=16, n_heads=2, n_layers=1)}[model_type]
    return AutoConfig.for_model(model_type, vocab_size=50, bos_token_id=1, eos_token_id=1, **sizes, **positions)


@pytest.mark.parametrize("model_type, positions, key, table", [
    ("gpt2", {"n_positions": 64}, "n_positions", "transformer.wpe: 64 rows"),
    ("opt", {"max_position_embeddings": 64}, "max_position_embeddings", "model.decoder.embed_positions: 66 rows"),
], ids=["gpt2", "opt"])
def test_a_run_past_a_learned_position_table_is_refused_in_one_line(tmp_path, model_type, positions, key, table):
    """GPT-2 (n_positions) and OPT (2 offset rows) look a position up in a table of that many rows: a longer
    sequence fails at the first generate with an IndexError, so it is refused before the model loads."""
    tiny_family_config(model_type, **positions).save_pretrained(tmp_path)
    assert not loading.warn_if_beyond_context(str(tmp_path), 64, "data.max_length")
    with pytest.raises(ValueError) as refusal:
        loading.warn_if_beyond_context(str(tmp_path), 65, "data.max_length")
    assert str(refusal.value) == (
        f"data.max_length = 65 tokens, more than the 64 positions of the model at {tmp_path} ({key} in its "
        f"config.json), whose position embedding is a learned table ({table}) with no row past them; lower "
        "data.max_length to 64 or fewer")


@pytest.mark.parametrize("model_type, positions, key", [
    ("gptj", {"n_positions": 64}, "n_positions"),  # rotary
    ("mpt", {"max_seq_len": 64}, "max_seq_len"),  # ALiBi
], ids=["gptj", "mpt"])
def test_computed_positions_under_another_key_are_warned_of(tmp_path, caplog, model_type, positions, key):
    """GPT-J's rotary and MPT's ALiBi positions have no table: past them is a warning, read from their own key."""
    tiny_family_config(model_type, **positions).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert loading.warn_if_beyond_context(str(tmp_path), 65, "a + b")
    assert f"a + b = 65 tokens, more than the 64 positions the model at {tmp_path} was trained on ({key} in its " \
           "config.json)" in caplog.text


@pytest.mark.parametrize("rope", [{"rope_scaling": {"type": "dynamic", "factor": 4.0}},
                                  {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0},
                                                       "sliding_attention": {"rope_type": "default"}}}])
def test_an_rl_run_past_a_dynamic_ntk_models_length_is_told_its_rollout_and_training_part(tmp_path, caplog, rope):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 128, **rope}))
    with caplog.at_level(logging.WARNING):
        assert not loading.warn_if_rollout_parts_from_training(str(folder), 128, "a + b")
        assert loading.warn_if_rollout_parts_from_training(str(folder), 129, "a + b")
    assert len(caplog.records) == 1 and "a + b = 129 tokens, past the 128 (max_position_embeddings)" in caplog.text
    assert "algorithm.rollout_correction" in caplog.text
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 128,
                                                    "rope_scaling": {"type": "yarn", "factor": 4.0}}))
    assert not loading.warn_if_rollout_parts_from_training(str(folder), 512, "a + b")  # yarn: no length dependence


LONG_FACTORS = {"long_factor": [1.0] * 4, "short_factor": [1.0] * 4}


@pytest.mark.parametrize(("config", "context", "keys"), [
    # Llama 3.1: max_position_embeddings is already the extended length
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 8192}},
     131072, "max_position_embeddings"),
    # Phi-3-mini-128k: LongRoPE, as released and as transformers 5 saves it (with the factor it recommends)
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "su", **LONG_FACTORS}}, 131072, "max_position_embeddings"),
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
      "rope_parameters": {"rope_type": "longrope", "factor": 32.0, "original_max_position_embeddings": 4096,
                          **LONG_FACTORS}}, 131072, "max_position_embeddings"),
    # Gemma 3: linear factor 8 on the full-attention layers, nested by layer type in rope_parameters
    ({"text_config": {"max_position_embeddings": 131072, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}}, 131072, "max_position_embeddings"),
    # Qwen2.5-7B-Instruct with YaRN as its card says, and re-saved by transformers 5 (or reinforge's export)
    ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32768}},
     131072, "original_max_position_embeddings 32768 x yarn factor 4"),
    ({"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                             "original_max_position_embeddings": 32768}},
     131072, "original_max_position_embeddings 32768 x yarn factor 4"),
    # DeepSeek-V3: YaRN from 4096 positions, max_position_embeddings the extended length
    ({"max_position_embeddings": 163840, "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0,
                                                           "original_max_position_embeddings": 4096}},
     163840, "max_position_embeddings"),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     8192, "max_position_embeddings 4096 x dynamic factor 2"),
    ({"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     32768, "max_position_embeddings"),
])
def test_the_context_of_each_rope_type_is_read_from_either_key(tmp_path, caplog, config, context, keys):
    """transformers 5 saves ``rope_parameters`` (a YaRN Qwen2.5 re-saved read as 32768 positions); llama3, LongRoPE and
    linear configs give the extended length as max_position_embeddings (times the factor it read 1M positions)."""
    from reinforge.models.loading import context_length

    assert context_length(config) == (context, keys)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        assert not loading.warn_if_beyond_context(str(tmp_path), context, "a + b")
        assert loading.warn_if_beyond_context(str(tmp_path), context + 1, "a + b")
    assert f"a + b = {context + 1} tokens, more than the {context} positions the model at {tmp_path} was trained on " \
           f"({keys} in its config.json)" in caplog.text


def refused_load(tiny_model_dir, folder, **config_changes) -> str:
    """The one-line refusal of loading a copy of the tiny model whose config.json has ``config_changes``."""
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    with pytest.raises(ValueError) as error:
        load_causal_lm(str(folder), dtype=torch.float32, device="cpu")
    return str(error.value)


def test_a_model_transformers_cannot_load_is_refused_in_one_line(tiny_model_dir, tmp_path):
    folder = tmp_path / "unknown"
    message = refused_load(tiny_model_dir, folder, model_type="made_up_lm")
    assert "\n" not in message
    assert f"model.path={folder} is a 'made_up_lm' model, which transformers" in message
    assert "model.trust_remote_code=true" in message


def test_a_model_transformers_has_no_causal_lm_of_is_refused_in_one_line_before_it_loads(tiny_model_dir, tmp_path):
    """An encoder-decoder's folder (T5): transformers loads its config but no causal LM; the preflight check and the
    load refuse it naming the setting (it loaded as its architectures' T5ForConditionalGeneration, whose forward then
    failed without decoder inputs, said as a transformers version's failure)."""
    from reinforge.models.loading import check_loads_as_causal_lm

    folder = tmp_path / "t5"
    message = refused_load(tiny_model_dir, folder, model_type="t5", architectures=["T5ForConditionalGeneration"])
    assert message.startswith(f"model.path={folder} is a 't5' model (T5Config, an encoder-decoder), "
                              "which transformers has no causal LM")
    assert "\n" not in message
    with pytest.raises(ValueError, match="point model.path at a causal LM's folder"):
        check_loads_as_causal_lm(str(folder))
    check_loads_as_causal_lm(str(tiny_model_dir))  # a causal LM passes


def test_a_model_whose_code_ships_with_it_is_refused_naming_trust_remote_code(tiny_model_dir, tmp_path):
    folder = tmp_path / "remote"
    message = refused_load(tiny_model_dir, folder, model_type="own_lm",
                           auto_map={"AutoConfig": "configuration_own.OwnConfig",
                                     "AutoModelForCausalLM": "modeling_own.OwnForCausalLM"})
    assert message == (f"model.path={folder} is a 'own_lm' model whose code ships with it (auto_map in its "
                       "config.json), which transformers runs only when trusted; set model.trust_remote_code=true if "
                       "you trust that code")


def test_weights_of_other_shapes_than_the_config_builds_are_refused_in_one_line(tiny_model_dir, tmp_path, capsys,
                                                                                caplog):
    """transformers logs its load report table, then raises pointing at it: one line of ours instead of both."""
    folder = tmp_path / "resized"
    with caplog.at_level(logging.WARNING):
        message = refused_load(tiny_model_dir, folder, hidden_size=128)
    assert "\n" not in message and "LOAD REPORT" not in caplog.text + capsys.readouterr().err
    assert re.fullmatch(rf"model\.path={re.escape(str(folder))}: its weights do not fit its config\.json \(\S.* is "
                        r"\[[0-9, ]+\] in the weights, \[[0-9, ]+\] in the model config\.json builds, and \d+ more "
                        r"tensors\); fix config\.json's sizes to the weights', or point model\.path at the folder they "
                        "came with", message)


def test_a_base_models_folder_without_the_output_layer_is_refused_in_one_line(tmp_path):
    """AutoModel's folder of an untied model holds no lm_head: loaded as a causal LM it would sample from a random
    head, which transformers only reports in its load table."""
    from transformers import AutoModel

    from reinforge.models.tiny import build_char_tokenizer, save_hf_folder, tiny_config

    tokenizer = build_char_tokenizer()
    config = tiny_config("qwen2", vocab_size=len(tokenizer), num_layers=1, tie_word_embeddings=False)
    folder = save_hf_folder(AutoModel.from_config(config), tokenizer, tmp_path / "base")
    with pytest.raises(ValueError) as error:
        load_causal_lm(str(folder), dtype=torch.float32, device="cpu")
    assert str(error.value) == (
        f"model.path={folder} holds no weights for lm_head.weight, the output layer of the causal LM Qwen2ForCausalLM "
        "(its config.json names Qwen2Model), so it would sample from a new, random one; point model.path at the "
        "causal LM's folder (...ForCausalLM), whose weights hold its output layer")
    tied = tiny_config("qwen2", vocab_size=len(tokenizer), num_layers=1, tie_word_embeddings=True)
    folder = save_hf_folder(AutoModel.from_config(tied), tokenizer, tmp_path / "tied")
    load_causal_lm(str(folder), dtype=torch.float32, device="cpu")  # its head is the embedding it holds


def test_an_attention_implementation_transformers_refuses_is_named_as_the_setting(tiny_model_dir):
    with pytest.raises(ValueError) as error:
        load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device="cpu", attn_implementation="flashy")
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        f"model.attn_implementation=flashy: transformers cannot load {tiny_model_dir} with it here (")
    assert message.endswith("; set model.attn_implementation to sdpa or eager, or install what it needs")


def test_a_config_value_transformers_refuses_is_named_with_its_file(tiny_model_dir, tmp_path):
    folder = tmp_path / "typed"
    message = refused_load(tiny_model_dir, folder, num_attention_heads="four")
    assert "\n" not in message
    assert message.startswith(f"model.path={folder}: transformers cannot read its config.json (")
    assert "'four'" in message and message.endswith(f"fix that value in {folder / 'config.json'}, or set model.path "
                                                    "to another model")


def test_gemma2_loads_with_eager_where_sdpa_cannot_soft_cap(tmp_path):
    folder = save_tiny_model(tmp_path / "gemma2", arch="gemma2")
    model = load_causal_lm(str(folder), dtype=torch.float32, device="cpu")
    assert model.config._attn_implementation == "eager"
    qwen = load_causal_lm(str(save_tiny_model(tmp_path / "qwen2")), dtype=torch.float32, device="cpu")
    assert qwen.config._attn_implementation == "sdpa"


def test_a_multimodal_wrapper_of_gemma2_loads_with_eager_where_sdpa_cannot_soft_cap(tmp_path):
    """PaliGemma 2's language model is Gemma 2: transformers refuses to build it with sdpa, so the whole model loads
    with eager (its text-only prompts then train like any other model's)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from reinforge.models.tiny import tiny_config

    text = tiny_config("gemma2", vocab_size=64, num_layers=1).to_dict()
    tower = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, image_size=28, patch_size=14)
    config = AutoConfig.for_model("paligemma", text_config=text, vision_config=tower, image_token_index=63,
                                  projection_dim=64, hidden_size=64, architectures=["PaliGemmaForConditionalGeneration"])
    AutoModelForImageTextToText.from_config(config, attn_implementation="eager").save_pretrained(tmp_path / "pg")
    model = load_causal_lm(str(tmp_path / "pg"), dtype=torch.float32, device="cpu")
    assert type(model).__name__ == "PaliGemmaForConditionalGeneration"
    assert model.config.text_config._attn_implementation == "eager"


def test_checkpointing_is_read_without_the_deprecated_name():
    model = build_tiny_causal_lm(vocab_size=64, seed=0)
    assert not loading.checkpointing_enabled(model)
    loading.enable_gradient_checkpointing(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert loading.checkpointing_enabled(model)
