"""LoRA (engine.lora) under FSDP2 on the CPU: reference = base, merged weights = adapter, sharding invariance."""

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from reinforge.config.schema import LoraConfig
from reinforge.engine.forward import response_log_probs
from reinforge.engine.fsdp import full_model_state, shard_model, unsharded
from reinforge.engine.lora import add_lora, lora_deltas, merge_lora_weights, merged_by_name, merged_weights

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_fsdp import run_gloo_ranks  # noqa: E402
from test_micro_batches_and_update import make_rollout_batch, varlen_lm  # noqa: E402

CONFIG = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])


def trained_lora_model(seed=4):
    """A sharded tiny model whose adapters are not zero (as after some training)."""
    model = varlen_lm(seed=seed)
    torch.manual_seed(seed)
    peft_model = add_lora(model, CONFIG)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.2)
    shard_model(model, torch.device("cpu"))
    return model, peft_model


def test_only_adapters_train():
    model, _ = trained_lora_model()
    trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert {name.split(".")[-4] for name in trainable} == set(CONFIG.target_modules)


def test_adapter_disabled_gives_the_separately_loaded_base_model():
    model, peft_model = trained_lora_model()
    base = shard_model(varlen_lm(seed=4), torch.device("cpu"))
    batch = make_rollout_batch(rows=5, seed=2)
    with torch.no_grad():
        adapted = response_log_probs(model, batch)[0]
        with peft_model.disable_adapter():
            disabled = response_log_probs(model, batch)[0]
        expected = response_log_probs(base, batch)[0]
    assert torch.equal(disabled, expected)
    assert (adapted - expected).abs().max() > 1e-2  # the adapters change the policy: the check above means something


def test_merged_weights_give_the_adapter_outputs_and_leave_the_trained_weights_alone():
    model, peft_model = trained_lora_model()
    before = {name: tensor.clone() for name, tensor in full_model_state(model).items()}
    batch = make_rollout_batch(rows=5, seed=3)
    with torch.no_grad():
        adapted = response_log_probs(model, batch)[0]
        with unsharded(model), merged_weights(peft_model):  # what the hf backend generates with
            merged = response_log_probs(model, batch)[0]
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
    after = full_model_state(model)
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
    with torch.no_grad():
        torch.testing.assert_close(response_log_probs(model, batch)[0], adapted, atol=0, rtol=0)


def test_merge_lora_weights_folds_each_adapter_into_its_layer():
    model, peft_model = trained_lora_model()
    state = full_model_state(model)
    deltas = {}
    with unsharded(model):
        for layer, delta in lora_deltas(peft_model):
            name = next(n for n, m in model.named_modules() if m is layer)
            deltas[f"{name}.weight"] = delta.clone()
    base_weights = {name.replace(".base_layer.", "."): tensor.clone() for name, tensor in state.items()
                    if ".base_layer.weight" in name}
    merged = merge_lora_weights(state, CONFIG.alpha / CONFIG.rank)
    assert not any(".lora_" in name or ".base_layer." in name for name in merged)
    assert set(merged) == set(varlen_lm(seed=4).state_dict())
    for name, weight in base_weights.items():
        torch.testing.assert_close(merged[name], weight + deltas[name], atol=1e-6, rtol=0)


UPDATE = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_lora import CONFIG
    from test_micro_batches_and_update import make_rollout_batch, on_policy_update, varlen_lm
    from reinforge.config.schema import OptimConfig
    from reinforge.engine.distributed import init_distributed
    from reinforge.engine.fsdp import full_training_state, shard_model
    from reinforge.engine.lora import add_lora
    from reinforge.engine.optim import build_optimizer, build_scheduler
    from reinforge.engine.train_step import UpdateSettings

    def update(rows, budget):
        model = varlen_lm(seed=4).train()
        torch.manual_seed(0)
        add_lora(model, CONFIG)
        shard_model(model, torch.device("cpu"))
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
        scheduler = build_scheduler(optimizer, 10, OptimConfig(lr=1e-2))
        batch = make_rollout_batch(rows=8, seed=5).index(rows)
        for _ in range(2):
            on_policy_update(model, optimizer, scheduler, batch,
                             UpdateSettings(max_tokens_per_micro_batch=budget, grad_clip=1.0))
        return full_training_state(model, optimizer)

    if __name__ == "__main__":
        rank, world_size = init_distributed("gloo")
        state = update(list(range(rank * 4, rank * 4 + 4)), budget=12)
        if rank == 0:
            torch.save(state, sys.argv[1])
""")


@pytest.mark.slow
def test_two_gloo_processes_train_the_adapters_like_one(tmp_path):
    """peft's layers under fully_shard: two ranks with half the batch each end where one rank with all of it does."""
    source = UPDATE.format(tests=str(REPO / "tests" / "engine"))
    script = tmp_path / "update.py"
    script.write_text(source)
    run_gloo_ranks(script, str(tmp_path / "two.pt"))
    two = torch.load(tmp_path / "two.pt", weights_only=True)

    namespace: dict = {"__name__": "one"}
    exec(source, namespace)
    one = namespace["update"](list(range(8)), budget=10_000)
    assert set(two["model"]) == set(one["model"]) and all(".lora_" in name for name in one["model"])
    for name, tensor in one["model"].items():
        torch.testing.assert_close(two["model"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    for name, moments in one["optimizer"]["state"].items():
        torch.testing.assert_close(two["optimizer"]["state"][name]["exp_avg"], moments["exp_avg"], atol=1e-7,
                                   rtol=1e-4, msg=name)
    assert any(tensor.abs().sum() > 0 for name, tensor in one["model"].items() if "lora_B" in name)


def test_merged_by_name_yields_what_merge_lora_weights_builds():
    model, _ = trained_lora_model()
    state = full_model_state(model)
    streamed = dict(merged_by_name(state, CONFIG.alpha / CONFIG.rank))
    merged = merge_lora_weights(dict(state), CONFIG.alpha / CONFIG.rank)
    assert streamed.keys() == merged.keys()
    assert all(torch.equal(streamed[name], tensor) for name, tensor in merged.items())


def test_adapters_start_from_the_seed_and_leave_the_global_generator_alone():
    def lora_a(seed):
        model = varlen_lm(seed=0)
        add_lora(model, CONFIG, seed=seed)
        return [parameter.detach().clone() for name, parameter in model.named_parameters() if "lora_A" in name]

    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = lora_a(seed=5)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's random stream is unchanged
    again, other = lora_a(seed=5), lora_a(seed=6)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_target_modules_that_name_no_layer_fail_before_the_model_loads(tmp_path):
    from reinforge.engine.lora import check_target_modules

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match=r"names no linear layer of a qwen2 model; use some of q_proj, k_proj"):
        check_target_modules(LoraConfig(rank=8, target_modules=["c_attn", "nope"]), str(tmp_path))
    # peft matches a name against the end of a module's path; one known layer is enough, as for peft
    check_target_modules(LoraConfig(rank=8, target_modules=["self_attn.q_proj", "c_attn"]), str(tmp_path))
    check_target_modules(LoraConfig(rank=8, target_modules=["all-linear"]), str(tmp_path))
    check_target_modules(LoraConfig(rank=0, target_modules=["nope"]), str(tmp_path))  # LoRA off: nothing to check
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "some_new_arch"}))
    check_target_modules(LoraConfig(rank=8, target_modules=["nope"]), str(tmp_path))  # unknown: left to peft
    # DeepSeek's query: q_a_proj and q_b_proj with a q_lora_rank (V3, V2), one q_proj without (V2-Lite)
    for q_lora_rank, absent, present in ((1536, "q_proj", "q_a_proj"), (None, "q_a_proj", "q_proj")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "q_lora_rank": q_lora_rank}))
        with pytest.raises(ValueError, match=r"names no linear layer of a deepseek_v3 model"):
            check_target_modules(LoraConfig(rank=8, target_modules=[absent]), str(tmp_path))
        check_target_modules(LoraConfig(rank=8, target_modules=[present]), str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "smollm3"}))
    with pytest.raises(ValueError, match=r"names no linear layer of a smollm3 model; use some of q_proj"):
        check_target_modules(LoraConfig(rank=8, target_modules=["qkv_proj"]), str(tmp_path))


@pytest.mark.parametrize("model_type", ["deepseek_v2", "phi3", "mixtral"])
def test_the_default_targets_get_no_warning_where_the_family_gets_its_own(tmp_path, caplog, model_type):
    """DeepSeek's and Phi-3's runs with the default targets were warned that peft ignores k_proj and v_proj (or
    q_proj ... up_proj) while the load adapts the family's own projections in their place."""
    import logging

    from reinforge.engine.lora import check_target_modules

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with caplog.at_level(logging.WARNING, logger="reinforge.engine.lora"):
        check_target_modules(LoraConfig(rank=8), str(tmp_path))
    assert not caplog.records


def test_lora_on_a_mixture_of_experts_adapts_attention_and_says_the_experts_stay_frozen(tmp_path, caplog):
    import logging

    from reinforge.engine.lora import check_target_modules
    from reinforge.models.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm("qwen3_moe", vocab_size=64)
    with caplog.at_level(logging.INFO, logger="reinforge.engine.lora"):
        add_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trained and all("lora_" in name and ".self_attn." in name for name in trained)
    assert all(not parameter.requires_grad for name, parameter in model.named_parameters() if ".experts." in name)
    assert [record.message for record in caplog.records if "mixture of experts" in record.message] == [
        "LoRA on a mixture of experts: the experts' fused 3-D weights get no adapter and stay frozen: peft can adapt "
        "such parameters (target_parameters), but the merged weights reinforge hands the rollout and writes on export "
        "do not include those adapters"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(ValueError, match=r"names no linear layer of a mixtral model; use some of q_proj, k_proj"):
        check_target_modules(LoraConfig(rank=8, target_modules=["gate_proj", "up_proj", "down_proj"]), str(tmp_path))


@pytest.mark.parametrize(("model_type", "options", "dense"), [
    ("qwen3_moe", {}, False),
    ("qwen3_moe", {"mlp_only_layers": [0]}, True),
    ("qwen3_moe", {"decoder_sparse_step": 2}, True),
    ("deepseek_v3", {"first_k_dense_replace": 0, "n_shared_experts": 0}, False),
    ("deepseek_v3", {"first_k_dense_replace": 1, "n_shared_experts": 0}, True),
    ("deepseek_v3", {"first_k_dense_replace": 0}, True),  # V3's one shared expert by default
    ("deepseek_v2", {"first_k_dense_replace": 0, "n_shared_experts": 0}, False),
])
def test_the_dense_mlp_projections_are_targets_where_the_model_has_dense_mlps(tmp_path, caplog, model_type, options,
                                                                             dense):
    """A mixture of experts' gate/up/down projections are linear layers only in its dense MLPs: Qwen3-MoE's
    mlp_only_layers and the layers decoder_sparse_step skips, DeepSeek's first_k_dense_replace layers and shared
    experts. There the targets may name them and the default targets adapt them; elsewhere they name nothing."""
    from reinforge.engine.lora import check_target_modules
    from reinforge.models.tiny import build_tiny_causal_lm

    extra = {"q_lora_rank": 16} if model_type == "deepseek_v3" else {}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "num_hidden_layers": 2, **extra,
                                                      **options}))
    mlp_targets = LoraConfig(rank=8, target_modules=["gate_proj", "up_proj", "down_proj"])
    if dense:
        check_target_modules(mlp_targets, str(tmp_path))
    else:
        with pytest.raises(ValueError, match=rf"names no linear layer of a {model_type} model \(every MLP of this "
                                             rf"{model_type} is a mixture of experts, whose fused weights get no "
                                             r"adapter\); use some of "):
            check_target_modules(mlp_targets, str(tmp_path))
    model = build_tiny_causal_lm(model_type, vocab_size=64, num_layers=2, **extra, **options)
    with caplog.at_level("WARNING"):
        add_lora(model, LoraConfig(rank=4))
    adapted = {name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters()
               if ".lora_A." in name}
    assert bool(adapted & {"gate_proj", "up_proj", "down_proj"}) is dense
    assert adapted & {"o_proj"} and not caplog.records
    assert all(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "mixtral"])
def test_default_targets_on_a_mixture_of_experts_adapt_linear_layers_and_leave_the_experts_frozen(arch):
    from reinforge.models.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(arch)
    peft_model = add_lora(model, LoraConfig(rank=4))
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in peft_model.named_parameters() if ".lora_A." in name}
    assert adapted and all(name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) for name in adapted)
    assert not any(type(module).__name__ == "ParamWrapper" for module in peft_model.modules())


@pytest.mark.parametrize(("arch", "options", "expected"), [
    ("phi3", {}, {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),  # fused projections
    ("deepseek_v3", {"q_lora_rank": 16}, {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                          "gate_proj", "up_proj", "down_proj"}),  # MLA, and the dense/shared MLPs
    ("deepseek_v2", {"q_lora_rank": None}, {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                                            "up_proj", "down_proj"}),
    ("qwen2", {}, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
])
def test_default_targets_adapt_every_projection_of_the_family_whatever_its_names(arch, options, expected, caplog):
    from reinforge.models.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(arch, **options)
    with caplog.at_level("INFO"):
        peft_model = add_lora(model, LoraConfig(rank=4))
    adapted = {name.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for name, _ in peft_model.named_parameters()
               if ".lora_A." in name}
    assert adapted == expected
    assert ("its adapters go on its linear layers" in caplog.text) == (arch != "qwen2")


def test_a_target_that_adapts_no_layer_of_the_model_is_named_in_one_line(caplog):
    from reinforge.models.tiny import build_tiny_causal_lm

    with caplog.at_level("WARNING"):
        add_lora(build_tiny_causal_lm("deepseek_v3", q_lora_rank=16), LoraConfig(rank=4, target_modules=[
            "q_proj", "kv_b_proj", "o_proj"]))
    assert "model.lora.target_modules names ['q_proj'], which match no linear layer of this DeepseekV3ForCausalLM; " \
           "its adapters are on kv_b_proj, o_proj only" in caplog.text


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-tower", "trained-tower"])
def test_a_frozen_vision_tower_gets_no_adapters_and_a_trained_one_does(frozen):
    """Qwen2.5-VL's tower MLP shares the language model's projection names: the default targets match it, but a
    tower frozen by ``actor.freeze_vision_tower`` stays whole (no adapter, nothing trained in it)."""
    from reinforge.models.tiny_vlm import build_tiny_vlm
    from reinforge.models.vision import freeze_vision_tower

    model = build_tiny_vlm("qwen2_5_vl")
    freeze_vision_tower(model, frozen)
    add_lora(model, LoraConfig(rank=4))
    adapted = [name for name, _ in model.named_parameters() if ".lora_" in name]
    in_tower = [name for name in adapted if ".visual." in name]
    assert any(".language_model." in name for name in adapted)
    assert bool(in_tower) is not frozen
    trained_in_tower = [name for name, parameter in model.named_parameters()
                        if ".visual." in name and parameter.requires_grad]
    assert bool(trained_in_tower) is not frozen


@pytest.mark.parametrize("targets", [None, ["all-linear"]], ids=["default-targets", "all-linear"])
def test_a_trained_tower_that_the_targets_miss_is_said_to_train_nothing(targets, caplog):
    """Qwen3-VL's tower names its linear layers qkv, proj, linear_fc1/2, which the default targets miss: LoRA freezes
    its weights, so actor.freeze_vision_tower=false would train nothing in it without a word."""
    from reinforge.models.tiny_vlm import build_tiny_vlm
    from reinforge.models.vision import freeze_vision_tower

    model = build_tiny_vlm("qwen3_vl")
    freeze_vision_tower(model, False)
    with caplog.at_level("WARNING"):
        add_lora(model, LoraConfig(rank=4, **({"target_modules": targets} if targets else {})))
    in_tower = [name for name, parameter in model.named_parameters() if ".visual." in name and parameter.requires_grad]
    assert bool(in_tower) is bool(targets)
    said = "actor.freeze_vision_tower=false, but model.lora.target_modules=" in caplog.text
    assert said is not bool(targets)
    if said:
        assert "match no linear layer of the vision tower (linear_fc1, linear_fc2, proj, qkv)" in caplog.text


def test_a_deepseek_adapter_folder_names_what_was_adapted_and_serve_merges_every_adapter(tmp_path, monkeypatch):
    """peft on transformers 5 loads a DeepSeek folder's gate/up/down adapters into the fused experts; the folder names
    only the layers adapted, its base by an absolute path, and ``reinforge serve ADAPTER`` merges it by name."""
    import json

    from reinforge.engine.lora import adapter_state, write_adapter_folder
    from reinforge.models.export import save_hf_folder
    from reinforge.models.tiny import build_char_tokenizer, build_tiny_causal_lm
    from reinforge.serve.command import load_model

    tokenizer = build_char_tokenizer()
    base = build_tiny_causal_lm("deepseek_v3", vocab_size=len(tokenizer), q_lora_rank=16, seed=1)
    monkeypatch.chdir(tmp_path)
    save_hf_folder(base, tokenizer, tmp_path / "base")
    model = build_tiny_causal_lm("deepseek_v3", vocab_size=len(tokenizer), q_lora_rank=16, seed=1)
    config = LoraConfig(rank=4, alpha=8.0)
    peft_model = add_lora(model, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3, generator=torch.Generator().manual_seed(len(name)))
    write_adapter_folder(tmp_path / "adapter", adapter_state(model.state_dict()), config, "base")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert set(saved["target_modules"]) == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj"}
    ids = torch.tensor([[5, 9, 40, 41, 42, 7]])
    with torch.no_grad():
        expected = peft_model(ids).logits
    served, _ = load_model(str(tmp_path / "base"), str(tmp_path / "adapter"), "float32", torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_layers_that_share_one_weight_share_one_adapter_and_the_merged_export_is_the_adapted_model(tmp_path):
    """Zamba's shared transformer block is one set of weights read by several hybrid layers, each its own module:
    each of those layers gets the same adapter, so the one merged weight an export holds is what every layer read,
    and the adapter folder names it under each layer."""
    from reinforge.engine.lora import adapter_state, read_adapter_weights, write_adapter_folder
    from reinforge.models.tiny import build_tiny_causal_lm

    def shared(model):
        first, second = model.model.layers[0].self_attn, model.model.layers[1].self_attn
        second.q_proj.weight = first.q_proj.weight
        return model

    model = shared(build_tiny_causal_lm("llama", vocab_size=64, seed=3))
    peft_model = add_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3, generator=torch.Generator().manual_seed(len(name)))
    exported = shared(build_tiny_causal_lm("llama", vocab_size=64, seed=3))
    exported.load_state_dict(merge_lora_weights(dict(model.state_dict()), 2.0))
    ids = torch.tensor([[5, 9, 40, 41, 42, 7]])
    with torch.no_grad():
        adapted, plain = peft_model(ids).logits, exported(ids).logits
        with peft_model.disable_adapter():
            base = peft_model(ids).logits
    assert (adapted - base).abs().max() > 1e-2
    torch.testing.assert_close(plain, adapted, atol=1e-5, rtol=1e-5)
    write_adapter_folder(tmp_path / "adapter", adapter_state(model.state_dict()), LoraConfig(rank=4, alpha=8.0), "")
    written = read_adapter_weights(tmp_path / "adapter")
    assert written.keys() == adapter_state(model.state_dict()).keys()
    assert torch.equal(written["model.layers.1.self_attn.q_proj.lora_B.default.weight"],
                       written["model.layers.0.self_attn.q_proj.lora_B.default.weight"])


@pytest.mark.parametrize("arch", ["phimoe", "falcon"])
def test_all_linear_leaves_a_linear_layer_with_its_own_forward_alone(arch, tmp_path):
    """PhiMoE's router is an nn.Linear whose forward returns (logits, weights, experts): an adapter's output added to
    that, or a merged weight's plain linear in its place (the rollout's), would not be the router; its adapter folder
    names the layers adapted, which peft loads. Falcon's linear layers compute W x + b in their own forward: adapted."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from reinforge.engine.lora import adapter_state, write_adapter_folder
    from reinforge.models.tiny import build_tiny_causal_lm

    def build():
        if arch == "phimoe":
            return build_tiny_causal_lm("phimoe", vocab_size=64)
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "falcon", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))

    model = build()
    peft_model = add_lora(model, LoraConfig(rank=4, target_modules=["all-linear"]))
    adapted = {name.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters()
               if ".lora_A." in name}
    assert adapted == ({"q_proj", "k_proj", "v_proj", "o_proj"} if arch == "phimoe"
                       else {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"})
    ids = torch.tensor([[5, 9, 40, 41, 42, 7]])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.01, generator=torch.Generator().manual_seed(len(name)))
        adapted_logits = peft_model(ids).logits
        with merged_weights(peft_model):
            torch.testing.assert_close(peft_model(ids).logits, adapted_logits, atol=1e-5, rtol=1e-5)
    build().save_pretrained(tmp_path / "base")
    write_adapter_folder(tmp_path / "adapter", adapter_state(model.state_dict()), LoraConfig(rank=4, alpha=64.0,
                         target_modules=["all-linear"]), str(tmp_path / "base"))
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(build(), str(tmp_path / "adapter"))(ids).logits
    torch.testing.assert_close(loaded, adapted_logits, atol=1e-5, rtol=1e-5)


def test_an_adapter_folder_of_targets_that_name_some_layers_of_a_name_adapts_those_alone(tmp_path):
    """target_modules=[layers.0.self_attn.q_proj] adapts layer 0's q_proj; the folder said q_proj, so peft loading it
    gave every layer's q_proj an adapter ('Found missing adapter keys')."""
    import warnings

    from peft import PeftModel

    from reinforge.engine.lora import adapter_state, write_adapter_folder
    from reinforge.models.tiny import build_tiny_causal_lm

    config = LoraConfig(rank=4, alpha=8.0, target_modules=["layers.0.self_attn.q_proj"])
    model = build_tiny_causal_lm("llama", vocab_size=64, seed=3)
    peft_model = add_lora(model, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3, generator=torch.Generator().manual_seed(len(name)))
    state = model.state_dict()
    write_adapter_folder(tmp_path / "adapter", adapter_state(state), config, "", state)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["target_modules"] == ["model.layers.0.self_attn.q_proj"]
    ids = torch.tensor([[5, 9, 40, 41, 42, 7]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft's missing adapter keys
        loaded = PeftModel.from_pretrained(build_tiny_causal_lm("llama", vocab_size=64, seed=3), tmp_path / "adapter")
    assert [name for name, _ in loaded.named_parameters() if ".lora_A." in name] == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, peft_model(ids).logits, atol=1e-5, rtol=1e-5)
    whole = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj"])  # every layer's: the short name stays
    model = build_tiny_causal_lm("llama", vocab_size=64, seed=3)
    add_lora(model, whole)
    write_adapter_folder(tmp_path / "whole", adapter_state(model.state_dict()), whole, "", model.state_dict())
    assert json.loads((tmp_path / "whole" / "adapter_config.json").read_text())["target_modules"] == ["q_proj"]


def test_adding_adapters_says_nothing_of_transformers_old_checkpointing_flag():
    """peft reads model.is_gradient_checkpointing, whose FutureWarning every LoRA run printed."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        add_lora(varlen_lm(seed=1), CONFIG)
