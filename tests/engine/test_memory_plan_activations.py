"""The planner's per-token activations against the tensors one decoder layer really saves for its backward.

One layer at the bench shape's widths (small vocabulary), bfloat16 on the CPU, with the engine's fused norm
and MLP forwards and its packed attention layout; attention stands in for the CUDA kernels, which keep q, k,
v, the output and a float32 log-sum-exp. Every tensor autograd saves that is not a parameter is counted
once (by storage); the difference between two token counts gives bytes per token. The CPU's eager layer
saves more than CUDA's compiled one, so the planner's constants (fitted on the GPU for Qwen2.5) are checked
through that ratio: a family must get at least its measured bytes times Qwen2.5-1.5B's planned-to-measured
factor.
"""

from __future__ import annotations

import functools

import pytest
import torch

from reinforge.bench.shapes import SHAPES
from reinforge.engine import fused
from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.log_probs import linear_log_probs
from reinforge.engine.memory_plan import GiB, ModelShape, RunShape, Settings, estimate, micro_batch_split, plan_memory

STANDARD = RunShape(prompts=64, samples_per_prompt=8, prompt_length=128, response_length=512)
H200_BYTES = 139.8 * GiB


class _KernelAttention(torch.autograd.Function):
    """Saves what the flash and soft-cap varlen kernels save: q, k, v, the output and a float32 log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.zeros_like(q)
        ctx.save_for_backward(q, k, v, out, torch.zeros(q.shape[1], q.shape[0]))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _saved_bytes(layer: torch.nn.Module, model: torch.nn.Module, tokens: int) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    bounds = torch.tensor([0, tokens], dtype=torch.int32)
    packed = {"packed_cu_seqlens": bounds, "packed_max_length": tokens, "packed_cu_seqlens_k": bounds,
              "packed_max_length_k": tokens, "packed_kv_index": None}
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    handles = [layer.register_forward_pre_hook(lambda *args: hooks.__enter__()),
               layer.register_forward_hook(lambda *args: hooks.__exit__(None, None, None))]
    try:
        model.model(input_ids=ids, position_ids=torch.arange(tokens)[None], use_cache=False,
                    attention_mask={"full_attention": None, "sliding_attention": None}, **packed)
    finally:
        for handle in handles:
            handle.remove()
    return sum(saved.values())


@functools.cache
def measured_bytes_per_token(name: str) -> float:
    """Bytes one decoder layer of the ``name`` bench shape saves per token (bfloat16, the engine's forwards)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = dict(SHAPES[name].config)
    family = keys.pop("model_type")
    config = AutoConfig.for_model(family, **(keys | {"num_hidden_layers": 1, "vocab_size": 256}))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    use_varlen_attention(model)
    fused.fuse_elementwise(model, compile=False)
    assert fused.use_packed_attention_layout(model) == 1
    original = fused.packed_attention
    fused.packed_attention = lambda q, k, v, *args, **kwargs: _KernelAttention.apply(q, k, v)
    try:
        layer = model.model.layers[0]
        small, large = (_saved_bytes(layer, model, tokens) for tokens in (16, 48))
    finally:
        fused.packed_attention = original
    return (large - small) / 32


def planned_bytes_per_token(name: str) -> int:
    return ModelShape.from_hf_config(SHAPES[name].config).activation_bytes_per_token(2)


def _required(name: str) -> float:
    """The measured bytes of ``name`` scaled by Qwen2.5-1.5B's planned-to-measured factor (its constants' fit)."""
    return measured_bytes_per_token(name) * planned_bytes_per_token("1.5b") / measured_bytes_per_token("1.5b")


def test_gemma2_layer_activations_are_planned_at_least_as_measured():
    # Gemma 2 norms the attention's and the MLP's outputs too (four norms a layer, each keeping float32 values)
    assert planned_bytes_per_token("gemma2-2b") >= _required("gemma2-2b")


def test_gemma2_standard_workload_plan_covers_the_measured_activations():
    shape = ModelShape.from_hf_config(SHAPES["gemma2-2b"].config)
    plan = plan_memory(shape, STANDARD, {}, H200_BYTES, 120 * GiB)
    _, tokens = micro_batch_split(STANDARD, plan.settings.micro_batch_tokens)
    plain = shape.num_layers - plan.settings.checkpoint_layers
    assert plan.phases["update"]["activations"] >= tokens * plain * _required("gemma2-2b")
    # scaled to a 32k-token budget (29,568 tokens of whole prompt groups) the update does not fit without checkpointing
    _, budget_tokens = micro_batch_split(STANDARD, 32768)
    assert budget_tokens * shape.num_layers * _required("gemma2-2b") > 80 * GiB
    assert (plan.settings.micro_batch_tokens, plan.settings.checkpoint_layers) == (24576, 0)
    assert plan.peak[1] <= 0.9 * H200_BYTES


def test_head_gradient_is_counted_beside_the_kept_logits():
    shape = ModelShape.from_hf_config(SHAPES["gemma2-2b"].config)
    phases, _ = estimate(shape, STANDARD, Settings(micro_batch_tokens=24576))
    assert phases["update"]["head gradient"] == 256000 * 2304 * 2  # bf16, the size of the tied embedding
    chunked, _ = estimate(shape, STANDARD, Settings(micro_batch_tokens=24576, logits_buffer_gib=0.0))
    assert chunked["update"]["head gradient"] == 256000 * 2304 * 4  # accumulated in float32 chunk by chunk
    # what the backward of the fused log-probs really makes: a weight gradient of the weight's size
    hidden = torch.randn(8, 16, requires_grad=True)
    weight = torch.randn(64, 16, requires_grad=True)
    log_probs, _ = linear_log_probs(hidden, weight, torch.randint(0, 64, (8,)), softcap=30.0)
    log_probs.sum().backward()
    assert weight.grad.nbytes == 64 * 16 * weight.element_size()


def test_four_norm_families_are_read_from_the_config():
    assert ModelShape.from_hf_config(SHAPES["gemma2-2b"].config).norms_per_layer == 4
    assert ModelShape.from_hf_config(SHAPES["1.5b"].config).norms_per_layer == 2


@pytest.mark.parametrize("gpu_gib", [139.8, 80.0])
def test_qwen25_standard_workload_settings_are_unchanged(gpu_gib):
    expected = {  # (micro-batch tokens, checkpointed layers, logits buffer GiB) per size
        139.8: {"0.5b": (65536, 0, 24.0), "1.5b": (49152, 0, 24.0), "3b": (24576, 0, 24.0), "7b": (16384, 28, 24.0)},
        80.0: {"0.5b": (49152, 0, 24.0), "1.5b": (24576, 0, 24.0), "3b": (49152, 36, 24.0), "7b": (16384, 28, 24.0)},
    }[gpu_gib]
    for name, settings in expected.items():
        plan = plan_memory(ModelShape.from_hf_config(SHAPES[name].config), STANDARD, {}, gpu_gib * GiB, 120 * GiB)
        assert (plan.settings.micro_batch_tokens, plan.settings.checkpoint_layers,
                plan.settings.logits_buffer_gib) == settings, name


def _cuda_bytes_per_token(name: str) -> float:
    """Device bytes a packed forward with grad keeps per token and decoder layer on the CUDA fast path (compiled
    layers, fused norms and MLP, the soft-cap kernel where the family has one): 8k tokens against 4k, three layers
    against one (what the embedding and the final norm keep cancels)."""
    import torch._dynamo
    from transformers import AutoConfig, AutoModelForCausalLM

    from reinforge.engine.forward import _attention_kwargs
    from reinforge.engine.fused import prepare_for_training
    from reinforge.engine.packing import PackedRows

    torch._dynamo.reset()
    device = torch.device("cuda")
    keys = dict(SHAPES[name].config)
    family = keys.pop("model_type")
    config = AutoConfig.for_model(family, **(keys | {"num_hidden_layers": 3, "vocab_size": 256}))
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).to(device, torch.bfloat16)
    prepare_for_training(model, device)
    layers = model.model.layers
    empty = torch.empty(0, dtype=torch.long, device=device)

    def kept(tokens: int, num_layers: int) -> int:
        model.model.layers, model.config.num_hidden_layers = torch.nn.ModuleList(layers[:num_layers]), num_layers
        lengths = [1024] * (tokens // 1024)
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        packed = PackedRows(input_ids=torch.randint(0, 256, (1, tokens), device=device),
                            position_ids=torch.arange(1024, device=device).repeat(len(lengths))[None],
                            cu_seqlens=bounds, max_length=1024, cu_seqlens_k=bounds, max_key_length=1024,
                            kv_index=None, lengths=lengths, key_lengths=lengths, predictor_index=empty,
                            response_targets=empty, response_index=empty, response_shape=(0, 0), last_index=empty)
        kwargs = _attention_kwargs(packed, torch.bfloat16, model.config)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                          attention_mask={"full_attention": None, "sliding_attention": None}, **kwargs)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        del out
        return held

    kept(4096, 3), kept(8192, 3)  # compile first
    per_token = [(kept(8192, count) - kept(4096, count)) / 4096 for count in (3, 1)]
    return (per_token[0] - per_token[1]) / 2


@pytest.mark.gpu
@pytest.mark.slow
def test_gemma2_compiled_layer_activations_fit_the_plan_on_the_gpu():
    gemma, qwen = _cuda_bytes_per_token("gemma2-2b"), _cuda_bytes_per_token("1.5b")
    print(f"bytes per token and layer on CUDA: gemma2-2b {gemma:.0f} (planned {planned_bytes_per_token('gemma2-2b')}), "
          f"1.5b {qwen:.0f} (planned {planned_bytes_per_token('1.5b')})")
    assert planned_bytes_per_token("gemma2-2b") >= gemma
    assert planned_bytes_per_token("gemma2-2b") / planned_bytes_per_token("1.5b") >= gemma / qwen
