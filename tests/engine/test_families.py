"""Packed training for every family of the architecture table, and for a causal LM outside it.

What must not change: a packed pass (sequences side by side in one row, shared prompts or not)
gives the log-probs, entropy and gradients of transformers' own padded forward with eager
attention, windows smaller than the sequence and soft-caps included. Tiny fp32 models on the CPU.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from reinforge.algorithms import entropy_from_logits, log_probs_from_logits
from reinforge.cli import main
from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.forward import response_log_probs
from reinforge.engine.fused import describe_training_path, fuse_elementwise, use_packed_attention_layout
from reinforge.engine.packing import attach_plan
from reinforge.models import save_tiny_model
from reinforge.models.architectures import FAMILIES, architecture_spec
from reinforge.models.tiny import ARCHITECTURES, build_tiny_causal_lm
from reinforge.protocol import Batch

sys.path.insert(0, str(Path(__file__).parent))
from test_packing import grouped_batch  # noqa: E402

from tests.released_configs import RELEASED_CONFIGS, released_model  # noqa: E402

TABLE = [arch for arch in ARCHITECTURES if arch in FAMILIES]
OUTSIDE = "gpt_neox"
SINKS = "gpt_oss"
"""Outside the table too: attention sinks (``s_aux``) and windows on even layers."""
MASK_WINDOWS = ("qwen2_moe", "phimoe")
"""Outside the table, with windows only in transformers' masks (no sliding_window argument to the attention)."""
WINDOWED = ("qwen2", "qwen3", "qwen3_moe", "smollm3", "gemma2", "gemma3_text", "mistral", "mixtral", "phi3", SINKS,
            *MASK_WINDOWS)
WINDOW = 4
"""Smaller than every test sequence (prompts of up to 6 tokens, responses of up to 7)."""


def tiny_model(arch: str, seed: int = 0, **options):
    """A tiny fp32 model of ``arch`` with windows on where the family has them, norm weights away from their init."""
    model = build_tiny_causal_lm(arch, vocab_size=64, seed=seed,
                                 sliding_window=WINDOW if arch in WINDOWED else None, **options)
    return with_norms_moved(model, seed)


def with_norms_moved(model, seed: int):
    """``model`` with its norm weights moved away from their init (Gemma's offsets of 0 would hide the 1 + w)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return model


def padded_reference(model, batch: Batch, temperature: float):
    """transformers' own padded forward with eager attention: response log-probs and entropy (B, R)."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    width = batch["prompts"].shape[1]
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False).logits
    logits = logits[:, width - 1:-1] / temperature
    mask = batch["response_mask"]
    log_probs = log_probs_from_logits(logits, batch["responses"]) * mask
    entropy = entropy_from_logits(logits) * mask
    return reference, log_probs, entropy


def loss_of(log_probs, entropy, batch: Batch):
    return (log_probs * batch["advantages"]).sum() + 0.3 * entropy.sum()


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("arch", [*TABLE, OUTSIDE, SINKS, *MASK_WINDOWS])
def test_packed_pass_equals_transformers_padded_forward(arch, share_prompts):
    assert_pass_equals_transformers_padded_forward(tiny_model(arch), share_prompts)


@pytest.mark.parametrize("fast_path", [False, True])
@pytest.mark.parametrize("name", list(RELEASED_CONFIGS))
def test_packed_pass_equals_transformers_padded_forward_on_released_configs(name, fast_path):
    """The config structure of released checkpoints (tests/released_configs.py), on transformers' modules and on the
    fast path's swapped forwards."""
    model = with_norms_moved(released_model(name, vocab_size=64, seed=0), seed=0)
    assert_pass_equals_transformers_padded_forward(model, share_prompts=True, fast_path=fast_path)


def assert_pass_equals_transformers_padded_forward(model, share_prompts: bool, fast_path: bool = False) -> None:
    """``response_log_probs`` of ``model`` (varlen attention switched on here, and the fast path's swapped forwards
    if ``fast_path``) gives the log-probs, entropy and gradients of transformers' padded forward with eager
    attention."""
    batch = grouped_batch(num_prompts=2, samples=3)
    reference, expected_lp, expected_ent = padded_reference(model, batch, temperature=0.7)
    loss_of(expected_lp, expected_ent, batch).backward()

    use_varlen_attention(model)
    if fast_path:
        assert fuse_elementwise(model, compile=False) > 0
        use_packed_attention_layout(model)
    micro = attach_plan(Batch(dict(batch.tensors), {}, {}), share_prompts=share_prompts)
    log_probs, entropy = response_log_probs(model, micro, temperature=0.7, with_entropy=True)
    loss_of(log_probs, entropy, batch).backward()

    torch.testing.assert_close(log_probs, expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_ent, atol=1e-5, rtol=1e-5)
    for (name, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if theirs.grad is None:
            assert ours.grad is None or not ours.grad.any(), name
            continue
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("bias", [0.0, 0.5])
def test_an_output_layer_bias_outside_the_table_trains_as_transformers_does(bias):
    """Phi-2's lm_head has a bias, zero in a model built from its config: the packed pass adds it, and its gradient
    is transformers' (it read as no bias: a zero bias never trained, a trained one took the padded own-logits path)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("phi", vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():
            model.lm_head.bias.normal_(0.0, bias)
    assert_pass_equals_transformers_padded_forward(model, share_prompts=True)


UNMASKED_WINDOW = ("llama", "olmo2", "olmoe", "deepseek_v3")
"""Families whose models build only causal masks: a ``sliding_window`` their config.json carries slides nothing in
transformers' eager and SDPA forwards (OLMoE still hands it to its attention function)."""


@pytest.mark.parametrize("fast_path", [False, True])
@pytest.mark.parametrize("arch", UNMASKED_WINDOW)
def test_a_window_the_models_masks_never_apply_is_not_applied(arch, fast_path):
    model = tiny_model(arch)
    model.config.sliding_window = WINDOW  # a leftover key of a config.json: transformers' forward reads it as it is
    assert not architecture_spec(model.config).windowed
    assert_pass_equals_transformers_padded_forward(model, share_prompts=True, fast_path=fast_path)


@pytest.mark.parametrize("fast_path", [False, True])
def test_a_window_only_the_models_masks_apply_is_applied(fast_path):
    """A SmolLM3 config listing sliding_attention layers with use_sliding_window=false: transformers hands those
    layers' attention no window, yet builds their masks from sliding_window, so eager and SDPA attention slide them."""
    model = tiny_model("smollm3", layer_types=["sliding_attention", "full_attention"], use_sliding_window=False,
                       no_rope_layers=[0, 1])
    assert [layer.sliding_window for layer in architecture_spec(model.config).layers] == [WINDOW, None]
    assert_pass_equals_transformers_padded_forward(model, share_prompts=True, fast_path=fast_path)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_windows_and_soft_caps_change_the_result(arch):
    """The comparison above can fail: without its window (and soft-caps) the same weights give other log-probs."""
    batch = grouped_batch(num_prompts=2, samples=3)
    _, windowed, _ = padded_reference(tiny_model(arch), batch, temperature=1.0)
    unwindowed_options = {"sliding_window": 4096} if arch == "gemma2" else {}
    if arch == "gemma2":
        unwindowed_options |= {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    plain = build_tiny_causal_lm(arch, vocab_size=64, seed=0, **unwindowed_options)
    plain.load_state_dict(tiny_model(arch).state_dict())
    _, full, _ = padded_reference(plain, batch, temperature=1.0)
    assert (windowed - full).abs().max() > 1e-3


@pytest.mark.parametrize(("arch", "options"), [*[(arch, {}) for arch in TABLE], ("olmoe", {"clip_qkv": 0.5})],
                         ids=[*TABLE, "olmoe-clip-qkv"])
def test_fast_path_modules_equal_transformers_modules_in_packed_passes(arch, options):
    """The CUDA fast path's swapped forwards, run eagerly on the CPU: the same log-probs and gradients."""
    reference = tiny_model(arch, seed=2, **options)
    use_varlen_attention(reference)
    swapped = copy.deepcopy(reference)
    assert fuse_elementwise(swapped, compile=False) > 0
    attention_modules = use_packed_attention_layout(swapped)
    assert attention_modules == (0 if architecture_spec(swapped.config).mla else 2)
    batch = grouped_batch(num_prompts=2, samples=2)
    results = []
    for model in (reference, swapped):
        micro = attach_plan(Batch(dict(batch.tensors), {}, {}), share_prompts=True)
        log_probs, entropy = response_log_probs(model, micro, temperature=0.8, with_entropy=True)
        loss_of(log_probs, entropy, batch).backward()
        results.append((log_probs.detach(), [parameter.grad for parameter in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(results[1][1], results[0][1], strict=True):
        if theirs is not None:
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # generation keeps transformers' forwards
        prompts = batch["prompts"][:2].clamp(min=3)
        expected = reference.generate(prompts, max_new_tokens=3, do_sample=False)
        assert torch.equal(swapped.generate(prompts, max_new_tokens=3, do_sample=False), expected)


def gemma3_vision_language(cap: float | None, vocab_size: int = 128):
    """A tiny Gemma3ForConditionalGeneration (what AutoModelForCausalLM loads for Gemma 3 4B to 27B) whose text config
    names ``cap`` as its final soft-cap."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from reinforge.models.tiny import tiny_config

    text = tiny_config("gemma3_text", vocab_size=vocab_size, num_layers=2, sliding_window=WINDOW,
                       final_logit_softcapping=cap).to_dict()
    for key in ("model_type", "transformers_version", "architectures"):
        text.pop(key, None)
    config = AutoConfig.for_model("gemma3", text_config=text, mm_tokens_per_image=4, image_token_index=vocab_size - 1,
                                  boi_token_index=vocab_size - 3, eoi_token_index=vocab_size - 2,
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=28, patch_size=14))
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize("cap", [2.0, None])
def test_a_vision_language_gemma3_trains_on_the_logits_its_own_head_returns(cap):
    """Its text config may name a final soft-cap that Gemma3ForConditionalGeneration does not apply (transformers 5):
    the training passes follow the model's own logits, capped or not."""
    from reinforge.engine.fused import check_final_soft_cap
    from reinforge.models.head_probe import ANSWER

    model = gemma3_vision_language(cap)
    check_final_soft_cap(model)
    if cap is None:
        assert getattr(model, ANSWER, None) is not False  # not marked as leaving a cap out
    assert_pass_equals_transformers_padded_forward(model, share_prompts=True)


def test_a_vision_language_gemma3_shards_and_adapts_its_language_model_in_every_role():
    """The critic's value model and the preference trainers' model: FSDP units are the language model's layers, and
    the tower, which text never reaches, is frozen and gets no adapter."""
    from reinforge.config.schema import LoraConfig, ModelConfig
    from reinforge.engine.fsdp import decoder_layers
    from reinforge.models import ValueModel
    from reinforge.trainer.preference.models import prepare_trained_model

    model = gemma3_vision_language(None)
    value_model = ValueModel(model.model)
    assert {type(layer).__name__ for layer in decoder_layers(value_model)} == {"Gemma3DecoderLayer"}
    config = ModelConfig(lora=LoraConfig(rank=4))
    peft_model = prepare_trained_model(model, config, torch.device("cpu"), seed=0)
    assert {type(layer).__name__ for layer in decoder_layers(model)} == {"FSDPGemma3DecoderLayer"}  # sharded
    adapted = [name for name, _ in peft_model.named_parameters() if "lora_A" in name]
    assert adapted and not any("vision_tower" in name for name in adapted)


def test_a_vision_language_gemmas_critic_trains_its_language_model_with_the_tower_frozen(tmp_path):
    from reinforge.config.schema import Config
    from reinforge.engine.fsdp import decoder_layers
    from reinforge.models.export import save_hf_folder
    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.workers.critic import CriticWorker

    tokenizer = build_char_tokenizer()
    model_dir = save_hf_folder(gemma3_vision_language(None, vocab_size=len(tokenizer) + 3), tokenizer, tmp_path / "g3")
    config = Config()
    config.model.path, config.trainer.device = str(model_dir), "cpu"
    critic = CriticWorker(config, total_training_steps=2)
    tower = critic.model.backbone.vision_tower
    assert not any(parameter.requires_grad for parameter in tower.parameters())
    assert {type(layer).__name__ for layer in decoder_layers(critic.model)} == {"FSDPGemma3DecoderLayer"}


def test_a_vision_language_gemma3_rolls_out_text_on_the_native_engine(arithmetic_data_dir, tmp_path, caplog):
    """Gemma 3 4B to 27B load as the multimodal wrapper; text prompts run on its language model in the engine."""
    from transformers import AutoModelForCausalLM

    from reinforge.models.export import save_hf_folder
    from reinforge.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = gemma3_vision_language(2.0, vocab_size=len(tokenizer) + 3)
    model_dir = save_hf_folder(model, tokenizer, tmp_path / "gemma3")
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": 4,
                 "image_processor": {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 28, "width": 28}}}
    (model_dir / "processor_config.json").write_text(json.dumps(processor))  # its image processor, text never uses
    args = {"model.path": model_dir, "data.train_files": f"[{arithmetic_data_dir / 'train.parquet'}]",
            "data.train_batch_size": 2, "data.max_prompt_length": 64, "data.max_response_length": 12,
            "rollout.n": 2, "rollout.name": "native", "trainer.output_dir": tmp_path / "run",
            "trainer.loggers": "[jsonl]", "trainer.total_steps": 1, "trainer.val_before_train": False}
    args |= {"actor.entropy_coeff": 0.5, "actor.optim.lr": 1e-2, "trainer.save_every": 1}  # a gradient to step on
    with caplog.at_level("INFO"):
        assert main(["train", *(f"{key}={value}" for key, value in args.items())]) == 0
    assert "cannot run this model" not in caplog.text
    [row] = _metrics(tmp_path / "run")
    assert row["training/rollout_probs_diff_max"] < 1e-4
    # the language model learns (FSDP's units are its layers, not the vision tower's), the frozen tower does not
    [hf] = (tmp_path / "run").glob("checkpoints/*/hf")
    trained = AutoModelForCausalLM.from_pretrained(hf).state_dict()
    initial = model.state_dict()
    language = [name for name in initial if ".language_model.layers." in name]
    tower = [name for name in initial if ".vision_tower." in name]
    assert language and tower
    assert sum(not torch.equal(trained[name], initial[name]) for name in language) > len(language) // 2
    assert all(torch.equal(trained[name], initial[name]) for name in tower)
    # the checkpoint and its export are model folders of the whole wrapper, the tower (not in the training state,
    # which holds what trains) and the processor files included
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "exported")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[name], trained[name]) for name in trained)
    for folder in (hf, tmp_path / "exported"):
        assert json.loads((folder / "processor_config.json").read_text()) == processor


@pytest.mark.parametrize("arch", ["gemma2", SINKS])
def test_generation_with_soft_caps_and_sinks_matches_eager_attention(arch):
    """hf rollout: SDPA cannot soft-cap or sink, so those layers take the explicit path, left padding included."""
    model = tiny_model(arch, seed=4)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    use_varlen_attention(model)
    input_ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    outputs = []
    for candidate in (reference, model):
        candidate.generation_config.pad_token_id = 0
        with torch.no_grad():
            outputs.append(candidate.generate(input_ids * attention_mask, attention_mask=attention_mask,
                                              max_new_tokens=4, do_sample=False, output_logits=True,
                                              return_dict_in_generate=True))
    assert torch.equal(outputs[1].sequences, outputs[0].sequences)
    for ours, theirs in zip(outputs[1].logits, outputs[0].logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_the_training_path_line_names_the_path_why_and_the_cost():
    cuda = torch.device("cuda")
    assert "fast path for gemma2" in describe_training_path(tiny_model("gemma2"), cuda)
    line = describe_training_path(tiny_model(OUTSIDE), cuda)
    assert "transformers modules for gpt_neox: no fused kernels" in line and "slower" in line
    assert "\n" not in line
    assert "varlen attention" in describe_training_path(tiny_model("llama"), torch.device("cpu"))
    line = describe_training_path(tiny_model(OUTSIDE), torch.device("cpu"))  # why, even where no family fuses
    assert "transformers modules for gpt_neox" in line and "gpt_neox is not in reinforge.models.architectures" in line


def test_a_family_of_the_table_running_the_code_its_folder_ships_trains_through_its_own_modules():
    """config.json says llama, but the model's classes are its folder's own code: nothing of the table's Llama is
    swapped in, the packed pass is the model's own forward, and the line says why."""
    from tests.rollout.test_native_families import model_running_code_it_ships

    model = model_running_code_it_ships()
    line = describe_training_path(model, torch.device("cuda"))
    assert "(its code ships with the model (model.trust_remote_code), not transformers' llama modules" in line
    assert fuse_elementwise(model, compile=False) == 0 and use_packed_attention_layout(model) == 0
    assert_pass_equals_transformers_padded_forward(model, share_prompts=True)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _grpo_step(model_dir: Path, data_dir: Path, run_dir: Path) -> dict:
    args = {"model.path": model_dir, "data.train_files": f"[{data_dir / 'train.parquet'}]",
            "data.train_batch_size": 2, "data.max_prompt_length": 64, "data.max_response_length": 12,
            "rollout.n": 2, "rollout.name": "hf", "trainer.output_dir": run_dir, "trainer.loggers": "[jsonl]",
            "trainer.total_steps": 1, "trainer.val_before_train": False, "actor.optim.lr": 1e-3}
    assert main(["train", *(f"{key}={value}" for key, value in args.items())]) == 0
    [row] = _metrics(run_dir)
    assert row["actor/num_skipped_steps"] == 0
    return row


def _saved(tmp_path: Path, arch: str, **options) -> Path:
    return save_tiny_model(tmp_path / arch, arch=arch, num_layers=2, **options)


FAST_GRPO = ("qwen2", "gemma2", "deepseek_v3", OUTSIDE)


@pytest.mark.parametrize("arch", [pytest.param(arch, marks=() if arch in FAST_GRPO else pytest.mark.slow)
                                  for arch in [*TABLE, OUTSIDE]])
def test_one_grpo_step_runs(arch, arithmetic_data_dir, tmp_path):
    model_dir = _saved(tmp_path, arch, sliding_window=WINDOW if arch in WINDOWED else None)
    row = _grpo_step(model_dir, arithmetic_data_dir, tmp_path / "run")
    # rollout (hf generate) and training (packed) see the same model: windows, soft-caps and all
    assert row["training/rollout_probs_diff_max"] < 1e-4


@pytest.mark.slow
def test_windowed_models_keep_rollout_and_training_probabilities_together(arithmetic_data_dir, tmp_path):
    """Mistral with sliding_window=8 and Qwen2 with use_sliding_window: the mismatch of a model without windows."""
    plain = _grpo_step(_saved(tmp_path, "qwen2"), arithmetic_data_dir, tmp_path / "plain")
    level = max(plain["training/rollout_probs_diff_max"], 1e-6)
    for arch, options in (("mistral", {"sliding_window": 8}), ("qwen2", {"sliding_window": 8})):
        model_dir = _saved(tmp_path / "windowed", arch, **options)
        config = json.loads((model_dir / "config.json").read_text())
        assert config["sliding_window"] == 8 and (arch == "mistral" or config["use_sliding_window"])
        row = _grpo_step(model_dir, arithmetic_data_dir, tmp_path / f"run-{arch}")
        assert row["training/rollout_probs_diff_max"] <= 10 * level, arch


@pytest.mark.parametrize("window,softcap", [(None, 0.7), (3, None), (3, 0.7)])
def test_flex_packed_attention_equals_the_padded_path(window, softcap):
    """The flex form of packed attention (block mask of segments and window, soft-cap as a score_mod), run eagerly."""
    from reinforge.engine.attention import flex_packed_attention
    from reinforge.packed_attention import padded_packed_attention

    query_lengths, key_lengths = [5, 9, 3], [7, 9, 6]  # shared prompts: more keys than queries
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(17, 4, 16, generator=generator)
    k, v = torch.randn(22, 2, 16, generator=generator), torch.randn(22, 2, 16, generator=generator)
    got = flex_packed_attention(q, k, v, torch.tensor([0, 5, 14, 17]), torch.tensor([0, 7, 16, 22]), 0.3, window,
                                softcap, compiled=False)
    expected = padded_packed_attention(q, k, v, query_lengths, key_lengths, 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_compiled_flex_traces_the_soft_capped_backward_as_lengths_change(monkeypatch):
    """The compile settings of the flex fallback, traced on the CPU (``aot_eager``: the graphs run eagerly, the
    backward too): forward and backward match the padded path as the token count and the block mask's block count
    change, as a run's micro-batches do. With every dimension dynamic from the start the backward did not trace."""
    import torch.nn.attention.flex_attention as flex_module

    from reinforge.engine import attention
    from reinforge.engine.attention import flex_packed_attention
    from reinforge.packed_attention import padded_packed_attention

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args, **kwargs: None)  # torch refuses CPU backward
    compiled = attention._compiled_flex.__wrapped__("aot_eager")  # not the cached inductor one
    monkeypatch.setattr(attention, "_compiled_flex", lambda: compiled)
    generator = torch.Generator().manual_seed(0)
    for lengths in ([5, 7], [9, 11], [100, 200], [300, 11]):
        q, k, v = (torch.randn(sum(lengths), 2, 16, generator=generator, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
        got = flex_packed_attention(q, k, v, cu, cu, 0.25, 3, 2.0, compiled=True)
        grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        expected = padded_packed_attention(q, k, v, lengths, lengths, 0.25, window=3, softcap=2.0)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for grad, reference in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v)), strict=True):
            torch.testing.assert_close(grad, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_compiled_flex_runs_soft_capped_attention_on_the_gpu():
    """Else soft-capped layers (Gemma 2) fall back to the explicit padded path: exact, but slow."""
    from reinforge.engine.attention import flex_runs_on

    assert flex_runs_on(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_cuda_packed_attention_applies_windows_and_soft_caps(shared, window, softcap):
    """bf16 on the GPU (flash with window_size, or flex with the soft-cap) against the float32 padded path."""
    from reinforge.engine.attention import flash_runs_shared_segments, flex_runs_on, packed_attention
    from reinforge.packed_attention import padded_packed_attention

    device = torch.device("cuda")
    query_lengths, key_lengths = [5, 9, 3], ([7, 9, 6] if shared else [5, 9, 3])
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(sum(query_lengths), 4, 24 if softcap is None else 32, generator=generator)
    k = torch.randn(sum(key_lengths), 2, q.shape[-1], generator=generator)
    # a value head dim of its own, as MLA's (which has no soft-cap)
    v = torch.randn(sum(key_lengths), 2, 16 if softcap is None else 32, generator=generator)
    cu_q = torch.tensor([0, *torch.tensor(query_lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    kwargs = {"packed_cu_seqlens": cu_q, "packed_max_length": max(query_lengths)}
    if shared:
        kwargs |= {"packed_kv_index": torch.arange(sum(key_lengths), device=device), "packed_cu_seqlens_k": cu_k,
                   "packed_max_length_k": max(key_lengths), "packed_flash_shared": flash_runs_shared_segments(device)}
    if softcap is not None:
        kwargs["packed_flex"] = flex_runs_on(device)
    got = packed_attention(*(x.to(device, torch.bfloat16) for x in (q, k, v)), 0.3, kwargs, window=window,
                           softcap=softcap)
    expected = padded_packed_attention(q, k, v, query_lengths, key_lengths, 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(got.float().cpu(), expected, atol=3e-2, rtol=3e-2)


COMPILED_ON_GPU = ("gemma2", "phi3", "olmo2", "deepseek_v3", "qwen3_moe")
"""Families whose GPU test compiles the decoder layers too (each compile takes tens of seconds): soft-caps and
sandwich norms, fused projections and partial rotary, post-norms and projection qk-norm, MLA, MoE."""


@pytest.mark.gpu
@pytest.mark.parametrize("arch", [*TABLE, OUTSIDE, SINKS])
def test_cuda_training_path_matches_transformers_in_bfloat16(arch):
    """The CUDA fast path (fused norms and MLP, the packed attention layout, flash or flex attention; decoder layers
    compiled for COMPILED_ON_GPU) or transformers' modules outside the table: bf16 log-probs near float32
    transformers, and a finite backward."""
    import torch._dynamo

    from reinforge.engine.fused import prepare_for_training

    torch._dynamo.reset()
    device = torch.device("cuda")
    batch = grouped_batch(num_prompts=2, samples=3)
    model = tiny_model(arch).to(device)
    _, expected, _ = padded_reference(model, batch.to(device), temperature=1.0)
    model = model.to(torch.bfloat16)
    if arch in COMPILED_ON_GPU or arch not in TABLE:
        prepare_for_training(model, device)
    else:
        use_varlen_attention(model)
        fuse_elementwise(model, compile=False)
        use_packed_attention_layout(model)
    micro = attach_plan(Batch(dict(batch.tensors), {}, {}), share_prompts=True).to(device)
    log_probs, _ = response_log_probs(model, micro, with_entropy=True)
    torch.testing.assert_close(log_probs.float(), expected.float().detach(), atol=5e-2, rtol=5e-2)
    (log_probs * micro["advantages"]).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_prepare_for_training_says_the_path_once_per_process(caplog):
    import logging

    from reinforge.engine import fused

    fused._DESCRIBED.clear()
    with caplog.at_level(logging.INFO, logger="reinforge.engine.fused"):
        for _ in range(2):  # the actor and the reference of one run
            fused.prepare_for_training(tiny_model(OUTSIDE), torch.device("cpu"))
    lines = [record.getMessage() for record in caplog.records if record.name == "reinforge.engine.fused"]
    assert len(lines) == 1 and lines[0].startswith("packed training of gpt_neox")


def test_a_model_that_mixes_packed_sequences_trains_over_padded_rows(caplog):
    """Qwen3-Next's linear-attention layers carry state along the row: packed, its sequences would mix (silently
    wrong). The probe finds it, and its passes run padded rows, said in the run's one line."""
    import logging

    from transformers import AutoConfig, AutoModelForCausalLM

    from reinforge.engine import fused
    from reinforge.engine.forward import PACKS_ROWS

    config = AutoConfig.for_model(
        "qwen3_next", vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"], pad_token_id=0, bos_token_id=None, eos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    fused._DESCRIBED.clear()
    with caplog.at_level(logging.INFO, logger="reinforge.engine.fused"):
        fused.prepare_for_training(model, torch.device("cpu"))
    assert getattr(model, PACKS_ROWS) is False
    lines = [record.getMessage() for record in caplog.records if record.name == "reinforge.engine.fused"]
    assert len(lines) == 1 and lines[0].startswith("training passes of qwen3_next: transformers modules for "
                                                   "qwen3_next over padded rows")
    assert model.training  # the probe leaves the mode as it found it
