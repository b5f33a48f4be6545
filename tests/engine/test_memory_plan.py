"""The memory planner: estimates computed by hand, choices, refusals, and the config and CLI around it."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from reinforge.engine.memory_plan import (
    LORA_PROJECTIONS,
    OVERHEAD_BYTES,
    GiB,
    MemoryPlanError,
    ModelShape,
    RunShape,
    Settings,
    estimate,
    layer_windows,
    lora_params,
    micro_batch_split,
    pinned_bytes,
    plan_memory,
    with_family_defaults,
)

QWEN25 = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False),
}
STANDARD = RunShape(prompts=64, samples_per_prompt=8, prompt_length=128, response_length=512)


def shape(size: str) -> ModelShape:
    return ModelShape.from_hf_config(QWEN25[size])


def test_parameter_count_and_kv_bytes_by_hand():
    small = shape("0.5b")
    # per layer: q,k,v,o (896 x 64 x (2*14 + 2*2)), biases 64 x (14 + 2*2), MLP 3 x 896 x 4864, two norms
    layer = 896 * 64 * 32 + 64 * 18 + 3 * 896 * 4864 + 2 * 896
    assert small.layer_params == layer == 14_912_384
    assert small.root_params == 151936 * 896 + 896  # tied head
    assert small.num_params == 494_032_768  # Qwen2.5-0.5B's published count
    assert small.kv_bytes_per_token(2) == 2 * 24 * 2 * 64 * 2
    big = shape("7b")
    assert big.root_params == 2 * 152064 * 3584 + 3584  # untied head
    assert 7.6e9 < big.num_params < 7.63e9


def test_mixture_of_experts_and_bias_free_attention_by_hand():
    # Qwen3-30B-A3B's config: 128 experts of width 768, 8 per token, no q/k/v biases, untied head
    moe = ModelShape.from_hf_config(dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, tie_word_embeddings=False))
    layer = 2048 * 128 * (2 * 32 + 2 * 4) + 128 * 3 * 2048 * 768 + 2048 * 128 + 2 * 2048
    assert moe.layer_params == layer
    assert moe.num_params == 48 * layer + 2 * 151936 * 2048 + 2048
    assert 30.4e9 < moe.num_params < 30.6e9  # the published 30.5B
    assert moe.active_intermediate_size == 8 * 768
    llama = ModelShape.from_hf_config(dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                                           num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                                           tie_word_embeddings=False))
    assert 8.02e9 < llama.num_params < 8.04e9  # Llama-3-8B: 8.03B


def test_update_estimate_by_hand():
    small = shape("0.5b")
    settings = Settings(micro_batch_tokens=16384, checkpoint_layers=0, logits_buffer_gib=24.0,
                        keep_rollout_memory=False)
    phases, host = estimate(small, STANDARD, settings)
    update, params = phases["update"], small.num_params
    assert host == {}
    assert update["master weights"] == 4 * params
    assert update["gradients"] == 4 * params
    assert update["optimizer state"] == 8 * params
    per_layer = int(2 * (9.5 * 896 + 2 * 256 + 2.4 * 4864))  # bf16: 9.5 x hidden, 2 x (k and v), 2.4 x intermediate
    # a group (128 + 8 x 512 = 4,224 tokens) stays whole: 3 fit in 16k, so 22 micro-batches of at most 12,672 tokens
    assert micro_batch_split(STANDARD, 16384) == (22, 3 * 4224)
    assert update["activations"] == 12672 * (24 * per_layer + 4 * 896 * 2)
    response_rows = 12672 * 512 / (512 + 128 / 8)
    assert update["logits"] == pytest.approx(response_rows * 151936 * 2)
    assert "kv cache" not in update  # freed between rollouts


def test_micro_batch_split_is_the_updates_own():
    """The planner sizes activations by the micro-batches the update really makes: groups stay whole."""
    from reinforge.engine.micro_batches import iter_balanced_micro_batches
    from reinforge.engine.packing import PLAN_KEY
    from reinforge.protocol import Batch

    run = RunShape(prompts=6, samples_per_prompt=4, prompt_length=8, response_length=24)
    rows = run.sequences
    prompts = (torch.arange(rows) // 4).unsqueeze(1).repeat(1, 8)  # 6 distinct prompts, 4 samples each
    batch = Batch({"prompts": prompts, "responses": torch.ones(rows, 24, dtype=torch.long),
                   "input_ids": torch.cat([prompts, torch.ones(rows, 24, dtype=torch.long)], 1),
                   "attention_mask": torch.ones(rows, 32, dtype=torch.long),
                   "response_mask": torch.ones(rows, 24, dtype=torch.long)})
    for budget in (32, 60, 104, 200, 250, 10_000):
        pieces = list(iter_balanced_micro_batches(batch, budget, share_prompts=True))
        count, largest = micro_batch_split(run, budget)
        assert count == len(pieces), budget
        assert largest == max(piece.meta[PLAN_KEY].num_tokens for piece in pieces), budget
    # a group larger than the budget is cut, each piece computing the prompt again
    assert micro_batch_split(run, 60) == (12, 8 + 2 * 24)


def test_checkpointing_keeps_only_layer_inputs():
    small = shape("0.5b")
    plain = estimate(small, STANDARD, Settings(micro_batch_tokens=8192))[0]["update"]["activations"]
    half = estimate(small, STANDARD, Settings(micro_batch_tokens=8192, checkpoint_layers=12))[0]["update"]["activations"]
    per_layer = small.activation_bytes_per_token(2)
    # 12 layers drop their activations, keep their bf16 input, and one layer's activations are live in recompute;
    # a 8k budget holds one group of 4,224 tokens
    assert plain - half == 4224 * (12 * per_layer - 12 * 896 * 2 - per_layer)


def test_kept_rollout_memory_counts_in_the_update():
    small = shape("0.5b")
    kept = estimate(small, STANDARD, Settings(keep_rollout_memory=True))[0]["update"]
    kv = 512 * 656 * small.kv_bytes_per_token(2)  # every sequence at full length and one token more, in 16-token blocks
    assert kept["kv cache"] == kv
    assert kept["rollout weight copy"] == 2 * small.num_params


def test_fastest_settings_on_a_large_device_and_smaller_ones_on_smaller_devices():
    small = shape("0.5b")
    roomy = plan_memory(small, STANDARD, {}, 139 * GiB, 128 * GiB)
    assert roomy.settings == Settings(micro_batch_tokens=65536, checkpoint_layers=0, logits_buffer_gib=24.0,
                                      kv_cache_gib=0.0, keep_rollout_memory=True, keep_gathered=True)
    tight = plan_memory(small, STANDARD, {}, 40 * GiB, 128 * GiB)
    assert tight.fits and tight.peak[1] <= 40 * GiB
    assert tight.settings.micro_batch_tokens < 65536 or tight.settings.checkpoint_layers > 0
    assert "(auto)" in tight.table() and "actor.max_tokens_per_micro_batch" in tight.table()


def test_seven_billion_full_parameters_needs_the_host_on_small_cards_and_refuses_with_the_fix():
    big = shape("7b")
    on_h200 = plan_memory(big, STANDARD, {}, 139 * GiB, 128 * GiB)
    assert on_h200.fits and not on_h200.settings.param_offload
    on_40 = plan_memory(big, STANDARD, {}, 40 * GiB, 192 * GiB)  # only with everything on the host
    assert on_40.settings.param_offload and on_40.host_total > 135 * GiB  # pinned fp32 weights and gradients
    with pytest.raises(MemoryPlanError) as refused:
        plan_memory(big, STANDARD, {}, 40 * GiB, 128 * GiB)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("the run does not fit")
    # weights 28.4 GiB (exact), AdamW's moments 56.7, gradients 53.9 (the caching host allocator's powers of two)
    assert "needs 139.1 GiB of host memory" in message
    assert "would fit with 148 GiB of host memory or model.lora.rank=32" in message  # 139.1 / 0.94 = 147.9
    lora = plan_memory(big, RunShape(64, 8, 128, 512, lora_rank=32), {}, 80 * GiB, 128 * GiB)
    assert lora.fits and "reference" not in lora.phases["update"]


def test_offloaded_parameters_count_exact_shards_and_power_of_two_gradients():
    tiny = ModelShape.from_hf_config(dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True))
    shapes = tiny.tensor_shapes()
    assert sum(rows * width for rows, width in shapes) == tiny.num_params
    # The shards themselves (engine.fsdp.pin_offloaded_shards), bf16 on one device, each at a 512-byte offset:
    # embedding 128,000 B (250 x 512), final norm 128 -> 512; per layer q and o 8,192, k and v 4,096,
    # two norms and three biases 512 each, gate, up and down 12,288
    layer = 2 * 8192 + 2 * 4096 + 5 * 512 + 3 * 12288
    assert pinned_bytes(shapes, 1, 2) == 128000 + 512 + 2 * layer
    # The gradients FSDP offloads, through the caching host allocator: embedding -> 131,072; per layer q and o
    # 8,192 (powers of two already), k and v 4,096, norms 128, q bias 128, k and v biases 64, gate, up and down
    # 12,288 -> 16,384
    layer = 2 * 8192 + 2 * 4096 + 2 * 128 + 128 + 2 * 64 + 3 * 16384
    assert pinned_bytes(shapes, 1, 2, power_of_two=True) == 131072 + 128 + 2 * layer
    # two devices halve the first dimension (padded): the 1,000-row embedding shards to 500 rows, 64,000 B
    assert pinned_bytes([(1000, 64)], 2, 2, power_of_two=True) == 65536 and pinned_bytes([(1000, 64)], 2, 2) == 64000
    assert pinned_bytes([(3, 1)], 2, 4, power_of_two=True) == 8 and pinned_bytes([(3, 1)], 2, 4) == 512
    big = shape("7b")
    assert pinned_bytes(big.tensor_shapes(), 1, 2) / GiB == pytest.approx(14.19, abs=0.01)
    assert pinned_bytes(big.tensor_shapes(), 1, 2, power_of_two=True) / GiB == pytest.approx(26.97, abs=0.01)
    # 7B LoRA r32 on 36 GiB: bf16 base shards 14.19 GiB, float32 adapters 0.30 GiB, their gradients 0.45 GiB
    lora = plan_memory(big, RunShape(64, 8, 128, 512, lora_rank=32), {}, 36 * GiB, 125 * GiB)
    assert lora.settings.param_offload
    assert 14.8 * GiB < lora.host["master weights"] + lora.host["gradients"] < 15.1 * GiB
    with pytest.raises(MemoryPlanError, match=r"would fit with 17 GiB of host memory"):
        plan_memory(big, RunShape(64, 8, 128, 512, lora_rank=32), {}, 36 * GiB, 12 * GiB)  # 15.5 / 0.94 = 16.5
    on_the_cpu = estimate(big, RunShape(64, 8, 128, 512, lora_rank=32, eager=True),
                          dataclasses.replace(lora.settings))[1]
    assert on_the_cpu["master weights"] < 15 * GiB  # nothing is pinned on a CPU run


def test_the_table_names_the_parameters_and_what_trains():
    """A table of a LoRA plan read like a full one but for its small optimizer state; the parameter count, of a
    mixture of experts the active ones, was nowhere."""
    assert "  model: 0.49B parameters; every parameter trains\n" in plan_memory(
        shape("0.5b"), STANDARD, {}, 139 * GiB, 128 * GiB).table()
    latent = ModelShape.from_hf_config(dict(  # DeepSeek-V2-Lite: latent attention has no k_proj or v_proj
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False))
    table = plan_memory(latent, dataclasses.replace(STANDARD, lora_rank=16), {}, 139 * GiB, 128 * GiB).table()
    adapters = lora_params(latent, 16, LORA_PROJECTIONS) / 1e6
    assert (f"  model: 15.71B parameters (2.66B active a token); LoRA adapters of rank 16 on q_proj, o_proj, gate_proj, "
            f"up_proj, down_proj ({adapters:.1f}M parameters) train, the base is frozen\n") in table


def test_explicit_settings_win_and_a_refusal_names_them():
    small = shape("0.5b")
    plan = plan_memory(small, STANDARD, {"micro_batch_tokens": 4096, "checkpoint_layers": 24}, 139 * GiB, 128 * GiB)
    assert plan.settings.micro_batch_tokens == 4096 and plan.settings.checkpoint_layers == 24
    assert plan.given == {"micro_batch_tokens", "checkpoint_layers"}
    with pytest.raises(MemoryPlanError, match=r"actor.max_tokens_per_micro_batch=auto"):
        plan_memory(small, STANDARD, {"micro_batch_tokens": 65536, "checkpoint_layers": 0,
                                      "keep_rollout_memory": True}, 40 * GiB, 128 * GiB)


def test_a_refusal_accounts_for_the_whole_need_the_fixed_overhead_too():
    """0.5B on 4 GiB needed 6.6 GiB, and the consumers named added to 3.6: the fixed 3 GiB overhead was left out, so
    they looked as if they fit in the 3.8 usable."""
    smallest = {"micro_batch_tokens": 4096, "checkpoint_layers": 24, "keep_rollout_memory": False}  # a quick search
    with pytest.raises(MemoryPlanError) as refused:
        plan_memory(shape("0.5b"), STANDARD, smallest, 4 * GiB, 30 * GiB)
    message = str(refused.value)
    assert ("needs 6.6 GiB per device at its rollout peak but 3.8 GiB are usable (fixed overhead 3.0 GiB, rollout "
            "activations 2.2 GiB, rollout weight copy 0.9 GiB, kv cache 0.5 GiB); it would fit with") in message
    # past three, what the others add: the figures still sum to the peak
    plan = plan_memory(shape("7b"), STANDARD, {}, 139 * GiB, 128 * GiB)
    consumers = plan.largest_consumers()
    assert re.fullmatch(r"(\w[\w ]* [\d.]+ GiB, ){2}\w[\w ]* [\d.]+ GiB and [\d.]+ GiB in \d+ others", consumers)
    assert sum(float(figure) for figure in re.findall(r"([\d.]+) GiB", consumers)) == pytest.approx(
        plan.peak[1] / GiB, abs=0.15)


def test_host_memory_limits_offload():
    big = shape("7b")
    with pytest.raises(MemoryPlanError, match="host memory"):
        plan_memory(big, STANDARD, {"param_offload": True}, 139 * GiB, 64 * GiB)


def test_never_more_than_the_device_minus_overhead():
    small = shape("0.5b")
    for gib in (24, 40, 80, 139):
        plan = plan_memory(small, STANDARD, {}, gib * GiB, 128 * GiB)
        phase, peak = plan.peak
        assert peak == sum(plan.phases[phase].values()) + OVERHEAD_BYTES <= gib * GiB


# ---- the config and command-line side -------------------------------------------------------------

@pytest.fixture()
def seven_b_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN25["7b"], "model_type": "qwen2"}))  # no weights
    return tmp_path


def test_a_config_json_transformers_cannot_read_is_refused_by_plan_as_the_load_refuses_it(tmp_path, capsys):
    """A config.json without model_type planned as fitting, where train's load refused it."""
    from reinforge.cli import main

    (tmp_path / "config.json").write_text(json.dumps(QWEN25["0.5b"]))
    assert main(["plan", f"model.path={tmp_path}", "--gpu-memory-gib", "80", "--host-memory-gib", "128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: model.path={tmp_path}: transformers cannot read its config.json") and "\n" not in err
    (tmp_path / "config.json").write_text(json.dumps({**QWEN25["0.5b"], "model_type": "qwen9"}))
    assert main(["plan", f"model.path={tmp_path}", "--gpu-memory-gib", "80", "--host-memory-gib", "128"]) == 2
    assert "is a 'qwen9' model, which transformers" in capsys.readouterr().err


def test_reinforge_plan_on_a_machine_without_the_gpu(seven_b_folder, capsys):
    from reinforge.cli import main

    assert main(["plan", f"model.path={seven_b_folder}", "data.train_batch_size=64", "data.max_prompt_length=128",
                 "data.max_response_length=512", "--gpu-memory-gib", "139", "--host-memory-gib", "128"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory plan: peak") and "of 130.7 usable GiB" in out
    assert main(["plan", f"model.path={seven_b_folder}", "data.train_batch_size=64", "--gpu-memory-gib", "16",
                 "--host-memory-gib", "128"]) == 2  # as train refuses a run that cannot fit
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the run does not fit") and "\n" not in err


def test_reinforge_plan_answers_for_a_cuda_card_from_a_machine_without_one(seven_b_folder, monkeypatch, capsys):
    """The device type comes from the config and the card's size from the flag: "will this fit on an 80 GiB card?"
    is answered from a laptop; only a size it cannot measure and was not given is refused, in one line."""
    from reinforge.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", f"model.path={seven_b_folder}", "trainer.device=cuda", "model.lora.rank=32",
                 "data.train_batch_size=8", "--gpu-memory-gib", "80", "--host-memory-gib", "128"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory plan: peak") and "of 75.2 usable GiB on the device" in out
    assert main(["plan", f"model.path={seven_b_folder}", "trainer.device=cuda", "--gpu-memory-gib", "80",
                 "--host-memory-gib", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the run does not fit: it needs") and "\n" not in err
    assert main(["plan", f"model.path={seven_b_folder}", "trainer.device=cuda"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: trainer.device=cuda plans for a GPU, and this machine has none to measure; pass --gpu-memory-gib N "
        "to plan for a card of N GiB (or trainer.device=cpu)")


@pytest.mark.parametrize("flag, value", [("--gpu-memory-gib", "0"), ("--gpu-memory-gib", "-5"),
                                         ("--host-memory-gib", "-1")])
def test_reinforge_plan_refuses_a_size_that_is_no_memory(seven_b_folder, capsys, flag, value):
    """0 GiB once planned for the machine's own device (a falsy size), and negative sizes for negative budgets."""
    from reinforge.cli import main

    sizes = {"--gpu-memory-gib": "80", "--host-memory-gib": "128", flag: value}
    assert main(["plan", f"model.path={seven_b_folder}", *(item for pair in sizes.items() for item in pair)]) != 0
    message = capsys.readouterr().err.strip()
    key = flag.removeprefix("--").replace("-", "_")
    assert f"trainer.{key}={float(value)}" in message and "positive" in message and "\n" not in message


def test_a_run_that_cannot_fit_fails_before_loading_weights(tiny_model_dir, arithmetic_data_dir, tmp_path,
                                                            monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from reinforge.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    code = main(["train", f"model.path={tiny_model_dir}", f"data.train_files=[{arithmetic_data_dir}/train.parquet]",
                 f"trainer.output_dir={tmp_path / 'run'}", "trainer.gpu_memory_gib=1", "trainer.device=cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "the run does not fit" in err and "overhead" not in err.splitlines()[-1][:10]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_auto_settings_are_resolved_and_recorded(tiny_model_dir):
    from reinforge.config.schema import Config
    from reinforge.workers.memory_settings import apply_memory_plan, has_auto_settings

    config = Config()
    config.model.path = str(tiny_model_dir)
    config.trainer.device = "cpu"
    config.actor.max_tokens_per_micro_batch = 4096
    plan = apply_memory_plan(config, log=False)
    assert plan is not None and not has_auto_settings(config)
    assert config.actor.max_tokens_per_micro_batch == 4096  # explicit wins
    assert config.model.gradient_checkpointing is False and config.rollout.kv_cache_gib > 0
    assert apply_memory_plan(config) is None  # nothing left to plan


def test_lora_adapters_are_counted_for_the_projections_the_config_names():
    from reinforge.config.schema import Config
    from reinforge.workers.memory_settings import run_shape

    big = shape("7b")
    # A is rank x in, B is out x rank: r x (in + out) per projection; q and o 3584 x 3584, k and v 3584 x 512,
    # gate, up and down 3584 x 18944; Qwen2.5-7B at rank 32 on all seven has 80,740,352 (peft's count)
    assert lora_params(big, 32) == 32 * 28 * (4 * 3584 + 2 * (3584 + 512) + 3 * (3584 + 18944)) == 80_740_352
    assert lora_params(big, 32, ("q_proj", "v_proj")) == 32 * 28 * (2 * 3584 + 3584 + 512)
    config = Config()
    config.model.lora.rank = 16
    config.model.lora.target_modules = ["self_attn.q_proj", "v_proj", "lm_head"]
    assert run_shape(config).lora_targets == ("q_proj", "v_proj")  # peft matches a path's last name
    config.model.lora.target_modules = ["all-linear"]
    assert run_shape(config).lora_targets == LORA_PROJECTIONS
    config.model.lora.target_modules = ["Wqkv"]  # names the planner does not know: counted as all seven
    assert run_shape(config).lora_targets == LORA_PROJECTIONS
    few = estimate(big, RunShape(64, 8, 128, 512, lora_rank=32, lora_targets=("q_proj", "v_proj")), Settings())[0]
    assert few["update"]["optimizer state"] == 8 * lora_params(big, 32, ("q_proj", "v_proj"))


def test_out_of_memory_becomes_one_line():
    from reinforge.controller.worker_group import WorkerCallError
    from reinforge.workers.memory_settings import describe_out_of_memory

    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nlots of detail")
        except torch.OutOfMemoryError as inner:
            raise WorkerCallError("actor_rollout.update_actor failed") from inner
    except WorkerCallError as error:
        message = describe_out_of_memory(error)
    assert message is not None and "\n" not in message
    assert "REINFORGE_DEBUG=1" in message and "max_tokens_per_micro_batch" in message
    assert "tried to allocate 20.00 GiB" in message
    assert describe_out_of_memory(ValueError("bad value")) is None
    relayed = RuntimeError("worker group 'actor_rollout' rank 0 raised in update_actor: torch.OutOfMemoryError: CUDA "
                           "out of memory. Tried to allocate 2.00 GiB")
    assert describe_out_of_memory(relayed).startswith("out of memory in a worker (worker group 'actor_rollout'")
    # a failure whose message merely speaks of memory is its own line, not an out-of-memory report
    assert describe_out_of_memory(RuntimeError("the scorer failed on all 16 samples (0 timed out, 0 ran out of "
                                               "memory); it raised ZeroDivisionError")) is None


def test_out_of_memory_of_a_worker_is_placed_where_the_worker_ran_out():
    """The controller's wrapper passed through its own wait; the line names the worker's frame, read from the
    traceback a Ray member relays in the error's notes."""
    from concurrent.futures import Future

    from reinforge.controller import Worker, WorkerCallError, WorkerGroup
    from reinforge.workers.memory_settings import describe_out_of_memory

    group = WorkerGroup(Worker, name="actor_rollout")
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    oom.add_note("raised by rank 0 of role 'actor_rollout' on node 10.0.0.2 (gpu-3), pid 4242:\nTraceback (most "
                 "recent call last):\n  File \"/opt/env/reinforge/workers/actor.py\", line 321, in update_actor\n"
                 "  File \"/opt/env/reinforge/engine/train_step.py\", line 88, in backward\n"
                 "  File \"/opt/env/torch/autograd/graph.py\", line 829, in _engine_run_backward")
    future: Future = Future()
    future.set_exception(oom)
    try:
        with pytest.raises(WorkerCallError) as caught:
            group._wait("update_actor", [future], None, None)
    finally:
        group.shutdown()
    message = describe_out_of_memory(caught.value)
    assert message.startswith("out of memory in a worker (worker group 'actor_rollout' (Worker) rank 0 of 1 raised "
                              "in update_actor: OutOfMemoryError: CUDA out of memory.")
    assert "tried to allocate 2.00 GiB; at reinforge/engine/train_step.py:88 (backward);" in message


def test_out_of_memory_line_keeps_torchs_figures_and_where_it_was_raised():
    from reinforge.workers import memory_settings

    text = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
            "1.23 GiB is free. Including non-PyTorch memory, this process has 138.57 GiB memory in use. Of the "
            "allocated memory 50.00 GiB is allocated by PyTorch, and 87.00 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting ...")
    message = memory_settings.describe_out_of_memory(torch.OutOfMemoryError(text))
    assert "; tried to allocate 2.00 GiB, 1.23 GiB free, 87.00 GiB reserved by PyTorch but unallocated" in message
    assert "\n" not in message
    from reinforge.rollout.noise import uniform_from_bits

    try:  # the innermost frame of reinforge's code an error passed through names the phase that ran out
        uniform_from_bits(None)
    except TypeError as error:
        assert memory_settings._raised_at(error).startswith("; at reinforge/rollout/noise.py:")
        assert memory_settings._raised_at(error).endswith(" (uniform_from_bits)")


def test_partial_checkpointing_gives_the_same_gradients(tiny_model_dir):
    from reinforge.engine.recompute import checkpoint_decoder_layers
    from reinforge.models import load_causal_lm

    def gradients(num_checkpointed: int) -> list[torch.Tensor]:
        model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device="cpu")
        model.train()
        assert checkpoint_decoder_layers(model, num_checkpointed) == num_checkpointed
        ids = torch.arange(24).reshape(2, 12) % model.config.vocab_size
        model(input_ids=ids, labels=ids).loss.backward()
        return [parameter.grad.clone() for parameter in model.parameters()]

    plain, checkpointed = gradients(0), gradients(1)
    for a, b in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(a, b)



# The allocator's peaks (torch.cuda.max_memory_allocated, GiB) of `reinforge bench train --model SIZE [--gpu-memory-gib N]`
# on one H200, each with the settings it ran (BENCHMARKS.md): (rollout, update). The 2026-12-01 points first, then
# 2026-12-02's (7B with every layer checkpointed and the 80 and 40 GiB caps).
H200_PEAKS = {
    "0.5b": (Settings(65536, 0, 24.0, 0.0, keep_rollout_memory=True), (10.7, 78.1)),
    "1.5b": (Settings(32768, 0, 24.0, 0.0, keep_rollout_memory=True), (29.7, 100.9)),
    "3b": (Settings(24576, 0, 24.0, 0.0, keep_rollout_memory=False), (52.2, 118.5)),
    "7b": (Settings(2048, 0, 24.0, 0.0, keep_rollout_memory=False), (118.2, 125.2)),
    "7b-checkpointed": (Settings(16384, 28, 24.0, 0.0, keep_rollout_memory=False), (118.2, 122.9)),
    "0.5b-80": (Settings(49152, 0, 24.0, 0.0, keep_rollout_memory=True), (10.7, 68.1)),
    "0.5b-40": (Settings(24576, 0, 24.0, 0.0, keep_rollout_memory=False), (10.6, 33.1)),
    "1.5b-80": (Settings(24576, 0, 24.0, 0.0, keep_rollout_memory=False), (29.6, 70.5)),
    "1.5b-40": (Settings(24576, 28, 24.0, 0.0, keep_rollout_memory=False), (29.5, 31.7)),
    "3b-80": (Settings(8192, 0, 24.0, 0.0, keep_rollout_memory=False), (52.2, 61.5)),
    "3b-40": (Settings(16384, 36, 24.0, 0.0, keep_rollout_memory=False, optimizer_offload=True), (29.2, 29.6)),
}


@pytest.mark.parametrize("case", sorted(H200_PEAKS))
def test_estimates_are_near_the_peaks_measured_on_the_h200(case):
    """Never more than 4 GiB under the allocator's peak (the overhead on top covers that), and at most 10 GiB over."""
    from reinforge.bench.train import QWEN25_SHAPES

    settings, measured = H200_PEAKS[case]
    phases, _ = estimate(ModelShape.from_hf_config(QWEN25_SHAPES[case.split("-")[0]]), STANDARD, settings)
    for phase, peak in zip(("rollout", "update"), measured, strict=True):
        estimated = sum(phases[phase].values()) / GiB
        assert -4.0 <= estimated - peak <= 10.0, (phase, estimated, peak)


def test_checkpointing_beats_small_micro_batches_for_3b_on_an_80_gib_card():
    """On the H200 capped at 80 GiB, 3B in 8k micro-batches without checkpointing took 20.79 s a step, and at 40 GiB
    with every layer checkpointed, 16k micro-batches and the optimizer on the CPU 18.63 s (2026-12-02)."""
    from reinforge.bench.train import QWEN25_SHAPES

    plan = plan_memory(ModelShape.from_hf_config(QWEN25_SHAPES["3b"]), STANDARD, {}, 80 * GiB, 128 * GiB)
    assert plan.fits and plan.settings.checkpoint_layers > 0 and plan.settings.micro_batch_tokens > 16384
    assert not plan.settings.optimizer_offload


def test_off_policy_modes_count_the_rollout_that_runs_beside_the_update():
    settings = Settings(16384, 0, 24.0, 0.0, keep_rollout_memory=False)
    model = shape("0.5b")
    sync, _ = estimate(model, STANDARD, settings)
    off_policy, _ = estimate(model, dataclasses.replace(STANDARD, off_policy=True), settings)
    copy = 2 * model.num_params  # the last synced weights, in bf16, besides the engine's own copy
    for phase in ("rollout", "update"):
        assert off_policy[phase]["off-policy rollout model"] == copy
    added = sum(off_policy["update"].values()) - sum(sync["update"].values())
    assert added == pytest.approx(copy + off_policy["update"]["rollout weight copy"] + off_policy["update"]["kv cache"]
                                  + off_policy["update"]["rollout activations"])
    plan = plan_memory(model, dataclasses.replace(STANDARD, off_policy=True), {}, 139 * GiB, 128 * GiB)
    assert plan.settings.keep_rollout_memory  # never freed between rollouts: one is always running


@pytest.mark.parametrize("text, expected", [
    ("{not json", r"config.json is not valid JSON .*repair or replace that file"),
    ("[1, 2]", r"config.json holds a JSON list, not an object of model sizes"),
    (json.dumps({**QWEN25["0.5b"], "hidden_size": "wide"}), r"gives hidden_size='wide', not a whole number"),
    (json.dumps({key: value for key, value in QWEN25["0.5b"].items() if key != "vocab_size"}),
     r"config.json has no 'vocab_size'"),
])
def test_a_broken_config_json_gets_one_line_naming_the_file_or_the_size(tmp_path, text, expected):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(MemoryPlanError, match=expected) as raised:
        ModelShape.from_model_path(str(tmp_path))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "argument --steps: 0 must be at least 1"),
    (["--prompts", "0"], "argument --prompts: 0 must be at least 1"),
    (["--response-tokens", "many"], "argument --response-tokens: 'many' is not a whole number"),
    (["--micro-tokens", "-4096"], "argument --micro-tokens: -4096 must be at least 1"),
    (["--lora", "-3"], "argument --lora: -3 is no LoRA rank; give 0 (no LoRA) or a positive rank"),
    (["--gpu-memory-gib", "0"], "argument --gpu-memory-gib: 0 GiB is no device"),
])
def test_reinforge_bench_train_refuses_sizes_that_are_no_sizes(args, message, capsys):
    """--steps 0 ended in an IndexError after the run; --lora -3 in peft's own message; --prompts 0 ran."""
    from reinforge.bench.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(args)
    assert message in capsys.readouterr().err
    assert parse_args(["--lora", "0", "--steps", "2"]).lora == 0


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("num_hidden_layers", 0), ("hidden_size", -1536)])
def test_sizes_below_one_in_config_json_are_refused(key, value):
    sizes = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96) | {key: value}
    with pytest.raises(MemoryPlanError, match=rf"config.json gives {key}={value}"):
        ModelShape.from_hf_config(sizes)


@pytest.mark.parametrize("key, value, expected", [
    ("hidden_size", 1.5, r"gives hidden_size=1.5, not a whole number; the planner needs an integer hidden_size"),
    ("intermediate_size", "big", r"gives intermediate_size='big', not a whole number"),
    ("sliding_window", True, r"gives sliding_window=True, not a whole number"),
    ("vocab_size", None, r"gives vocab_size=null; the planner needs the sizes"),
    ("num_key_value_heads", 0, r"gives num_key_value_heads=0; the planner needs positive sizes \(leave "
                               r"num_key_value_heads out or null to derive it"),
    ("head_dim", 0, r"gives head_dim=0; the planner needs positive sizes"),
])
def test_a_size_that_is_no_size_is_refused_by_its_key(key, value, expected):
    """hidden_size=1.5 was refused as head_dim=0, a null or a word without its key, and a given 0 KV heads or head_dim
    was planned as if left out."""
    sizes = dict(model_type="qwen2", vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96) | {key: value}
    with pytest.raises(MemoryPlanError, match=expected) as raised:
        ModelShape.from_hf_config(sizes)
    assert "\n" not in str(raised.value)
    assert ModelShape.from_hf_config(sizes | {"hidden_size": 64.0, key: 64.0 if key == "hidden_size" else None}
                                     if key in ("hidden_size", "num_key_value_heads", "head_dim") else
                                     {**sizes, key: 96}).hidden_size == 64  # 64.0 is whole; null: derived


def test_a_mixture_of_experts_that_routes_through_more_than_its_experts_is_refused():
    """Two experts, four a token planned more active parameters than parameters."""
    sizes = dict(model_type="mixtral", vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, num_local_experts=2, num_experts_per_tok=4)
    with pytest.raises(MemoryPlanError, match=r"^the model's config.json routes each token through "
                                              r"num_experts_per_tok=4 of its 2 experts; a mixture of experts "
                                              r"needs 1 to 2 \(is model.path the right model\?\)$"):
        ModelShape.from_hf_config(sizes)
    assert ModelShape.from_hf_config(sizes | {"num_experts_per_tok": 2}).experts_per_token == 2


MOE_SIZES = dict(model_type="mixtral", vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, num_local_experts=4)


@pytest.mark.parametrize("sizes, given", [
    (MOE_SIZES | {"num_experts_per_tok": 0}, "gives num_experts_per_tok=0"),
    (MOE_SIZES | {"num_experts_per_tok": None}, "gives num_experts_per_tok=null"),
    ({key: value for key, value in MOE_SIZES.items() if key != "model_type"}, "has no num_experts_per_tok"),
    (MOE_SIZES | {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32,
                  "num_experts_per_tok": 0}, "gives num_experts_per_tok=0"),
])
def test_a_mixture_of_experts_whose_tokens_run_through_no_expert_is_refused_naming_the_file(sizes, given, tmp_path):
    """num_experts_per_tok of 0 or null planned a mixture of experts whose tokens run through no expert."""
    (tmp_path / "config.json").write_text(json.dumps(sizes))
    expected = (rf"^{tmp_path / 'config.json'} {given} for its mixture of 4 experts, so no expert would run; set "
                r"num_experts_per_tok there to the experts each token runs through, 1 to 4 \(the model's published "
                r"top-k\), or point model.path at the right model$")
    with pytest.raises(MemoryPlanError, match=expected):
        ModelShape.from_model_path(str(tmp_path))
    assert ModelShape.from_hf_config({**sizes, "num_experts_per_tok": 2}).experts_per_token == 2
    assert ModelShape.from_hf_config(MOE_SIZES | {"moe_topk": 2}).experts_per_token == 2  # Aria's name for it


@pytest.mark.parametrize("model_type, window", [("mistral", -5), ("mistral", 0), ("mistral", 4096.0),
                                                ("phi3", -1), ("gemma2", 0), ("qwen2", 0)])
def test_a_sliding_window_that_is_no_window_is_refused_naming_the_file(model_type, window, tmp_path):
    """sliding_window=-5 or 0 was planned and failed as the model built (transformers refuses 4096.0 there too)."""
    sizes = dict(model_type=model_type, vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=96, sliding_window=window)
    if model_type == "qwen2":
        sizes |= {"use_sliding_window": True, "max_window_layers": 0}
    (tmp_path / "config.json").write_text(json.dumps(sizes))
    with pytest.raises(MemoryPlanError, match=rf"^{tmp_path / 'config.json'} gives sliding_window={window}, which is "
                                              r"no window; set it there to the model's window in tokens \(an integer "
                                              r"of 1 or more\), or to null for none$"):
        ModelShape.from_model_path(str(tmp_path))
    assert 2 in ModelShape.from_hf_config(sizes | {"sliding_window": 2}).attention_windows


@pytest.mark.parametrize("model_type", ["llama", "olmo2", "deepseek_v3"])
@pytest.mark.parametrize("window", [-5, 0, 4096.0, "none"])
def test_a_leftover_sliding_window_of_a_family_that_reads_none_is_planned_whole(model_type, window, tmp_path):
    """Llama, OLMo 2 and DeepSeek build and run whatever sliding_window their config.json carries (transformers
    reads it nowhere), so it is neither refused nor counted."""
    sizes = dict(model_type=model_type, vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=96, sliding_window=window)
    (tmp_path / "config.json").write_text(json.dumps(sizes))
    assert ModelShape.from_model_path(str(tmp_path)).attention_windows == ()


def test_a_null_window_is_no_window_except_for_layers_that_slide():
    """Null is Mistral's and Qwen's "no window", and Qwen's use_sliding_window=false reads none at all; Gemma 2's
    sliding layers fail to build without one."""
    sizes = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=96)
    assert ModelShape.from_hf_config(sizes | {"model_type": "mistral", "sliding_window": None}).attention_windows == ()
    assert ModelShape.from_hf_config(sizes | {"model_type": "qwen2", "use_sliding_window": False,
                                              "sliding_window": -5}).attention_windows == ()
    with pytest.raises(MemoryPlanError, match=r"^the model's config.json gives sliding_window=null, but its "
                                              r"layer_types has sliding_attention layers, which need a window; set "
                                              r"sliding_window there to the model's window in tokens \(Gemma 2's is "
                                              r"4096\)$"):
        ModelShape.from_hf_config(sizes | {"model_type": "gemma2", "sliding_window": None})


@pytest.mark.parametrize("model_type, windows", [("llama", ()), ("olmo2", ()), ("olmoe", ()), ("mistral", (8, 8))])
def test_a_window_key_of_a_family_that_reads_none_leaves_the_kv_cache_whole(model_type, windows):
    """A Llama, OLMo 2 or OLMoE config.json that carries a sliding_window (a fine-tune's leftover) attends to the whole
    context in transformers (their masks never slide) and in the native engine: its cache is planned whole;
    Mistral's slides."""
    sizes = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=96)
    assert ModelShape.from_hf_config(sizes | {"model_type": model_type, "sliding_window": 8}).attention_windows == \
        windows


def test_a_hub_id_that_the_hub_does_not_give_is_one_line(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: the variable is too late
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MemoryPlanError, match=r"reinforge-tests/no-such-model/config.json does not exist \(no local folder, and "
                                              r"the hub did not give its config.json: \w+\); .* or a reachable hub id"):
        ModelShape.from_model_path("reinforge-tests/no-such-model")  # in no cache either
    with pytest.raises(MemoryPlanError, match=r"no local folder of that name"):
        ModelShape.from_model_path(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")  # the file named, not its folder: it was ".../config.json/config.json"
    with pytest.raises(MemoryPlanError, match=rf"^model.path={tmp_path / 'config.json'} is a file; point model.path "
                                              rf"at the folder that holds config.json \({tmp_path} for this one\)$"):
        ModelShape.from_model_path(str(tmp_path / "config.json"))


def test_reinforge_plan_refuses_adapters_that_match_no_layer_as_train_does(seven_b_folder, capsys):
    from reinforge.cli import main

    (seven_b_folder / "config.json").write_text(json.dumps(QWEN25["7b"] | {"model_type": "qwen2"}))

    assert main(["plan", f"model.path={seven_b_folder}", "model.lora.rank=32", "model.lora.target_modules=[foo_proj]",
                 "--gpu-memory-gib", "40", "--host-memory-gib", "128"]) == 2
    err = capsys.readouterr().err.strip()
    assert "target_modules=['foo_proj'] names no linear layer" in err and "\n" not in err


MOE_CONFIGS = {  # the published configs' sizes: (config, total and active parameters in billions)
    "olmoe-1b-7b": (dict(model_type="olmoe", vocab_size=50304, hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024, num_experts=64,
                         num_experts_per_tok=8, tie_word_embeddings=False), 6.92, 1.28),
    "mixtral-8x7b": (dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
                          num_experts_per_tok=2, tie_word_embeddings=False), 46.7, 12.9),
    "deepseek-v2-lite": (dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_hidden_layers=27,
                              num_attention_heads=16, num_key_value_heads=16, intermediate_size=10944,
                              moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                              first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False), 15.7, 2.66),
    "deepseek-v3": (dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
                         num_attention_heads=128, num_key_value_heads=128, intermediate_size=18432,
                         moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                         first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False), 671.0, 37.6),
}


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_mixture_of_experts_families_total_and_active_parameters(name):
    config, total, active = MOE_CONFIGS[name]
    moe = ModelShape.from_hf_config(config)
    assert moe.num_params / 1e9 == pytest.approx(total, rel=0.005)
    assert moe.num_active_params / 1e9 == pytest.approx(active, rel=0.01)
    assert sum(rows * width for rows, width in moe.tensor_shapes()) == moe.num_params


def test_latent_attention_caches_the_compressed_latent_and_dense_layers_come_first():
    v2_lite = ModelShape.from_hf_config(MOE_CONFIGS["deepseek-v2-lite"][0])
    assert v2_lite.num_dense_layers == 1 and v2_lite.shared_expert_intermediate_size == 2 * 1408
    assert v2_lite.kv_bytes_per_token(2) == 27 * (512 + 64) * 2  # not 2 x 16 heads x 192 per layer
    assert v2_lite.layer_params > v2_lite.dense_layer_params
    # LoRA on q_proj and o_proj of every layer and on the dense layer's and shared experts' MLP projections
    rank, hidden = 8, 2048
    attention = rank * (hidden + 16 * 192) + rank * (16 * 128 + hidden)
    mlp = [3 * rank * (hidden + width) for width in (10944,) + (2 * 1408,) * 26]
    assert lora_params(v2_lite, rank) == 27 * attention + sum(mlp)
    qwen = ModelShape.from_hf_config(dict(model_type="qwen3_moe", vocab_size=100, hidden_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, intermediate_size=128, moe_intermediate_size=32,
                                          num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2,
                                          mlp_only_layers=[3]))
    assert qwen.num_dense_layers == 3  # layers 0 and 2 by the step, 3 by the list


@pytest.mark.parametrize("name", ["gemma2-2b", "phi3-mini", "olmo2-1b", "mistral-7b", "olmoe-1b-7b", "qwen3-30b-a3b"])
def test_plan_answers_for_every_bench_shape_on_one_h200(name, capsys):
    from reinforge.cli import main

    assert main(["plan", "--model", name, "--gpu-memory-gib", "139.8", "--host-memory-gib", "125",
                 "trainer.device=cuda"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("memory plan: peak ") and " of 131.4 usable GiB" in table
    if name == "qwen3-30b-a3b":  # the LoRA shape: a frozen bf16 base (57 GiB), which the engine reads in place
        assert "master weights 57.0" in table and "gradients 0.0" not in table and "rollout weight copy 1.7" in table


def test_plan_of_an_unknown_shape_is_refused_in_one_line(capsys):
    from reinforge.cli import main

    assert main(["plan", "--model", "qwen3-235b", "--gpu-memory-gib", "80"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model qwen3-235b (command line) is no model shape; give one of 0.5b," in err[0]


def test_a_lora_actors_rollout_counts_the_frozen_base_once():
    """On one device the engine reads a LoRA actor's frozen base in place: Qwen3-30B-A3B's rollout holds 57 GiB of
    experts once, plus its own copy of each layer's attention projections (32 x 128 q, 2 x 4 x 128 k and v, o)."""
    from reinforge.bench.shapes import shape_config

    moe = ModelShape.from_hf_config(shape_config("qwen3-30b-a3b"))
    attention = 48 * (2 * 4096 * 2048 + 2 * 512 * 2048)
    assert moe.projection_params == attention
    run = RunShape(64, 8, 128, 512, lora_rank=32, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    rollout = estimate(moe, run, Settings())[0]["rollout"]
    assert rollout["rollout weight copy"] == 2 * attention
    assert rollout["master weights"] > 2 * moe.num_params  # the frozen base, read by both
    for copied in (dataclasses.replace(run, num_devices=2), dataclasses.replace(run, off_policy=True)):
        assert estimate(moe, copied, Settings())[0]["rollout"]["rollout weight copy"] == 2 * moe.num_params
    offloaded = estimate(moe, run, Settings(param_offload=True))[0]["rollout"]
    assert offloaded["rollout weight copy"] == 2 * moe.num_params


def test_layers_kept_gathered_as_set_are_never_traded_for_streamed_parameters():
    """actor.keep_gathered=true stays as set: a plan that would need the parameters on the host is refused instead
    of dropping it."""
    big = shape("7b")
    assert plan_memory(big, STANDARD, {}, 40 * GiB, 192 * GiB).settings.param_offload  # auto: streamed, not kept
    with pytest.raises(MemoryPlanError):
        plan_memory(big, STANDARD, {"keep_gathered": True}, 40 * GiB, 192 * GiB)
    kept = plan_memory(shape("0.5b"), STANDARD, {"keep_gathered": True}, 139 * GiB, 128 * GiB)
    assert kept.settings.keep_gathered and not kept.settings.param_offload


RELEASED_CONFIGS = {  # as the released config.json files leave fields to the config class's defaults
    "gemma-2-2b": {"model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000,
                   "sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma-3-1b": {"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
                   "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
                   "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256},
    "gemma-3-4b": {"model_type": "gemma3", "mm_tokens_per_image": 256, "image_token_index": 262144,
                   "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                                   "num_hidden_layers": 34, "sliding_window": 1024,
                                   "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
                   "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                                     "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                                     "patch_size": 14, "vision_use_head": False}},
}


@pytest.mark.parametrize("name", sorted(RELEASED_CONFIGS))
def test_a_released_config_is_counted_with_the_defaults_transformers_builds_it_with(name):
    """Gemma's files leave out tie_word_embeddings (true), Gemma 3's its layer_types (from sliding_window_pattern)
    and its multimodal file most of text_config: the planner counts the model transformers builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = RELEASED_CONFIGS[name]
    shape = ModelShape.from_hf_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    language = sum(parameter.numel() for parameter_name, parameter in model.named_parameters()
                   if "vision_tower" not in parameter_name and "multi_modal_projector" not in parameter_name)
    assert shape.num_params == pytest.approx(language, rel=1e-3)
    if name == "gemma-3-1b":  # four full-attention layers of 26, the rest windowed
        assert layer_windows(with_family_defaults(config)).count(512) == 22


def test_a_classification_model_of_a_mixture_of_experts_counts_its_dense_layers_as_dense():
    """A reward model's (or a critic's) decoder was counted as every layer the largest, a mixture of experts' first
    dense layers too: DeepSeek-V2-Lite's came to 16.0B parameters where it has 15.5B."""
    from reinforge.engine.memory_plan import reward_model_params

    lite = ModelShape.from_hf_config(dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False))
    assert lite.num_dense_layers == 1
    assert reward_model_params(lite) == lite.num_params - 102400 * 2048 + 2048
    assert 15.4e9 < reward_model_params(lite) < 15.6e9
