"""The native engine's MoE layers and MLA attention compute what transformers' modules compute.

Routers are compared with transformers' router modules on scores chosen by hand (tied experts, a group
that wins only through V3's correction bias), the MoE block with transformers' block in float32, the
grouped-GEMM experts with the gathered ones, and MLA's compressed-cache attention (prefill, decode in
the latent space, a prefix-cache hit) with transformers' attention module.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reinforge.models.architectures import architecture_spec
from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.rollout.native.mla import MLAAttention, mla_rotary_tables
from reinforge.rollout.native.moe import MoEMLP, deepseek_router, experts_forward, route

MOE_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3"]


def block_context(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    """What the decoder's blocks read of their decoder: the table, the config and the dtype."""
    return SimpleNamespace(spec=architecture_spec(model.config), config=model.config, dtype=dtype, use_triton=False)


def copies(block, module: torch.nn.Module, dtype: torch.dtype, device: str = "cpu") -> dict:
    """The block's weight copies, made as the decoder makes them (its float32 copies kept in float32)."""
    return {name: None if parts is None else torch.cat(
        [part.detach().to(device, torch.float32 if name in block.float32_copies else dtype) for part in parts])
        for name, parts in block.sources(module).items()}


def moe_block(model: torch.nn.Module):
    """The last layer's sparse-MoE module (DeepSeek's first layer is dense)."""
    return model.model.layers[-1].mlp


def assert_same_routing(expected: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor]):
    """Same experts per token and the same weight for each (the order within a token may differ)."""
    expected_weights, expected_ids = expected
    got_weights, got_ids = got
    expected_order, got_order = expected_ids.sort(dim=-1), got_ids.sort(dim=-1)
    assert torch.equal(expected_order.values, got_order.values)
    assert got_weights.dtype == expected_weights.dtype
    torch.testing.assert_close(got_weights.gather(1, got_order.indices),
                               expected_weights.gather(1, expected_order.indices), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_matches_transformers_on_random_scores(family, dtype):
    """Top-3 of random scores; in bf16 the weights' dtype too (bf16 for Qwen3-MoE and OLMoE, float32 else)."""
    model = build_tiny_causal_lm(family, seed=1, num_experts_per_tok=3).to(dtype)
    spec = architecture_spec(model.config).moe
    gate = moe_block(model).gate
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_(0, 0.5)
        if spec.correction_bias:
            gate.e_score_correction_bias.normal_(0, 0.5)
    hidden = torch.randn(32, model.config.hidden_size, dtype=dtype)
    _, expected_weights, expected_ids = gate(hidden)
    got = route(hidden, gate.weight, getattr(gate, "e_score_correction_bias", None), spec,
                deepseek_router(model.config.model_type))
    assert_same_routing((expected_weights, expected_ids), got)


def router_with_scores(model: torch.nn.Module, rows: list[list[float]]) -> tuple[torch.nn.Module, torch.Tensor]:
    """The MoE gate of ``model`` made to score expert e of token t as ``rows[t][e]`` (logits: the gate weight is the
    identity on the first hidden dims, so each token's hidden state is its row of logits)."""
    gate = moe_block(model).gate
    num_experts, hidden_size = gate.weight.shape
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[:, :num_experts] = torch.eye(num_experts)
    hidden = torch.zeros(len(rows), hidden_size)
    hidden[:, :num_experts] = torch.tensor(rows)
    return gate, hidden


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_ties_pick_the_experts_transformers_picks(family):
    model = build_tiny_causal_lm(family, seed=2)
    spec = architecture_spec(model.config).moe
    num_experts = spec.num_experts
    # every expert tied; two tied at the top; a tie across the top-k boundary
    rows = [[0.0] * num_experts, [1.0, 2.0, 2.0] + [0.0] * (num_experts - 3),
            [3.0, 1.0, 1.0, 1.0] + [-1.0] * (num_experts - 4)]
    gate, hidden = router_with_scores(model, rows)
    _, expected_weights, expected_ids = gate(hidden)
    got = route(hidden, gate.weight, getattr(gate, "e_score_correction_bias", None), spec,
                deepseek_router(model.config.model_type))
    assert_same_routing((expected_weights, expected_ids), got)


FUSED_ROUTER_FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]
"""The softmax routers without groups, whose choice the GPU path computes in one Triton kernel."""


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", FUSED_ROUTER_FAMILIES)
def test_the_fused_router_kernel_routes_as_transformers(family, dtype):
    """``moe_kernels.softmax_topk`` (Triton's interpreter on the CPU; bf16 casts on the GPU only) against
    transformers' gate on random scores, top-3, more tokens than one program holds; each token's experts come
    sorted by weight."""
    pytest.importorskip("triton")
    from reinforge.rollout.native.moe import fused_router_applies

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_tiny_causal_lm(family, seed=1, num_experts_per_tok=3).to(dtype)
    spec = architecture_spec(model.config).moe
    assert fused_router_applies(spec, deepseek_router(model.config.model_type))
    gate = moe_block(model).gate
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_(0, 0.5)
    hidden = torch.randn(37, model.config.hidden_size, dtype=dtype)
    _, expected_weights, expected_ids = gate(hidden)
    weights, ids = route(hidden.to(device), gate.weight.to(device), None, spec, False, fused=True)
    assert_same_routing((expected_weights, expected_ids), (weights.cpu(), ids.cpu()))
    assert torch.equal(weights, weights.sort(dim=-1, descending=True).values)


@pytest.mark.parametrize("family", FUSED_ROUTER_FAMILIES)
def test_the_fused_router_gives_a_tied_kth_score_to_the_lower_experts(family):
    """Scores tied across the top-k boundary go to the lowest expert ids, as CUDA's ``topk`` keeps them (it
    gathers the scores above the k-th, then the k-th's ties in index order); the CPU ``topk`` may keep others."""
    pytest.importorskip("triton")
    model = build_tiny_causal_lm(family, seed=2)
    spec = architecture_spec(model.config).moe
    num_experts, top_k = spec.num_experts, spec.top_k
    rows = [[0.0] * num_experts, [1.0] + [2.0] * (num_experts - 1), [-1.0] * (num_experts - 3) + [3.0, 1.0, 1.0]]
    gate, hidden = router_with_scores(model, rows)
    _, expected_weights, _ = gate(hidden)
    expected_ids = torch.tensor([list(range(top_k)), list(range(1, top_k + 1)),
                                 [num_experts - 3] + list(range(top_k - 1))])
    if top_k > 1:  # the third row: the 3.0, then the tie of -1.0s or 1.0s at the boundary
        expected_ids[2, 1:] = torch.tensor([num_experts - 2, num_experts - 1][:top_k - 1]
                                           + list(range(max(top_k - 3, 0))))
    weights, ids = route(hidden, gate.weight, None, spec, False, fused=True)
    assert torch.equal(ids.sort(dim=-1).values, expected_ids.sort(dim=-1).values)
    torch.testing.assert_close(weights, expected_weights.sort(dim=-1, descending=True).values)


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts", [64, 128])
def test_the_fused_router_keeps_the_experts_cuda_topk_keeps_on_tied_bf16_logits(num_experts):
    """bf16 logits on a coarse grid (ties at the top-k boundary in most rows): the kernel's experts are the ones
    torch.topk on CUDA keeps from the float32 softmax, what transformers' routers run in training."""
    from reinforge.rollout.native.moe_kernels import softmax_topk

    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(4096, num_experts, device="cuda", generator=generator) * 4).round().div(4).bfloat16()
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    expected_weights, expected_ids = torch.topk(probs, 8, dim=-1)
    expected_weights = (expected_weights / expected_weights.sum(dim=-1, keepdim=True)).bfloat16()
    weights, ids = softmax_topk(logits, 8, True, weights_dtype=torch.bfloat16)
    assert torch.equal(ids.sort(dim=-1).values, expected_ids.sort(dim=-1).values)
    torch.testing.assert_close(weights.float(), expected_weights.float(), atol=0, rtol=2 ** -8)


@pytest.mark.parametrize(("top_k", "normalize", "scaling"), [(1, False, 1.0), (3, False, 2.5), (10, True, 0.5)])
def test_the_fused_router_kernel_scales_and_renormalises_as_torch(top_k, normalize, scaling):
    """One expert, unnormalised scores times a scaling factor, every expert picked: a ragged expert count (10)."""
    pytest.importorskip("triton")
    from reinforge.rollout.native.moe_kernels import softmax_topk

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(19, 10, generator=torch.Generator().manual_seed(3))
    expected_weights, expected_ids = torch.topk(logits.softmax(dim=-1, dtype=torch.float32), top_k, dim=-1)
    if normalize:
        expected_weights = expected_weights / expected_weights.sum(dim=-1, keepdim=True)
    weights, ids = softmax_topk(logits.to(device), top_k, normalize, scaling)
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights * scaling)


def test_the_fused_router_refuses_more_experts_than_it_holds_in_one_line():
    pytest.importorskip("triton")
    from reinforge.rollout.native.moe_kernels import MAX_ROUTED_EXPERTS, softmax_topk

    with pytest.raises(ValueError, match=f"at most {MAX_ROUTED_EXPERTS} experts"):
        softmax_topk(torch.zeros(2, MAX_ROUTED_EXPERTS + 1), 2, True)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_group_limited_routing_keeps_the_best_groups(family):
    """8 experts in 4 groups of 2, 2 groups kept. Token 0: the single best expert (6) lifts its group (V2 keeps
    groups by their best score) though group 1 has the best pair (V3 sums the best two). Token 1: V3's correction
    bias moves the choice to group 0 while the weights stay the unbiased scores."""
    model = build_tiny_causal_lm(family, seed=3)
    spec = architecture_spec(model.config).moe
    assert (spec.n_group, spec.topk_group, spec.num_experts) == (4, 2, 8)
    rows = [[0.1, 0.0, 2.0, 1.9, -1.0, -1.0, 3.0, -3.0],
            [0.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.9, 0.9]]
    gate, hidden = router_with_scores(model, rows)
    if spec.correction_bias:
        with torch.no_grad():
            gate.e_score_correction_bias.copy_(torch.tensor([2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    _, expected_weights, expected_ids = gate(hidden)
    got = route(hidden, gate.weight, getattr(gate, "e_score_correction_bias", None), spec, True)
    assert_same_routing((expected_weights, expected_ids), got)
    chosen = got[1].sort(dim=-1).values.tolist()
    if family == "deepseek_v2":  # groups 1 (best 2.0) and 3 (best 3.0); top-2 inside them
        assert chosen[0] == [2, 6]
    else:  # group sums: group 1 3.9-ish, group 3 with -3.0 loses to group 0
        assert chosen[1] == [0, 1]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_block_matches_transformers(family):
    model = build_tiny_causal_lm(family, seed=4)
    spec = architecture_spec(model.config)
    block = moe_block(model)
    torch.manual_seed(1)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.5)
        if spec.moe.correction_bias:
            block.gate.e_score_correction_bias.normal_(0, 0.1)
    hidden = torch.randn(2, 7, model.config.hidden_size)
    with torch.no_grad():
        expected = block(hidden).reshape(14, -1)
    mlp = MoEMLP(block_context(model), spec.layers[-1])
    weights = copies(mlp, block, torch.float32)
    assert (weights["shared_gate_up"] is not None) == (spec.moe.shared_experts > 0)
    with torch.no_grad():
        got = mlp.forward(weights, hidden.reshape(14, -1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_grouped_experts_equal_gathered_experts():
    """The grouped-GEMM path (sorted by expert, int32 offsets, an expert no token picked) equals the gathered one."""
    torch.manual_seed(5)
    num_tokens, top_k, num_experts, hidden_size, inter = 9, 2, 5, 16, 8
    hidden = torch.randn(num_tokens, hidden_size)
    expert_ids = torch.randint(0, num_experts - 1, (num_tokens, top_k))  # expert 4 gets no token
    weights = torch.rand(num_tokens, top_k)
    gate_up = torch.randn(num_experts, 2 * inter, hidden_size)
    down = torch.randn(num_experts, hidden_size, inter)
    gathered = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=False)
    grouped = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=True)
    torch.testing.assert_close(grouped, gathered, atol=1e-5, rtol=1e-5)
    expected = torch.zeros_like(hidden)
    for token in range(num_tokens):
        for slot in range(top_k):
            gate, up = (gate_up[expert_ids[token, slot]] @ hidden[token]).chunk(2)
            expected[token] += weights[token, slot] * (down[expert_ids[token, slot]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(gathered, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_grouped_moe_in_bf16_rounds_as_transformers_grouped_mm(family, monkeypatch):
    """bf16 through the grouped-GEMM path (on the CPU here, as on CUDA) against transformers' bf16 block, whose
    experts run its grouped_mm path: the weights' dtype (bf16 for Qwen3-MoE and OLMoE, float32 for Mixtral and
    DeepSeek), where they are applied and the sum over k round the same way."""
    from reinforge.rollout.native import moe

    model = build_tiny_causal_lm(family, seed=4).to(torch.bfloat16)
    spec = architecture_spec(model.config)
    block = moe_block(model)
    torch.manual_seed(1)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.5)
    hidden = torch.randn(40, model.config.hidden_size, dtype=torch.bfloat16)
    mlp = MoEMLP(block_context(model, torch.bfloat16), spec.layers[-1])
    weights = copies(mlp, block, torch.bfloat16)
    monkeypatch.setattr(moe, "grouped_mm_applies", lambda hidden: True)
    with torch.no_grad():
        expected = block(hidden[None])[0]
        got = mlp.forward(weights, hidden)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=0, rtol=0)  # the same kernels on the same operands

@pytest.mark.gpu
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_grouped_moe_in_bf16_matches_transformers_and_captures_in_a_graph(family):
    model = build_tiny_causal_lm(family, seed=6).to("cuda", torch.bfloat16)
    spec = architecture_spec(model.config)
    block = moe_block(model)
    hidden = torch.randn(24, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = block(hidden[None])[0]
    mlp = MoEMLP(block_context(model, torch.bfloat16), spec.layers[-1])
    weights = copies(mlp, block, torch.bfloat16, "cuda")
    with torch.no_grad():
        eager = mlp.forward(weights, hidden)
        torch.testing.assert_close(eager, expected, atol=2e-2, rtol=2e-2)
        static = hidden.clone()
        mlp.forward(weights, static)  # warm up before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = mlp.forward(weights, static)
        static.copy_(hidden.flip(0))
        graph.replay()
    torch.testing.assert_close(captured, eager.flip(0), atol=0, rtol=0)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def mla_model(family: str, **overrides) -> torch.nn.Module:
    return build_tiny_causal_lm(family, seed=7, max_position_embeddings=64, **overrides).eval()


def transformers_attention(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The first layer's attention over one sequence (tokens, hidden), causal, positions from 0."""
    positions = torch.arange(hidden.shape[0])[None]
    with torch.no_grad():
        embeddings = model.model.rotary_emb(hidden[None], positions)
        return model.model.layers[0].self_attn(hidden_states=hidden[None], position_embeddings=embeddings,
                                               attention_mask=None)[0][0]


class LatentCache:
    """A compressed paged cache of 4-token blocks for the first layer, with each sequence's blocks listed."""

    def __init__(self, attention, num_blocks: int = 12, block_size: int = 4):
        self.block_size = block_size
        entries, heads, dim = attention.cache_entry
        self.cache = torch.zeros(entries, num_blocks, block_size, heads, dim)
        self.free = list(range(num_blocks - 1, -1, -1))  # blocks handed out out of order
        self.tables: list[list[int]] = []

    def slots(self, sequence: int, positions: range) -> list[int]:
        table = self.tables[sequence]
        while len(table) * self.block_size < positions.stop:
            table.append(self.free.pop(0))
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in positions]

    def block_tables(self, width: int) -> torch.Tensor:
        return torch.tensor([table + [0] * (width - len(table)) for table in self.tables])


def mla_setup(model):
    tables = mla_rotary_tables(model.model.rotary_emb, 64, torch.float32, torch.device("cpu"))
    attention = MLAAttention(block_context(model), architecture_spec(model.config).layers[0], tables)
    return attention, copies(attention, model.model.layers[0].self_attn, torch.float32)


MLA_VARIANTS = [("deepseek_v2", {}), ("deepseek_v3", {}), ("deepseek_v3", {"rope_interleave": False}),
                ("deepseek_v3", {"rope_parameters": YARN}), ("deepseek_v2", {"rope_parameters": YARN}),
                ("deepseek_v3", {"rms_norm_eps": 0.1}),
                ("deepseek_v3", {"rope_parameters": YARN | {"factor": 0.5}})]


@pytest.mark.parametrize(("family", "overrides"), MLA_VARIANTS,
                         ids=["v2", "v3", "v3-halves", "v3-yarn", "v2-yarn", "v3-latent-norm-eps", "v3-yarn-below-1"])
def test_mla_prefill_prefix_and_decode_match_transformers(family, overrides):
    """Two sequences (7 and 5 tokens) prefilled packed, a third whose first 8 tokens are cached and 3 new ones are
    prefilled after the hit, then one decode step of all three in the latent space: each output equals
    transformers' attention over the whole sequence at that position."""
    from reinforge.rollout.native.attention import AttentionMetadata

    model = mla_model(family, **overrides)
    attention, weights = mla_setup(model)
    assert attention.scale == model.model.layers[0].self_attn.scaling
    if "rope_parameters" in overrides and overrides["rope_parameters"]["factor"] > 1:
        assert attention.scale > (16 + 8) ** -0.5  # yarn's mscale squared
    torch.manual_seed(8)
    lengths = [8, 6, 12]  # the final token of each is decoded
    sequences = [torch.randn(length, model.config.hidden_size) for length in lengths]
    expected = [transformers_attention(model, hidden) for hidden in sequences]
    cache = LatentCache(attention)
    cache.tables = [[], [], []]

    def run(hidden, positions, meta):
        with torch.no_grad():
            return attention.forward(weights, hidden, positions, cache.cache, meta)

    # packed prefill of sequences 0 and 1 (all but their final token), and sequence 2's first 8 tokens
    prefill = [(0, range(7)), (1, range(5)), (2, range(8))]
    hidden = torch.cat([sequences[s][r.start:r.stop] for s, r in prefill])
    positions = torch.cat([torch.arange(r.start, r.stop) for _, r in prefill])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot for s, r in prefill for slot in cache.slots(s, r)]), is_prefill=True,
        seq_lens=[len(r) for _, r in prefill],
        batch_index=torch.cat([torch.full((len(r),), i) for i, (_, r) in enumerate(prefill)]),
        token_index=torch.cat([torch.arange(len(r)) for _, r in prefill]))
    out = run(hidden, positions, meta)
    for (s, r), part in zip(prefill, out.split([len(r) for _, r in prefill]), strict=True):
        torch.testing.assert_close(part, expected[s][r.start:r.stop], atol=1e-5, rtol=1e-5)

    # sequence 2 after a prefix-cache hit (tokens 8..10 over the 8 cached ones) packed with a fourth sequence's
    # first 2 tokens (nothing cached)
    fourth = torch.randn(2, model.config.hidden_size)
    cache.tables.append([])
    slots = cache.slots(2, range(8, 11)) + cache.slots(3, range(2))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), is_prefill=True, seq_lens=[3, 2],
        batch_index=torch.tensor([0, 0, 0, 1, 1]), token_index=torch.tensor([0, 1, 2, 0, 1]),
        block_tables=cache.block_tables(4)[2:], context_lens=torch.tensor([11, 2], dtype=torch.int32),
        prefix_lens=torch.tensor([8, 0]), max_context_len=11)
    out = run(torch.cat([sequences[2][8:11], fourth]), torch.tensor([8, 9, 10, 0, 1]), meta)
    torch.testing.assert_close(out, torch.cat([expected[2][8:11], transformers_attention(model, fourth)]),
                               atol=1e-5, rtol=1e-5)
    cache.tables.pop()

    # one decode step of all three: the final token of each
    last = [length - 1 for length in lengths]
    slots = [cache.slots(s, range(p, p + 1))[0] for s, p in enumerate(last)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), is_prefill=False,
                             block_tables=cache.block_tables(6), context_lens=torch.tensor(lengths, dtype=torch.int32))
    out = run(torch.stack([sequences[s][p] for s, p in enumerate(last)]), torch.tensor(last), meta)
    torch.testing.assert_close(out, torch.stack([expected[s][p] for s, p in enumerate(last)]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_triton_latent_decode_equals_the_pytorch_one(dtype):
    """The Triton kernel (interpreted on the CPU, float32 only: the interpreter's bf16 dot is not the GPU's)
    against the PyTorch latent decode: 20 heads in two programs, a latent and a rotary part narrower than a tile,
    contexts ending mid-block and one of a single token."""
    pytest.importorskip("triton")
    from reinforge.rollout.native.mla import latent_decode_attention, latent_paged_decode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(13)
    batch, heads, latent, rope, page, num_blocks = 3, 20, 16, 8, 4, 12
    cache = torch.randn(num_blocks, page, 1, latent + rope, generator=generator).to(device, dtype)
    q = torch.randn(batch, heads, latent + rope, generator=generator).to(device, dtype)
    block_tables = torch.tensor([[5, 2, 9, 0], [7, 0, 0, 0], [1, 3, 4, 11]], dtype=torch.int32, device=device)
    context_lens = torch.tensor([10, 1, 16], dtype=torch.int32, device=device)
    expected = latent_decode_attention(q, cache, block_tables, context_lens, 0.2)[..., :latent]
    got = latent_paged_decode(q, cache, block_tables, context_lens, 0.2, latent)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt], device=model.device)
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return output[0, len(prompt):].tolist()


def forward_log_probs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=model.device)).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens, device=model.device)[:, None])[:, 0].cpu()


def random_prompts(lengths: list[int], seed: int = 1, vocab_size: int = 512) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in lengths]


ENGINE_VARIANTS = [(family, {}) for family in MOE_FAMILIES] + [
    ("qwen3_moe", {"num_layers": 3, "mlp_only_layers": [1]}),  # a dense layer between MoE ones
    ("qwen3_moe", {"num_layers": 4, "decoder_sparse_step": 2}),  # MoE on every second layer
    ("mixtral", {"sliding_window": 6}),  # a window smaller than the sequences
    ("deepseek_v2", {"num_layers": 3, "topk_method": "greedy", "q_lora_rank": 24}),
    ("olmoe", {"clip_qkv": 0.5}),  # q, k and v clamped after their norms
    ("deepseek_v2", {"mlp_bias": True, "random_biases": True}),  # the shared experts' biases
    # the Triton path (its norms, activation, rotary and decode kernels), interpreted on the CPU in float32
    pytest.param("qwen3_moe", {"use_triton": True}, marks=pytest.mark.slow),
    pytest.param("deepseek_v3", {"use_triton": True}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "options"), ENGINE_VARIANTS,
                         ids=[*MOE_FAMILIES, "qwen3_moe-mlp-only", "qwen3_moe-sparse-step", "mixtral-window",
                              "deepseek_v2-greedy-q-lora", "olmoe-clip-qkv", "deepseek_v2-mlp-bias", "qwen3_moe-triton", "deepseek_v3-triton"])
def test_native_greedy_tokens_and_log_probs_match_transformers(family, options):
    """Packed prefill of prompts of several lengths, two samples each, decode steps in the paged (for DeepSeek
    compressed) cache: greedy tokens are transformers' argmax, log-probs those of one plain forward."""
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine, supports_model

    options = dict(options)
    use_triton = options.pop("use_triton", False)
    random_biases = options.pop("random_biases", False)
    if use_triton:
        pytest.importorskip("triton")
    model = build_tiny_causal_lm(family, seed=9, max_position_embeddings=128, **options).eval()
    if random_biases:  # transformers starts them at zero
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0, 0.2, generator=torch.Generator().manual_seed(0))
    spec = architecture_spec(model.config)
    if "mlp_only_layers" in options or "decoder_sparse_step" in options:
        assert not all(layer.moe for layer in spec.layers) and any(layer.moe for layer in spec.layers)
    assert supports_model(model)
    # every prompt's decode steps cross into a new block: 8 tokens over blocks of 8, or in Triton's interpreter 4
    # tokens over blocks of 4 (half its decode steps)
    block_size = 4 if use_triton else 8
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=block_size, max_num_seqs=8,
                          use_triton=use_triton)
    assert engine.runner.decoder.use_triton == use_triton
    prompts = random_prompts([3, 17, 9])
    completions = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=block_size, temperature=0.0, n=2))
                                   for p in prompts])
    for prompt, samples in zip(prompts, completions, strict=True):
        reference = hf_greedy(model, prompt, block_size)
        assert [sample.token_ids for sample in samples] == [reference, reference]
        torch.testing.assert_close(torch.tensor(samples[0].log_probs), forward_log_probs(model, prompt, reference),
                                   atol=1e-5, rtol=0)


def test_a_window_olmoes_masks_never_apply_is_not_applied():
    """OLMoE hands a ``sliding_window`` its config carries to its attention function, but builds only causal masks:
    sampled log-probs are those of transformers' forward, which attends to every earlier token. (transformers'
    generate keeps only a window of that config's keys in its cache, so its greedy tokens are not the comparison.)"""
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine

    model = build_tiny_causal_lm("olmoe", seed=9, max_position_embeddings=128).eval()
    model.config.sliding_window = 6
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=8, max_num_seqs=8, use_triton=False)
    prompts = random_prompts([3, 17, 9])
    completions = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=7))
                                   for p in prompts])
    for prompt, samples in zip(prompts, completions, strict=True):
        for sample in samples:
            torch.testing.assert_close(torch.tensor(sample.log_probs),
                                       forward_log_probs(model, prompt, sample.token_ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_second_turn_after_a_prefix_hit_gives_the_tokens_of_a_full_prefill(family, device):
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine

    model = build_tiny_causal_lm(family, seed=10, max_position_embeddings=128).to(device).eval()
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=8, max_num_seqs=8)
    prompt = random_prompts([21], seed=3)[0]
    first = engine.generate([GenerationRequest(prompt, greedy)])[0][0]
    second_prompt = prompt + first.token_ids + [5, 6, 7]
    hits = engine.counters.prefix_hit_tokens
    second = engine.generate([GenerationRequest(second_prompt, greedy)])[0][0]
    assert engine.counters.prefix_hit_tokens > hits
    assert second.token_ids == hf_greedy(model, second_prompt, 6)
    torch.testing.assert_close(torch.tensor(second.log_probs), forward_log_probs(model, second_prompt,
                                                                                 second.token_ids),
                               atol=1e-5 if device == "cpu" else 1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_native_greedy_matches_transformers_on_gpu_with_graphs(family):
    """float32 on the GPU: Triton kernels and decode CUDA graphs (the latent decode of MLA among them) give
    transformers' greedy tokens and a plain forward's log-probs."""
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine

    model = build_tiny_causal_lm(family, seed=9, max_position_embeddings=256).to("cuda").eval()
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=192, max_num_seqs=16)
    assert engine.runner.decoder.use_triton
    prompts = random_prompts([3, 17, 40, 90])
    completions = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=16, temperature=0.0, n=2))
                                   for p in prompts])
    for prompt, samples in zip(prompts, completions, strict=True):
        reference = hf_greedy(model, prompt, 16)
        assert [sample.token_ids for sample in samples] == [reference, reference]
        torch.testing.assert_close(torch.tensor(samples[0].log_probs), forward_log_probs(model, prompt, reference),
                                   atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_native_bf16_log_probs_are_transformers_bf16_ones_on_gpu(family):
    """bf16 on the GPU: experts as grouped GEMMs inside the decode graphs; each sample's log-probs are those of
    transformers' bf16 forward (its grouped_mm experts) over the same tokens, within bf16 rounding."""
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine

    model = build_tiny_causal_lm(family, seed=9, max_position_embeddings=256).to("cuda", torch.bfloat16).eval()
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=192, max_num_seqs=16)
    prompts = random_prompts([3, 17, 40, 90])
    completions = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=16, temperature=1.0, n=2, seed=3))
                                   for p in prompts])
    for prompt, samples in zip(prompts, completions, strict=True):
        for sample in samples:
            expected = forward_log_probs(model, prompt, sample.token_ids)
            torch.testing.assert_close(torch.tensor(sample.log_probs), expected, atol=5e-2, rtol=0)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_decoder_prefill_logits_are_the_models(family, use_triton):
    """The decoder's copies and blocks give the model's logits, its norms on the Triton path too (interpreted on
    the CPU); the MLA cache holds one latent head per token."""
    from reinforge.rollout.native.attention import AttentionMetadata
    from reinforge.rollout.native.model import PagedDecoder

    if use_triton:
        pytest.importorskip("triton")
    model = build_tiny_causal_lm(family, seed=11).eval()
    decoder = PagedDecoder(model, max_model_len=64, use_triton=use_triton)
    decoder.load_weights()
    prompt = random_prompts([19], seed=4)[0]
    kv_cache = torch.zeros(decoder.kv_cache_shape(3, 8))
    if family == "deepseek_v2":
        assert kv_cache.shape[1:] == (1, 3, 8, 1, 16 + 8)
    positions = torch.arange(19)
    meta = AttentionMetadata(slot_mapping=positions, is_prefill=True, seq_lens=[19],
                             batch_index=torch.zeros(19, dtype=torch.int64), token_index=positions)
    with torch.no_grad():
        got = decoder.forward(torch.tensor(prompt), positions, kv_cache, meta)
        expected = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_weight_sync_refreshes_the_expert_router_and_latent_copies_in_place():
    from reinforge.rollout.native.model import PagedDecoder

    model = build_tiny_causal_lm("deepseek_v3", seed=12).to(torch.bfloat16).eval()
    decoder = PagedDecoder(model, max_model_len=64, use_triton=False)
    decoder.load_weights()
    pointers = decoder.parameter_pointers()
    layer = decoder.weights.layers[1]
    assert layer["router"].dtype == torch.float32 and layer["experts_gate_up"].dtype == torch.bfloat16
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.5)
        model.model.layers[1].mlp.gate.e_score_correction_bias.add_(1.0)
    decoder.load_weights()
    assert decoder.parameter_pointers() == pointers
    source = model.model.layers[1]
    assert torch.equal(layer["experts_gate_up"], source.mlp.experts.gate_up_proj)
    assert torch.equal(layer["router"], source.mlp.gate.weight.float())
    assert torch.equal(layer["correction_bias"], source.mlp.gate.e_score_correction_bias)
    assert torch.equal(layer["kv_b"], source.self_attn.kv_b_proj.weight)
    assert torch.equal(layer["mla_in_weight"], torch.cat([source.self_attn.q_a_proj.weight,
                                                         source.self_attn.kv_a_proj_with_mqa.weight]))


def test_experts_with_another_activation_are_refused_in_one_line():
    from reinforge.rollout.native import NativeEngine, supports_model

    model = build_tiny_causal_lm("qwen3_moe", hidden_act="gelu_pytorch_tanh")
    assert not supports_model(model)
    with pytest.raises(ValueError, match=r"qwen3_moe: its experts use hidden_act='gelu_pytorch_tanh'.*hf rollout"):
        NativeEngine(model, eos_token_ids=[], max_model_len=64)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_a_lora_actors_merged_copy_generates_what_the_adapted_model_does(family):
    """LoRA on the attention projections (DeepSeek's latent ones, kv_b_proj read per head by the absorbed decode,
    among them): the deltas land in the right rows of the engine's concatenated copies."""
    from reinforge.config.schema import LoraConfig
    from reinforge.engine.lora import LINEAR_LAYERS, add_lora, lora_deltas
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine

    model = build_tiny_causal_lm(family, seed=14, max_position_embeddings=128).eval()
    mlp = ("gate_proj", "up_proj", "down_proj")
    if family == "deepseek_v3":  # q_lora_rank set: q_a_proj and q_b_proj instead of q_proj
        targets = [name for name in LINEAR_LAYERS[family] if name not in ("q_proj", *mlp)]
    else:
        targets = [name for name in LINEAR_LAYERS[family] if name not in ("q_a_proj", "q_b_proj", *mlp)]
    torch.manual_seed(0)
    peft_model = add_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=targets))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=8, max_num_seqs=8)
    prompts = random_prompts([3, 17], seed=6)
    engine.sync_weights(model)
    engine.wake_up()
    engine.add_to_weights(lora_deltas(peft_model))
    completions = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=8, temperature=0.0))
                                   for p in prompts])
    engine.sleep()
    changed = False
    for prompt, (sample,) in zip(prompts, completions, strict=True):
        reference = hf_greedy(model, prompt, 8)
        assert sample.token_ids == reference
        torch.testing.assert_close(torch.tensor(sample.log_probs), forward_log_probs(model, prompt, reference),
                                   atol=1e-4, rtol=0)
        with peft_model.disable_adapter():
            changed |= hf_greedy(model, prompt, 8) != reference
    assert changed


def test_adapters_on_the_experts_are_refused_in_one_line():
    """peft's own adapters on the fused expert weights (its target_parameters; reinforge's add_lora never adds them)."""
    from peft import LoraConfig, get_peft_model

    from reinforge.rollout.native import supports_model
    from reinforge.rollout.native.model import unsupported_reason

    model = build_tiny_causal_lm("deepseek_v2", seed=15)
    get_peft_model(model, LoraConfig(r=4, target_modules=["kv_b_proj"], target_parameters=["experts.gate_up_proj"]))
    assert not supports_model(model)
    assert "its experts carry adapters" in unsupported_reason(model)
