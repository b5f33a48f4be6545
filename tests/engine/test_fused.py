import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.forward import build_position_ids, response_log_probs
from reinforge.engine.fused import compile_decoder_layers, fuse_elementwise, use_packed_attention_layout
from reinforge.protocol import Batch

SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.mark.parametrize("config_class,model_class,expected", [
    (Qwen2Config, Qwen2ForCausalLM, 2 * 3 + 1),  # per layer: 2 norms + 1 MLP; then the final norm
    (Qwen3Config, Qwen3ForCausalLM, 2 * 5 + 1),  # Qwen3 adds the q/k norms
    (LlamaConfig, LlamaForCausalLM, 2 * 3 + 1),
])
def test_fused_forwards_match_the_transformers_modules(config_class, model_class, expected):
    torch.manual_seed(0)
    reference = model_class(config_class(**SIZES))
    with torch.no_grad():  # non-trivial norm weights, so a wrong weight placement would show
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    fused = model_class(config_class(**SIZES))
    fused.load_state_dict(reference.state_dict())
    assert fuse_elementwise(fused, compile=False) == expected
    input_ids = torch.randint(0, SIZES["vocab_size"], (2, 11))
    out_reference = reference(input_ids=input_ids).logits
    out_fused = fused(input_ids=input_ids).logits
    torch.testing.assert_close(out_fused, out_reference, rtol=1e-5, atol=1e-5)
    out_reference.square().mean().backward()
    out_fused.square().mean().backward()
    for (name, a), (_, b) in zip(reference.named_parameters(), fused.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bfloat16_norm_casts_back_before_the_weight():
    torch.manual_seed(0)
    reference = Qwen2ForCausalLM(Qwen2Config(**SIZES)).to(torch.bfloat16)
    norm = reference.model.norm
    hidden = torch.randn(3, 5, SIZES["hidden_size"], dtype=torch.bfloat16)
    expected = norm(hidden)
    fuse_elementwise(reference, compile=False)
    assert torch.equal(norm(hidden), expected)


def test_a_model_outside_the_table_keeps_transformers_modules_with_varlen_attention():
    from transformers import GPT2Config, GPT2LMHeadModel

    from reinforge.engine.attention import NAME
    from reinforge.engine.fused import prepare_for_training

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    prepare_for_training(model, torch.device("cpu"))
    assert model.config._attn_implementation == NAME
    assert fuse_elementwise(model, compile=False) == 0 and use_packed_attention_layout(model) == 0
    assert all("forward" not in vars(module) for module in model.modules())


def test_only_the_architectures_own_classes_are_swapped():
    """A Qwen2 model holding a Llama RMSNorm: only the Qwen2 modules get the fused forward."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = Qwen2ForCausalLM(Qwen2Config(**SIZES))
    model.model.extra_norm = LlamaRMSNorm(SIZES["hidden_size"])
    assert fuse_elementwise(model, compile=False) == 2 * 3 + 1
    assert "forward" not in vars(model.model.extra_norm)




def rollout_rows(rows: int, prompt_width: int, response_width: int, left_padding: dict[int, int] | None = None,
                 right_padding: dict[int, int] | None = None) -> Batch:
    """Random [prompt | response] rows; ``left_padding``/``right_padding``: row -> padded columns."""
    prompts = torch.randint(1, 90, (rows, prompt_width))
    responses = torch.randint(1, 90, (rows, response_width))
    attention_mask = torch.ones(rows, prompt_width + response_width, dtype=torch.long)
    for row, width in (left_padding or {}).items():
        attention_mask[row, :width] = 0
    for row, width in (right_padding or {}).items():
        attention_mask[row, -width:] = 0
    return Batch.from_dict(tensors={"prompts": prompts, "responses": responses, "input_ids": torch.cat(
        [prompts, responses], 1), "attention_mask": attention_mask, "position_ids": build_position_ids(attention_mask)})


def log_probs_and_grads(model, batch: Batch, temperature: float = 1.0, entropy_weight: float = 0.0):
    """Packed response log-probs of ``model`` and the gradients of their sum (plus weighted entropy)."""
    log_probs, entropy = response_log_probs(model, batch, temperature=temperature, with_entropy=True)
    (log_probs.sum() + entropy_weight * entropy.sum()).backward()
    return log_probs.detach(), [parameter.grad for parameter in model.parameters()]


@pytest.mark.slow
def test_compiled_decoder_layers_match_eager_in_packed_passes_and_leave_generation_eager():
    import copy

    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Qwen2ForCausalLM(Qwen2Config(**{**SIZES, "num_hidden_layers": 1}))
    use_varlen_attention(eager)
    compiled = copy.deepcopy(eager)
    # aot_eager: the same tracing and autograd split as inductor, runnable without a GPU
    assert compile_decoder_layers(compiled, backend="aot_eager") == 1
    import torch.fx.experimental._config

    # no duck sizing: a packed_kv_index as long as the hidden size recompiled every layer on the H200
    assert torch.fx.experimental._config.use_duck_shape is False
    batch = rollout_rows(4, 5, 6, left_padding={1: 2}, right_padding={2: 3})
    outputs = [log_probs_and_grads(model, batch) for model in (eager, compiled)]
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=0, atol=0)
    for grad_compiled, grad_eager in zip(outputs[1][1], outputs[0][1], strict=True):
        torch.testing.assert_close(grad_compiled, grad_eager, rtol=0, atol=0)
    # the layer is one graph: no graph break (the padded attention's packing and unpacking index by positions
    # computed from the lengths, not by a boolean mask, whose data-dependent size split the layer's graph)
    assert not torch._dynamo.utils.counters["graph_break"]
    counters = dict(torch._dynamo.utils.counters["frames"])
    assert counters.get("ok", 0) >= 1
    # generation (a KV cache, no packed rows) runs the eager forward: nothing new is compiled
    with torch.no_grad():
        compiled.generate(batch["prompts"], max_new_tokens=3, do_sample=False)
    assert dict(torch._dynamo.utils.counters["frames"]) == counters


@pytest.mark.slow
def test_compiled_layers_alike_share_one_graph_per_grad_mode_and_windowed_layers_one_more():
    """Dynamo compiles one graph per distinct layer, not per layer: a 4-layer Qwen2 whose last two layers have a
    sliding window compiles two graphs for a pass with grad and two without, and gives what eager does."""
    import copy

    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = Qwen2Config(**{**SIZES, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 4,
                            "max_window_layers": 2})
    eager = Qwen2ForCausalLM(config)
    use_varlen_attention(eager)
    assert use_packed_attention_layout(eager) == 4
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled, backend="eager") == 4
    batch = rollout_rows(3, 5, 6, left_padding={1: 2})
    outputs = [log_probs_and_grads(model, batch) for model in (eager, compiled)]
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=0, atol=0)
    with torch.no_grad():
        scored = response_log_probs(compiled, batch)[0]
    torch.testing.assert_close(scored, outputs[0][0], rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 4  # (full, windowed) x (grad, no grad)


@pytest.mark.parametrize("config_class,model_class", [(Qwen2Config, Qwen2ForCausalLM), (Qwen3Config, Qwen3ForCausalLM),
                                                      (LlamaConfig, LlamaForCausalLM)])
def test_packed_attention_layout_matches_transformers_and_leaves_generation_alone(config_class, model_class):
    import copy

    torch.manual_seed(0)
    reference = model_class(config_class(**SIZES, attention_bias=model_class is not Qwen3ForCausalLM))
    with torch.no_grad():  # non-trivial q/k norm weights (Qwen3)
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    use_varlen_attention(reference)
    swapped = copy.deepcopy(reference)
    assert use_packed_attention_layout(swapped) == SIZES["num_hidden_layers"]
    batch = rollout_rows(3, 5, 6, left_padding={1: 2}, right_padding={2: 2})
    outputs = [log_probs_and_grads(model, batch, temperature=0.8, entropy_weight=0.3) for model in (reference, swapped)]
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=1e-6, atol=1e-6)
    for grad_swapped, grad_reference in zip(outputs[1][1], outputs[0][1], strict=True):
        torch.testing.assert_close(grad_swapped, grad_reference, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # generation (a KV cache, no packed row) takes transformers' own forward
        expected = reference.generate(batch["prompts"], max_new_tokens=4, do_sample=False)
        assert torch.equal(swapped.generate(batch["prompts"], max_new_tokens=4, do_sample=False), expected)


@pytest.mark.gpu
def test_packed_attention_layout_on_the_gpu_matches_the_transposed_path():
    import copy

    torch.manual_seed(0)
    reference = Qwen2ForCausalLM(Qwen2Config(**SIZES)).to("cuda", torch.bfloat16)
    use_varlen_attention(reference)
    swapped = copy.deepcopy(reference)
    use_packed_attention_layout(swapped)
    batch = rollout_rows(4, 7, 9).to("cuda")
    with torch.no_grad():
        expected, got = (response_log_probs(model, batch)[0] for model in (reference, swapped))
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
