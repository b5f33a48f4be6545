import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from reinforge.models.architectures import FAMILIES, architecture_spec
from reinforge.models.tiny import ARCHITECTURES, build_tiny_causal_lm, tiny_config

WINDOWED = ("qwen2", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3", "qwen3_moe", "mixtral")
TABLE_FAMILIES = [arch for arch in ARCHITECTURES if arch in FAMILIES]

CAPTURED: dict[int, dict] = {}


def _capturing_attention(module, query, key, value, attention_mask, **kwargs):
    """What transformers hands the attention function of each layer: its window, scale and soft-cap."""
    CAPTURED[module.layer_idx] = {"sliding_window": kwargs.get("sliding_window"), "scaling": kwargs.get("scaling"),
                                  "softcap": kwargs.get("softcap")}
    kwargs.pop("softcap", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("capture_for_test", _capturing_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("capture_for_test", sdpa_mask)


@pytest.mark.parametrize("arch", TABLE_FAMILIES)
def test_table_matches_what_transformers_passes_each_layer(arch):
    model = build_tiny_causal_lm(arch, num_layers=4, sliding_window=5 if arch in WINDOWED else None)
    spec = architecture_spec(model.config)
    assert spec is not None and spec.model_type == model.config.model_type
    model.set_attn_implementation("capture_for_test")
    CAPTURED.clear()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (1, 9)))
    assert len(spec.layers) == len(CAPTURED) == 4
    for index, layer in enumerate(spec.layers):
        seen = CAPTURED[index]
        assert layer.sliding_window == seen["sliding_window"], index
        assert spec.attn_scale == pytest.approx(seen["scaling"], rel=1e-12)
        assert spec.attn_softcap == seen["softcap"]
        decoder_layer = model.model.layers[index]
        assert layer.moe == hasattr(decoder_layer.mlp, "experts"), index
        uses_rope = getattr(decoder_layer.self_attn, "use_rope", True)
        assert (layer.rope != "none") == bool(uses_rope)
    if arch in WINDOWED:
        assert spec.windowed
    assert spec.final_softcap == getattr(model.config, "final_logit_softcapping", None)


def test_windows_per_family_as_transformers_decides_them():
    def windows(arch, **options):
        return [layer.sliding_window for layer in architecture_spec(tiny_config(arch, **options)).layers]

    assert windows("mistral", num_layers=3, sliding_window=8) == [8, 8, 8]
    assert windows("mistral", num_layers=2) == [None, None]
    # Qwen2: layer i slides iff i >= max_window_layers, and only with use_sliding_window
    assert windows("qwen2", num_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2) == \
        [None, None, 8, 8]
    assert windows("qwen2", num_layers=4, use_sliding_window=False, sliding_window=8, max_window_layers=2) == \
        [None] * 4
    assert windows("gemma2", num_layers=4, sliding_window=8) == [8, None, 8, None]
    gemma3 = tiny_config("gemma3_text", num_layers=12, sliding_window=8, layer_types=None)
    spec = architecture_spec(gemma3)
    assert [layer.sliding_window for layer in spec.layers] == [8, 8, 8, 8, 8, None] * 2
    assert [layer.rope for layer in spec.layers] == ["local"] * 5 + ["global"] + ["local"] * 5 + ["global"]
    smollm3 = architecture_spec(tiny_config("smollm3", num_layers=8, sliding_window=8, no_rope_layer_interval=4))
    assert [layer.rope for layer in smollm3.layers] == ["global", "global", "global", "none"] * 2
    assert [layer.sliding_window for layer in smollm3.layers] == [None, None, None, 8] * 2


def test_moe_and_mla_tables():
    v3 = architecture_spec(tiny_config("deepseek_v3", num_layers=3))
    assert [layer.moe for layer in v3.layers] == [False, True, True]
    assert (v3.moe.scoring, v3.moe.group_score, v3.moe.correction_bias, v3.moe.routed_scaling_factor) == \
        ("sigmoid", "top2_sum", True, 2.5)
    assert (v3.moe.n_group, v3.moe.topk_group, v3.moe.shared_experts) == (4, 2, 1)
    assert v3.mla.v_head_dim == 16 and v3.head_dim == 24 and v3.mla.q_lora_rank == 24
    v2 = architecture_spec(tiny_config("deepseek_v2", num_layers=2))
    assert (v2.moe.scoring, v2.moe.group_score, v2.moe.norm_topk_prob) == ("softmax", "max", False)
    assert v2.mla.q_lora_rank is None
    greedy = architecture_spec(tiny_config("deepseek_v2", num_layers=2, topk_method="greedy"))
    assert greedy.moe.n_group is None and greedy.moe.group_score is None
    # another selection (V3's noaux_tc) is none transformers' V2 router runs: its forward fails, and was routed greedily
    with pytest.raises(ValueError) as refused:
        architecture_spec(tiny_config("deepseek_v2", num_layers=2, topk_method="noaux_tc"))
    assert str(refused.value) == (
        "deepseek_v2 config (model.path's config.json) has topk_method='noaux_tc', which transformers' DeepseekV2 "
        "router does not run (its forward fails); set topk_method to one of greedy, group_limited_greedy")
    qwen3_moe = architecture_spec(tiny_config("qwen3_moe", num_layers=4, decoder_sparse_step=2,
                                              mlp_only_layers=[3]))
    assert [layer.moe for layer in qwen3_moe.layers] == [False, True, False, False]
    assert qwen3_moe.moe.weights_dtype == "logits"
    mixtral = architecture_spec(tiny_config("mixtral"))
    assert (mixtral.moe.norm_topk_prob, mixtral.moe.weights_dtype, mixtral.moe.top_k) == (True, "float32", 2)


MLA_REFUSAL = ("deepseek_v2 config (model.path's config.json) has num_key_value_heads=2 with num_attention_heads=4: "
               "transformers' DeepseekV2 attention expands its latent into 4 key and value heads, then repeats them 2 "
               "times (num_attention_heads // num_key_value_heads), so its forward fails on mismatched head counts; "
               "set num_key_value_heads to 4")
UNSET_WINDOW_REFUSAL = ("qwen2 config (model.path's config.json) lists sliding_attention layers in layer_types with "
                        "use_sliding_window=false, which transformers reads as no window (sliding_window=None), so its "
                        "forward fails building their mask; set use_sliding_window=true (with sliding_window) to slide "
                        "them, or list them as full_attention")
NULL_WINDOW_REFUSAL = ("smollm3 config (model.path's config.json) lists sliding_attention layers in layer_types with "
                       "sliding_window=null, so transformers' forward fails building their mask; set sliding_window to "
                       "the model's window in tokens, or list them as full_attention")
SLIDING_SECOND = ["full_attention", "sliding_attention"]
TOP_K_REFUSAL = ("qwen3_moe config (model.path's config.json) has num_experts_per_tok=5 with 4 experts: transformers' "
                 "Qwen3Moe router takes the top 5 of 4 scores, so its forward fails; set num_experts_per_tok to 1 to 4")
ONE_EXPERT_GROUPS_REFUSAL = (
    "deepseek_v3 config (model.path's config.json) has n_group=8 for 8 routed experts, one expert a group: "
    "transformers' DeepseekV3 router scores a group by its best two experts, so its forward fails; set n_group to a "
    "divisor of 8 of at most 4")
UNEVEN_GROUPS_REFUSAL = (
    "deepseek_v3 config (model.path's config.json) has n_group=5 for 8 routed experts: transformers' DeepseekV3 router "
    "splits the experts into n_group groups of equal size, so its forward fails or groups the scores of different "
    "tokens together; set n_group to a divisor of 8")
KEPT_GROUPS_REFUSAL = (
    "deepseek_v2 config (model.path's config.json) has topk_group=5 with n_group=4: transformers' DeepseekV2 router "
    "keeps the best topk_group of the n_group groups, so its forward fails; set topk_group to 1 to 4")


@pytest.mark.parametrize(("arch", "options", "message"), [
    ("deepseek_v2", {"num_key_value_heads": 2}, MLA_REFUSAL),
    ("deepseek_v3", {"num_key_value_heads": 1}, MLA_REFUSAL.replace("deepseek_v2", "deepseek_v3").replace(
        "DeepseekV2", "DeepseekV3").replace("=2 with", "=1 with").replace("them 2 times", "them 4 times")),
    ("qwen2", {"layer_types": SLIDING_SECOND, "use_sliding_window": False, "sliding_window": 4}, UNSET_WINDOW_REFUSAL),
    ("qwen3", {"layer_types": SLIDING_SECOND, "use_sliding_window": False, "sliding_window": 4},
     UNSET_WINDOW_REFUSAL.replace("qwen2", "qwen3")),
    ("smollm3", {"layer_types": SLIDING_SECOND, "use_sliding_window": False, "sliding_window": None},
     NULL_WINDOW_REFUSAL),
    ("qwen3_moe", {"num_experts_per_tok": 5}, TOP_K_REFUSAL),
    ("deepseek_v3", {"n_group": 8, "topk_group": 3}, ONE_EXPERT_GROUPS_REFUSAL),
    ("deepseek_v3", {"n_group": 5}, UNEVEN_GROUPS_REFUSAL),
    ("deepseek_v2", {"topk_group": 5}, KEPT_GROUPS_REFUSAL),
], ids=["deepseek_v2-grouped-kv", "deepseek_v3-grouped-kv", "qwen2-unset-window", "qwen3-unset-window",
        "smollm3-null-window", "qwen3_moe-top-k-past-experts", "deepseek_v3-one-expert-groups",
        "deepseek_v3-uneven-groups", "deepseek_v2-kept-groups-past-groups"])
def test_a_config_transformers_loads_but_cannot_run_is_refused_before_its_weights_load(arch, options, message,
                                                                                        tmp_path):
    from reinforge.engine.memory_plan import check_model_config

    config = tiny_config(arch, vocab_size=64, num_layers=2, **options)
    model = build_tiny_causal_lm(arch, vocab_size=64, num_layers=2, **options)
    for implementation in ("eager", "sdpa"):  # transformers' own forward fails, whichever attention it takes
        model.set_attn_implementation(implementation)
        with pytest.raises((RuntimeError, ValueError, TypeError)):
            model(input_ids=torch.tensor([[3, 4, 5, 6, 7, 8]]), attention_mask=torch.ones(1, 6, dtype=torch.long))
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as refused:
        check_model_config(str(tmp_path))  # preflight, RL and SFT: from config.json alone
    assert str(refused.value) == message
    with pytest.raises(ValueError) as refused:
        architecture_spec(config)  # a model built in Python
    assert str(refused.value) == message


@pytest.mark.parametrize(("arch", "options"), [
    ("deepseek_v3", {"num_key_value_heads": 3}),  # 4 // 3 = 1: transformers repeats nothing, its forward runs
    ("qwen2", {"layer_types": SLIDING_SECOND, "use_sliding_window": True, "sliding_window": 4}),
    ("smollm3", {"layer_types": ["full_attention"] * 2, "use_sliding_window": False, "sliding_window": None}),
])
def test_configs_near_those_transformers_cannot_run_are_described(arch, options, tmp_path):
    from reinforge.engine.memory_plan import check_model_config

    config = tiny_config(arch, vocab_size=64, num_layers=2, **options)
    config.save_pretrained(tmp_path)
    check_model_config(str(tmp_path))
    assert architecture_spec(config) is not None
    build_tiny_causal_lm(arch, vocab_size=64, num_layers=2, **options)(input_ids=torch.tensor([[3, 4, 5, 6, 7, 8]]))


def test_norms_projections_and_scales():
    gemma2 = architecture_spec(tiny_config("gemma2"))
    assert (gemma2.norm, gemma2.norm_placement, gemma2.activation) == ("gemma", "sandwich", "gelu_tanh")
    assert gemma2.embedding_scale == pytest.approx(8.0)
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (1.0, 2.0)
    olmo2 = architecture_spec(tiny_config("olmo2"))
    assert (olmo2.norm, olmo2.norm_placement, olmo2.qk_norm) == ("olmo", "post", "projection")
    phi3 = architecture_spec(tiny_config("phi3"))
    assert phi3.fused_qkv and phi3.fused_gate_up and phi3.partial_rotary_factor == 0.5
    assert architecture_spec(tiny_config("qwen3")).qk_norm == "head"
    assert architecture_spec(tiny_config("llama")).qk_norm is None


def test_gemma3_multimodal_config_reads_its_text_config():
    from transformers import Gemma3Config

    config = Gemma3Config(text_config=tiny_config("gemma3_text").to_dict())
    spec = architecture_spec(config)
    assert spec.model_type == "gemma3_text" and spec.norm == "gemma" and len(spec.layers) == 2


def test_other_model_types_have_no_table():
    assert architecture_spec(tiny_config("gpt_neox")) is None


def test_smollm3_reads_one_no_rope_entry_a_layer_and_a_list_short_of_the_layers_is_refused(tmp_path, capsys):
    """transformers reads ``no_rope_layers[i]`` for layer i: entries past the last layer go unread, and a list with
    fewer entries than layers builds no config (its ``layer_types`` are derived from it)."""
    import json

    from reinforge.cli import main
    from reinforge.engine.memory_plan import check_model_config

    model = build_tiny_causal_lm("smollm3", vocab_size=64, num_layers=2, no_rope_layers=[0, 1, 1, 0])
    spec = architecture_spec(model.config)
    assert [layer.rope for layer in spec.layers] == ["none", "global"]
    assert [bool(layer.self_attn.use_rope) for layer in model.model.layers] == [False, True]

    config = tiny_config("smollm3", vocab_size=64, num_layers=2).to_dict()
    config.pop("layer_types")
    (tmp_path / "config.json").write_text(json.dumps({**config, "no_rope_layers": [1]}))
    message = (f"model.path={tmp_path}: transformers cannot read its config.json (list index out of range); fix that "
               f"value in {tmp_path / 'config.json'}, or set model.path to another model")
    with pytest.raises(ValueError) as refused:
        check_model_config(str(tmp_path))  # train, SFT and preflight: before the model loads
    assert str(refused.value) == message
    assert main(["plan", f"model.path={tmp_path}", "--gpu-memory-gib", "80"]) == 2  # plan refuses it as train does
    assert capsys.readouterr().err.strip() == f"error: {message}"

    config["layer_types"] = ["full_attention"] * 2  # layer_types given: transformers builds it, the model fails
    (tmp_path / "config.json").write_text(json.dumps({**config, "no_rope_layers": [1]}))
    with pytest.raises(IndexError):
        build_tiny_causal_lm("smollm3", vocab_size=64, num_layers=2, no_rope_layers=[1],
                             layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError) as refused:
        check_model_config(str(tmp_path))
    assert str(refused.value) == (
        "smollm3 config (model.path's config.json) lists 1 entries in no_rope_layers for num_hidden_layers=2: "
        "transformers' SmolLM3 reads one a layer, so it fails building the layers past them; give one entry a layer "
        "(1: rotary positions, 0: none), or drop no_rope_layers to derive them from no_rope_layer_interval")
