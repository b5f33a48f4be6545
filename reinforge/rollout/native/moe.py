"""Mixture-of-experts layers of the native engine: the router as transformers computes it, the experts as
grouped GEMMs.

One function routes every family of ``models.architectures`` from its ``MoESpec``: softmax or sigmoid
scores, DeepSeek's group-limited selection (the group's best score for V2, the sum of its two best for
V3, V3's correction bias counted for the choice only), top-k renormalisation, the routed scaling
factor and the dtype the weights are cast to, each exactly as transformers' router modules do it (the
same ``topk`` calls, so ties pick the same experts). The router's logits are computed in the model
dtype, or in float32 from a float32 copy of the router for DeepSeek, whose routers keep their weight
and logits in float32. On the GPU path, a softmax router without groups (Qwen3-MoE, OLMoE, Mixtral)
runs everything after its logits as one Triton kernel (``moe_kernels.softmax_topk``: the same float32
softmax, the same experts, a tied k-th score going to the lower expert as in torch's ``topk``).

The experts follow transformers' ``grouped_mm`` path: the (token, expert) assignments are sorted by
expert, the fused gate|up and the down products run as one grouped GEMM each over the whole sorted
batch (``offsets`` int32 cumulative ends, counted with ``histc``), each output row is scaled by its
routing weight, put back in token order and summed over the k experts of its token. Nothing waits for
the host, so a decode step's CUDA graph captures it. A decode step's few rows per expert make the products
bound by reading each expert's weights once; there the Triton kernels of ``moe_kernels.py`` (the swapped
products, which also gather, activate, weight and put back the rows) run where they were timed faster than
torch's. Grouped GEMMs run on CUDA in bf16; elsewhere (the
CPU, float32) each assignment's expert weights are gathered and applied with one batched product, which
is what the tests compare with transformers in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reinforge.models.architectures import LayerSpec, MoESpec
from reinforge.rollout.native.layers import BlockContext, concatenated

if TYPE_CHECKING:
    from reinforge.rollout.native.moe_choice import ExpertKernelChoice


def deepseek_router(model_type: str) -> bool:
    """Whether the family routes as DeepSeek's routers do: logits in float32 from a float32 gate weight, and
    ``topk(sorted=False)`` (Qwen3-MoE, OLMoE and Mixtral compute logits in the model dtype and sort)."""
    return model_type in ("deepseek_v2", "deepseek_v3")


def fused_router_applies(spec: MoESpec, deepseek: bool) -> bool:
    """Whether ``moe_kernels.softmax_topk`` computes the router's choice: softmax scores, a plain top-k (no groups, no
    correction bias) and sorted, as Qwen3-MoE, OLMoE and Mixtral route."""
    from reinforge.rollout.native.moe_kernels import MAX_ROUTED_EXPERTS

    return (spec.scoring == "softmax" and spec.group_score is None and not spec.correction_bias and not deepseek
            and spec.num_experts <= MAX_ROUTED_EXPERTS)


@torch.no_grad()
def route(hidden: Tensor, router: Tensor, correction_bias: Tensor | None, spec: MoESpec,
          deepseek: bool, fused: bool = False) -> tuple[Tensor, Tensor]:
    """The experts each token is sent to and their weights, as transformers' router for ``spec`` computes them.

    hidden: (tokens, hidden); router: (experts, hidden); correction_bias: (experts,) or None; ``deepseek``:
    see ``deepseek_router``; ``fused``: everything after the logits in one Triton kernel (``softmax_topk``; only
    where ``fused_router_applies``).
    Returns weights (tokens, top_k), float32 or the logits' dtype (``spec.weights_dtype``), and expert ids
    (tokens, top_k) int64.
    """
    if deepseek:
        logits = F.linear(hidden.float(), router.float())
    else:
        logits = F.linear(hidden, router)
    if fused:
        from reinforge.rollout.native.moe_kernels import softmax_topk

        return softmax_topk(logits, spec.top_k, spec.norm_topk_prob, spec.routed_scaling_factor,
                            logits.dtype if spec.weights_dtype == "logits" else torch.float32)
    if spec.scoring == "softmax":
        scores = logits.softmax(dim=-1, dtype=torch.float32)
    elif spec.scoring == "sigmoid":
        scores = logits.float().sigmoid()
    else:
        raise ValueError(f"MoE scoring {spec.scoring!r} is not 'softmax' or 'sigmoid'")
    choice = scores if correction_bias is None else scores + correction_bias
    if spec.group_score is None:
        if spec.correction_bias:
            expert_ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, expert_ids)
        else:
            weights, expert_ids = torch.topk(choice, spec.top_k, dim=-1, sorted=not deepseek)
    else:
        weights, expert_ids = _group_limited_topk(scores, choice, spec)
    if spec.norm_topk_prob:
        denominator = weights.sum(dim=-1, keepdim=True)
        weights = weights / (denominator + 1e-20 if spec.scoring == "sigmoid" else denominator)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    if spec.weights_dtype == "logits":
        weights = weights.to(logits.dtype)
    return weights, expert_ids


def _group_limited_topk(scores: Tensor, choice: Tensor, spec: MoESpec) -> tuple[Tensor, Tensor]:
    """DeepSeek's selection inside the ``topk_group`` best of ``n_group`` expert groups.

    V2 (group score "max"): a group's score is its best expert's, experts outside the kept groups score 0
    and the weights are the selected (masked) scores. V3 ("top2_sum"): the sum of its two best, excluded
    experts score -inf, and the weights are the unbiased scores of the selected experts.
    """
    num_tokens, num_experts = choice.shape
    if spec.n_group is None or spec.topk_group is None:
        raise ValueError(f"group_score={spec.group_score!r} needs n_group and topk_group; the MoE spec has neither")
    grouped = choice.view(num_tokens, spec.n_group, num_experts // spec.n_group)
    if spec.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    elif spec.group_score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        raise ValueError(f"MoE group_score {spec.group_score!r} is not 'max' or 'top2_sum'")
    group_ids = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, num_experts // spec.n_group).reshape(num_tokens, -1)
    if spec.group_score == "max":
        weights, expert_ids = torch.topk(choice.masked_fill(~expert_mask.bool(), 0.0), k=spec.top_k, dim=-1,
                                         sorted=False)
        return weights, expert_ids
    expert_ids = torch.topk(choice.masked_fill(~expert_mask.bool(), float("-inf")), k=spec.top_k, dim=-1,
                            sorted=False)[1]
    return scores.gather(1, expert_ids), expert_ids


def grouped_mm_applies(hidden: Tensor) -> bool:
    """Whether the experts run as grouped GEMMs: on CUDA in bf16, where torch has the kernel."""
    return hidden.is_cuda and hidden.dtype == torch.bfloat16 and _grouped_mm is not None


_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
"""torch >= 2.10 has ``F.grouped_mm``; 2.9 only ``torch._grouped_mm`` (same arguments)."""


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up: (rows, 2 * inter), gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def experts_forward(hidden: Tensor, expert_ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                    grouped: bool | None = None, activate: Callable[[Tensor], Tensor] = silu_and_mul,
                    kernels: ExpertKernelChoice | None = None) -> Tensor:
    """sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's k experts e, in ``hidden``'s dtype.

    hidden: (tokens, hidden); expert_ids, weights: (tokens, top_k); gate_up: (experts, 2 * inter, hidden),
    gate rows first; down: (experts, hidden, inter). ``grouped`` (default: ``grouped_mm_applies``) runs the
    two products as grouped GEMMs over the assignments sorted by expert; otherwise each assignment's
    weights are gathered (memory grows with tokens * top_k: the CPU and test path). ``activate`` turns the
    (assignments, 2 * inter) gate|up products into (assignments, inter) (the Triton kernel on the GPU path).
    ``kernels``: on the grouped path, picks torch's grouped GEMMs or the Triton kernels of ``moe_kernels`` per
    shape (the swapped ones compute silu: ``MoEMLP`` passes it only for silu experts).
    """
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    flat_weights = weights.reshape(-1)
    if grouped is None:
        grouped = grouped_mm_applies(hidden)
    if grouped:
        def tiled(ids: Tensor, matmul: Callable[[Tensor, Tensor, Tensor], Tensor] | None) -> Tensor:
            sorted_ids, order = torch.sort(ids)
            return grouped_experts(hidden, sorted_ids, order, flat_weights, gate_up, down, top_k, activate, matmul)

        if kernels is None:
            per_assignment = tiled(flat_ids, None)
        else:
            per_assignment = kernels(hidden, flat_ids, flat_weights, gate_up, down, tiled)
    else:
        tokens = hidden.repeat_interleave(top_k, dim=0).unsqueeze(1)  # (tokens * top_k, 1, hidden)
        activated = activate(torch.bmm(tokens, gate_up[flat_ids].transpose(1, 2)).squeeze(1))
        out = torch.bmm(activated.unsqueeze(1), down[flat_ids].transpose(1, 2)).squeeze(1)
        per_assignment = out * flat_weights.unsqueeze(-1)
    return per_assignment.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def grouped_experts(hidden: Tensor, sorted_ids: Tensor, order: Tensor, routing: Tensor, gate_up: Tensor,
                    down: Tensor, top_k: int, activate: Callable[[Tensor], Tensor] = silu_and_mul,
                    matmul: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None) -> Tensor:
    """Every assignment's weighted expert output, (assignments, hidden) in assignment order, as two grouped GEMMs.

    sorted_ids, order: the flat expert ids sorted and the assignment (token * top_k + slot) at each sorted position;
    routing: (assignments,) the routing weights in assignment order. The rows are gathered in sorted order,
    ``activate`` runs between the products, each row is scaled by its routing weight and put back in assignment
    order. ``matmul(rows, weight, bounds)`` runs each product (bounds: (experts + 1,) int32, 0 then each expert's
    cumulative end); None runs torch's grouped GEMM.
    """
    num_experts = gate_up.shape[0]
    tokens = hidden.index_select(0, order // top_k)
    counted = sorted_ids.float() if sorted_ids.device.type == "cpu" else sorted_ids.int()  # histc: floats on CPU
    offsets = torch.cumsum(torch.histc(counted, bins=num_experts, min=0, max=num_experts - 1), dim=0,
                           dtype=torch.int32)
    if matmul is None:
        def product(rows: Tensor, weight: Tensor) -> Tensor:  # rows @ weight[e]^T, expert by expert
            return _grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    else:
        bounds = F.pad(offsets, (1, 0))

        def product(rows: Tensor, weight: Tensor) -> Tensor:
            return matmul(rows.contiguous(), weight, bounds)

    out = product(activate(product(tokens, gate_up)), down)
    out = out * routing.index_select(0, order).unsqueeze(-1)
    return torch.empty_like(out).index_copy_(0, order, out)


_EXPERT_KERNELS: list[ExpertKernelChoice] = []


def expert_kernel_choice() -> ExpertKernelChoice:
    """The one ``moe_choice.ExpertKernelChoice`` of the process: every layer and engine shares its timings."""
    if not _EXPERT_KERNELS:
        from reinforge.rollout.native.moe_choice import ExpertKernelChoice

        _EXPERT_KERNELS.append(ExpertKernelChoice())
    return _EXPERT_KERNELS[0]


def moe_unsupported_reason(config, spec: MoESpec, layers: nn.ModuleList) -> str | None:
    """Why the native engine cannot run these MoE layers, or None when it can."""
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"its experts use hidden_act={config.hidden_act!r}; the engine's experts implement silu"
    if spec.n_group is not None and spec.num_experts % spec.n_group:
        return f"its {spec.num_experts} experts do not split into n_group={spec.n_group} groups"
    for layer in layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and hasattr(experts, "base_layer"):
            return (f"its experts carry adapters ({type(experts).__name__}), which the engine's weight copy does not "
                    "merge; adapt the attention projections only")
        if experts is not None and (getattr(experts, "has_bias", False) or not hasattr(experts, "gate_up_proj")):
            return f"its experts module {type(experts).__name__} is not fused gate|up and down without biases"
    return None


class MoEMLP:
    """A layer's mixture of experts as an MLP block of the decoder (see ``layers.py``): routed experts, plus
    DeepSeek's shared experts as one dense MLP added to them.

    Copies: router (experts, hidden), float32 for DeepSeek; correction_bias (experts,) float32 (DeepSeek V3) or
    None; experts_gate_up (experts, 2 * inter, hidden), gate rows first; experts_down (experts, hidden, inter);
    shared_gate_up (2 * shared inter, hidden) and shared_down (hidden, shared inter), or None. transformers 5
    stores the experts fused in this layout; an experts module marked ``is_transposed`` stores
    (experts, hidden, 2 * inter) and (experts, inter, hidden), read through transposed views.
    """

    def __init__(self, context: BlockContext, layer: LayerSpec):
        spec = context.spec
        if spec.moe is None or not layer.moe:
            raise ValueError(f"{spec.model_type}: MoEMLP runs a mixture-of-experts layer; this one is dense")
        self.spec = spec.moe
        self.deepseek = deepseek_router(spec.model_type)
        self.float32_copies = frozenset({"router", "correction_bias"} if self.deepseek else {"correction_bias"})
        self.activate = silu_and_mul
        self.kernels: ExpertKernelChoice | None = None
        self.fused_router = context.use_triton and fused_router_applies(self.spec, self.deepseek)
        if context.use_triton:
            from reinforge.rollout.native import triton_kernels

            self.activate = triton_kernels.act_and_mul  # silu by default
            self.kernels = expert_kernel_choice()

    def sources(self, block: nn.Module) -> dict[str, list[Tensor] | None]:
        experts, gate = block.experts, block.gate
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if getattr(experts, "is_transposed", False):
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        bias = getattr(gate, "e_score_correction_bias", None)
        shared = getattr(block, "shared_experts", None)
        return {"router": [gate.weight], "correction_bias": None if bias is None else [bias],
                "experts_gate_up": [gate_up], "experts_down": [down],
                "shared_gate_up": None if shared is None else [shared.gate_proj.weight, shared.up_proj.weight],
                "shared_down": None if shared is None else [shared.down_proj.weight],
                # DeepSeek's mlp_bias: the shared experts' linears carry biases
                "shared_gate_up_bias": None if shared is None else concatenated((shared.gate_proj, shared.up_proj))[1],
                "shared_down_bias": None if shared is None or shared.down_proj.bias is None
                else [shared.down_proj.bias]}

    def forward(self, weights: dict[str, Tensor | None], x: Tensor, decode: bool = False) -> Tensor:
        """x: (tokens, hidden) -> (tokens, hidden) in x's dtype (the experts' kernels go by the rows, not
        ``decode``)."""
        routing_weights, expert_ids = route(x, weights["router"], weights["correction_bias"], self.spec,
                                            self.deepseek, self.fused_router)
        out = experts_forward(x, expert_ids, routing_weights, weights["experts_gate_up"], weights["experts_down"],
                              activate=self.activate, kernels=self.kernels)
        if weights["shared_gate_up"] is not None:
            out = out + F.linear(self.activate(F.linear(x, weights["shared_gate_up"], weights["shared_gate_up_bias"])),
                                 weights["shared_down"], weights["shared_down_bias"])
        return out
