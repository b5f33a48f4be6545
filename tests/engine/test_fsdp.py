"""FSDP2 on the CPU: a group of one in this process, and two gloo processes against one."""

import copy
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from reinforge.engine.forward import response_log_probs
from reinforge.engine.fsdp import clip_grad_norm_, fsdp_params, fsdp_units, pin_offloaded_shards, shard_model
from reinforge.engine.memory_plan import SHARD_ALIGN

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(REPO / "tests"))
import forked_python  # noqa: E402
from test_micro_batches_and_update import make_rollout_batch, varlen_lm  # noqa: E402

UPDATE = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_micro_batches_and_update import make_rollout_batch, on_policy_update, varlen_lm
    from reinforge.config.schema import OptimConfig
    from reinforge.engine.fsdp import full_model_state, shard_model
    from reinforge.engine.micro_batches import balanced_micro_batches
    from reinforge.engine.optim import build_scheduler
    from reinforge.engine.train_step import UpdateSettings
    from reinforge.engine.distributed import init_distributed
    from functools import partial

    SHARE = {share!r}

    def rollout_batch():
        batch = make_rollout_batch(rows=8, seed=5)
        if SHARE:  # rows 2k and 2k + 1 are two samples of one prompt, as GRPO makes them
            width = batch["prompts"].shape[1]
            for row in range(1, 8, 2):
                for key in ("prompts",):
                    batch[key][row] = batch[key][row - 1]
                for key in ("input_ids", "attention_mask", "position_ids"):
                    batch[key][row, :width] = batch[key][row - 1, :width]
        return batch

    def update(rows, budget, skip_zero_advantage=False):
        model = varlen_lm(seed=4).train()
        shard_model(model, torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = build_scheduler(optimizer, 10, OptimConfig(lr=1.0))
        batch = rollout_batch().index(rows)
        metrics = on_policy_update(model, optimizer, scheduler, batch,
                                   UpdateSettings(max_tokens_per_micro_batch=budget, grad_clip=0.05),
                                   split=partial(balanced_micro_batches, share_prompts=SHARE),
                                   no_grad_rows=(batch["advantages"] == 0).all(-1) if skip_zero_advantage else None)
        return full_model_state(model), metrics["actor/grad_norm"]
""")

RANK_MAIN = textwrap.dedent("""
    rank, world_size = init_distributed("gloo")
    state, grad_norm = update(list(range(rank * 4, rank * 4 + 4)), budget=12)
    if rank == 0:
        torch.save({"state": state, "grad_norm": grad_norm}, sys.argv[1])
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RANK_EXIT = textwrap.dedent("""

    # appended by run_gloo_ranks: every rank waits for the others (60 s at most), then leaves without the
    # interpreter's teardown, in which a gloo rank aborts now and then ("terminate called without an active
    # exception", about 1 run of these tests in 15) after all of its work has succeeded
    import datetime as _datetime, os as _os, sys as _sys
    import torch.distributed as _dist
    if _dist.is_initialized() and _dist.get_world_size() > 1:
        _dist.monitored_barrier(timeout=_datetime.timedelta(seconds=60))
    _sys.stdout.flush()
    _sys.stderr.flush()
    _os._exit(0)
""")


def run_gloo_ranks(script: Path, *args: str, world_size: int = 2) -> None:
    """Run ``script`` as ``world_size`` gloo ranks of one group on this machine; fails with a failing rank's output.

    A rank that raises exits non-zero before ``RANK_EXIT`` (appended to the script) runs, and one that
    waits for a failed peer there fails after 60 s.
    """
    script.write_text(script.read_text() + RANK_EXIT)
    port, processes = _free_port(), []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        # forked from one preloaded interpreter (forked_python.py): a fresh one spent most of the test importing
        processes.append(forked_python.ForkedPython([str(script), *args], env=env, stderr=subprocess.STDOUT))
    failures = []
    for rank, process in enumerate(processes):
        output, _ = process.communicate(timeout=240)
        if process.returncode != 0:
            failures.append(f"rank {rank} exited {process.returncode}:\n{output[-4000:]}")
    assert not failures, "\n".join(failures)


SKIPPING = textwrap.dedent("""
    ZERO = {zero!r}
    _plain_batch = rollout_batch

    def rollout_batch():  # the rows in ZERO score like the rest of their group: advantage 0
        batch = _plain_batch()
        batch["advantages"][ZERO] = 0.0
        return batch
""")

SKIPPING_MAIN = RANK_MAIN.replace("budget=12)", "budget=12, skip_zero_advantage=True)")


@pytest.mark.slow
@pytest.mark.parametrize("zero_rows", [[4, 5, 6, 7], [0, 1, 4, 5]])
def test_forward_only_rows_on_two_ranks_update_like_one_process_with_every_backward(tmp_path, zero_rows):
    """Rank 1 with nothing to train (its part with gradients is a row without loss tokens) and rank 0 with
    nothing forward-only, or both with some of each: the FSDP collectives pair up and the update is the
    full backward's of one process."""
    source = UPDATE.format(tests=str(REPO / "tests" / "engine"), share=True)
    script = tmp_path / "update.py"
    assert "skip_zero_advantage=True" in SKIPPING_MAIN  # the ranks run the forward-only micro-batches
    script.write_text(source + SKIPPING.format(zero=zero_rows) + SKIPPING_MAIN)
    run_gloo_ranks(script, str(tmp_path / "two.pt"))
    two = torch.load(tmp_path / "two.pt", weights_only=True)

    namespace: dict = {}
    exec(source + SKIPPING.format(zero=zero_rows), namespace)
    one_state, one_grad_norm = namespace["update"](list(range(8)), budget=10_000)  # every row backpropagated
    assert abs(two["grad_norm"] - one_grad_norm) < 1e-5 * max(1.0, one_grad_norm)
    for name, tensor in one_state.items():
        torch.testing.assert_close(two["state"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)


def test_sharded_model_gives_the_plain_model_gradients_and_clipping():
    plain = varlen_lm(seed=6).train()
    sharded = shard_model(copy.deepcopy(plain), torch.device("cpu"))
    batch = make_rollout_batch(rows=5, seed=7)
    for model in (plain, sharded):
        log_probs, entropy = response_log_probs(model, batch, temperature=0.9, with_entropy=True)
        (log_probs * batch["advantages"] + 0.1 * entropy).sum().backward()
    plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)
    sharded_norm = clip_grad_norm_(sharded.parameters(), 0.01)
    torch.testing.assert_close(sharded_norm, plain_norm, atol=1e-5, rtol=1e-5)
    for (name, p_plain), p_sharded in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(p_sharded.grad.full_tensor(), p_plain.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_deepseek_without_shared_experts_shards_trains_and_saves_its_empty_shared_mlp_whole():
    """n_shared_experts: 0 leaves DeepSeek's shared MLP (hidden, 0) wide: FSDP gathered its down projection as (0, 0)
    and refused to reduce its empty gradients. It stays outside the shards, frozen; the rest trains as the plain
    model does, and the full state has the model's own shapes."""
    from reinforge.engine.attention import use_varlen_attention
    from reinforge.engine.fsdp import full_model_state
    from reinforge.models.tiny import build_tiny_causal_lm

    plain = build_tiny_causal_lm("deepseek_v2", vocab_size=64, seed=8, n_shared_experts=0).train()
    use_varlen_attention(plain)
    assert plain.model.layers[1].mlp.shared_experts.down_proj.weight.shape == (64, 0)
    sharded = shard_model(copy.deepcopy(plain), torch.device("cpu"))
    batch = make_rollout_batch(rows=3, seed=9)
    for model in (plain, sharded):
        log_probs, _ = response_log_probs(model, batch)
        (log_probs * batch["advantages"]).sum().backward()
    torch.testing.assert_close(clip_grad_norm_(sharded.parameters(), 1.0),
                               torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0), atol=1e-5, rtol=1e-5)
    state = full_model_state(sharded)
    assert {name: tensor.shape for name, tensor in state.items()} == \
        {name: tensor.shape for name, tensor in plain.state_dict().items()}


def routed(model, input_ids):
    """Each MoE router's weight dtype as its forward sees it, and its (logits, top-k weights, top-k experts)."""
    from reinforge.engine.moe import moe_blocks

    seen = []
    handles = [hook for block in moe_blocks(model) for hook in (
        block.gate.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype)),
        block.gate.register_forward_hook(lambda module, args, output: seen.append(output)))]
    with torch.no_grad():
        model(input_ids=input_ids)
    for handle in handles:
        handle.remove()
    return seen[0::2], seen[1::2]


@pytest.mark.parametrize("arch, checkpointed", [("deepseek_v2", False), ("deepseek_v3", False), ("deepseek_v3", True)])
def test_a_bfloat16_update_routes_and_gets_the_gradients_of_the_model_transformers_loads_in_bfloat16(
        tmp_path, arch, checkpointed):
    """transformers keeps DeepSeek's router weight in float32 in a bfloat16 model (``_keep_in_fp32_modules_strict``)
    and computes the router logits from it in float32. Gathered in bfloat16 with its layer, the rounded weight gave
    other logits, and other experts; as a float32 unit of its own the training forward routes as transformers does,
    and its log-probs and gradients (recomputed layers too) are those of transformers' bfloat16 model."""
    from transformers import AutoModelForCausalLM

    from reinforge.engine.attention import use_varlen_attention
    from reinforge.engine.fsdp import full_model_state, load_full_training_state
    from reinforge.engine.recompute import checkpoint_decoder_layers
    from reinforge.models.tiny import build_tiny_causal_lm

    plain = build_tiny_causal_lm(arch, vocab_size=64, seed=8, num_layers=3).train()
    plain.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).train()
    sharded = copy.deepcopy(plain)
    checkpoint_decoder_layers(sharded, 3 if checkpointed else 0)
    shard_model(sharded, torch.device("cpu"), "bfloat16")
    input_ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    expected_dtypes, expected = routed(loaded, input_ids)
    dtypes, outputs = routed(sharded, input_ids)
    assert dtypes == expected_dtypes == [torch.float32] * 2
    for (logits, weights, experts), (want_logits, want_weights, want_experts) in zip(outputs, expected, strict=True):
        torch.testing.assert_close(logits, want_logits, atol=0, rtol=0)
        torch.testing.assert_close(weights, want_weights, atol=0, rtol=0)
        assert torch.equal(experts, want_experts)
    batch = make_rollout_batch(rows=3, seed=9)
    for model in (loaded, sharded):
        use_varlen_attention(model)
        log_probs, _ = response_log_probs(model, batch)
        (log_probs * batch["advantages"]).sum().backward()
    for (name, want), parameter in zip(loaded.named_parameters(), sharded.parameters(), strict=True):
        assert parameter.grad.dtype == torch.float32, name
        torch.testing.assert_close(parameter.grad.full_tensor(), want.grad.float(), atol=0, rtol=0, msg=name)
    # saved and loaded as every other parameter: the full state under the plain names and dtypes
    state = full_model_state(sharded)
    assert {name: (tensor.shape, tensor.dtype) for name, tensor in state.items()} == \
        {name: (tensor.shape, tensor.dtype) for name, tensor in plain.state_dict().items()}
    router_name = "model.layers.2.mlp.gate.weight"
    moved = state[router_name] + 1e-3
    load_full_training_state(sharded, None, {"model": {**state, router_name: moved.clone()}})
    torch.testing.assert_close(full_model_state(sharded)[router_name], moved, atol=0, rtol=0)


@pytest.mark.slow
def test_a_compiled_decoder_layer_with_a_float32_router_unit_stays_one_graph():
    """The float32 router's FSDP hooks run around its layer's forward, outside the compiled graph: hooks inside it
    (a unit's own, which dynamo does not trace) split a DeepSeek MoE layer's graph in three."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from reinforge.engine.attention import use_varlen_attention
    from reinforge.engine.fused import compile_decoder_layers
    from reinforge.models.tiny import build_tiny_causal_lm

    eager = build_tiny_causal_lm("deepseek_v3", vocab_size=64, seed=8, num_layers=1, first_k_dense_replace=0).train()
    use_varlen_attention(eager)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(compiled, backend="eager") == 1
    batch = make_rollout_batch(rows=3, seed=9)
    log_probs = []
    for model in (eager, compiled):
        shard_model(model, torch.device("cpu"), "bfloat16")
        with torch.no_grad():
            log_probs.append(response_log_probs(model, batch)[0])
    torch.testing.assert_close(log_probs[1], log_probs[0], atol=0, rtol=0)
    assert not counters["graph_break"], list(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("share_prompts", [False, True])
def test_two_gloo_processes_update_like_one(tmp_path, share_prompts):
    source = UPDATE.format(tests=str(REPO / "tests" / "engine"), share=share_prompts)
    script = tmp_path / "update.py"
    script.write_text(source + RANK_MAIN)
    run_gloo_ranks(script, str(tmp_path / "two.pt"))
    two = torch.load(tmp_path / "two.pt", weights_only=True)

    namespace: dict = {}
    exec(source, namespace)
    one_state, one_grad_norm = namespace["update"](list(range(8)), budget=10_000)
    assert abs(two["grad_norm"] - one_grad_norm) < 1e-5 * max(1.0, one_grad_norm)
    for name, tensor in one_state.items():
        torch.testing.assert_close(two["state"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    initial = namespace["varlen_lm"](seed=4).state_dict()
    assert any(not torch.equal(initial[name], tensor) for name, tensor in one_state.items())


def train_twice(model, batch):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        log_probs, _ = response_log_probs(model, batch, temperature=0.9)
        (log_probs * batch["advantages"]).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [parameter.full_tensor().cpu() for parameter in model.parameters()]


def test_offloaded_shards_moved_into_one_host_buffer_per_unit_train_as_before():
    plain = varlen_lm(seed=6).train()
    on_device = shard_model(copy.deepcopy(plain), torch.device("cpu"))
    offloaded = shard_model(copy.deepcopy(plain), torch.device("cpu"), offload=True)
    registered = []
    for unit in fsdp_units(offloaded):
        params = fsdp_params(unit)
        expected = sum(-(-p._sharded_param_data.numel() * p._sharded_param_data.element_size() // SHARD_ALIGN)
                       * SHARD_ALIGN for p in params)
        assert pin_offloaded_shards(unit, lambda buffer: registered.append(buffer) or True) == expected
        assert registered[-1].numel() == expected
        assert {p._sharded_param_data.untyped_storage().data_ptr() for p in params} == {registered[-1].data_ptr()}
        assert all(p.pin_memory for p in params)
        for param in params:  # nothing pins on a CPU-only machine; FSDP would try to at its first forward
            param.pin_memory = False
    batch = make_rollout_batch(rows=5, seed=7)
    for after, expected in zip(train_twice(offloaded, batch), train_twice(on_device, batch), strict=True):
        torch.testing.assert_close(after, expected)


def test_a_unit_whose_buffer_cannot_be_registered_is_left_to_fsdps_own_pinning():
    model = shard_model(varlen_lm(seed=6), torch.device("cpu"), offload=True)
    unit = fsdp_units(model)[0]
    before = [p._sharded_param_data for p in fsdp_params(unit)]
    assert pin_offloaded_shards(unit, lambda buffer: False) == 0
    assert [p._sharded_param_data for p in fsdp_params(unit)] == before
    assert all(p.pin_memory for p in fsdp_params(unit))


@pytest.mark.gpu
def test_offloaded_shards_are_pinned_at_their_exact_size_on_cuda():
    device = torch.device("cuda")
    plain = varlen_lm(seed=6).train()
    on_device = shard_model(copy.deepcopy(plain).to(device), device)
    offloaded = shard_model(copy.deepcopy(plain), device, offload=True)
    for unit in fsdp_units(offloaded):
        params = fsdp_params(unit)
        assert len({p._sharded_param_data.untyped_storage().data_ptr() for p in params}) == 1
        assert all(p._sharded_param_data.device.type == "cpu" and p._sharded_param_data.is_pinned() for p in params)
    batch = make_rollout_batch(rows=5, seed=7).to(device)
    for after, expected in zip(train_twice(offloaded, batch), train_twice(on_device, batch), strict=True):
        torch.testing.assert_close(after, expected, atol=2e-2, rtol=2e-2)
    for unit in fsdp_units(offloaded):  # still the same pinned buffer after FSDP's lazy initialisation
        params = fsdp_params(unit)
        assert len({p._sharded_param_data.untyped_storage().data_ptr() for p in params}) == 1
        assert all(p._sharded_param_data.is_pinned() for p in params)


@pytest.mark.parametrize("arch, dtype", [("qwen2", "float32"), ("qwen2", "bfloat16"), ("deepseek_v3", "bfloat16")])
def test_an_update_that_keeps_the_parameters_gathered_gathers_and_reduces_once_a_mini_batch_to_the_same_step(
        monkeypatch, arch, dtype):
    """``UpdateSettings.keep_gathered`` on one device: each layer is gathered once a mini-batch and its gradients are
    reduced by the last micro-batch's backward (accumulated in float32 under a bfloat16 compute dtype until
    then), and the step equals the one that gathers for every forward and backward and reduces after each. A
    float32 router inside a layer (DeepSeek) is a unit kept gathered with it."""
    from test_micro_batches_and_update import on_policy_update
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from reinforge.config.schema import OptimConfig
    from reinforge.engine.attention import use_varlen_attention
    from reinforge.engine.fsdp import decoder_layers, reshards_after_forward
    from reinforge.engine.optim import build_scheduler
    from reinforge.engine.train_step import UpdateSettings
    from reinforge.models.tiny import build_tiny_causal_lm

    calls = {"gather": 0, "reduce": 0}
    unshard, reduce = _fsdp_param_group.FSDPParamGroup.unshard, _fsdp_param_group.foreach_reduce

    def counted_unshard(group, *args, **kwargs):  # one that gathers (on one device: copies into the gathered copy)
        calls["gather"] += group._all_gather_result is None and not group.is_unsharded
        return unshard(group, *args, **kwargs)

    def counted_reduce(*args, **kwargs):
        calls["reduce"] += 1
        return reduce(*args, **kwargs)

    monkeypatch.setattr(_fsdp_param_group.FSDPParamGroup, "unshard", counted_unshard)
    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", counted_reduce)
    base = build_tiny_causal_lm(arch, vocab_size=64, seed=6).train()
    use_varlen_attention(base)
    batch = make_rollout_batch(rows=6, seed=8)
    results = {}
    for keep in (False, True):
        model = shard_model(copy.deepcopy(base), torch.device("cpu"), dtype)
        units = len(fsdp_units(model))
        assert units == len(decoder_layers(model)) + 1 + (arch == "deepseek_v3")  # and the root; one MoE layer
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = build_scheduler(optimizer, 10, OptimConfig(lr=1.0))
        settings = UpdateSettings(max_tokens_per_micro_batch=12, grad_clip=1e9, num_mini_batches=2,
                                  keep_gathered=keep)
        calls.update(gather=0, reduce=0)
        metrics = on_policy_update(model, optimizer, scheduler, batch, settings)
        results[keep] = ({name: p.full_tensor().detach().clone() for name, p in model.named_parameters()},
                         metrics["actor/grad_norm"], dict(calls))
        assert all(reshards_after_forward(layer) for layer in decoder_layers(model))  # its own setting again
        assert {param.sharded_state.name for unit in fsdp_units(model) for param in fsdp_params(unit)} == {"SHARDED"}
    (plain, plain_norm, plain_calls), (kept, kept_norm, kept_calls) = results[False], results[True]
    assert plain_calls["reduce"] > kept_calls["reduce"] == 2 * units  # two mini-batches: once each
    assert plain_calls["gather"] >= 2 * kept_calls["gather"]
    assert kept_calls["gather"] == 2 * units  # every unit, once a mini-batch
    assert kept_norm == pytest.approx(plain_norm, rel=1e-6)
    for name, tensor in plain.items():
        torch.testing.assert_close(kept[name], tensor, atol=0, rtol=0, msg=name)


VISION_RANK = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_vlm_packing import vlm, vlm_batch
    from reinforge.engine.distributed import init_distributed
    from reinforge.engine.forward import response_log_probs
    from reinforge.engine.fsdp import shard_model
    from reinforge.engine.packing import attach_plan
    from reinforge.models.tiny_vlm import build_tiny_processor
    from reinforge.models.vision import freeze_vision_tower
    from reinforge.protocol import MULTI_MODAL_KEY

    def gradients(model, rank, world_size):
        batch = vlm_batch(build_tiny_processor("qwen2_5_vl"))
        with_images = [bool(inputs) for inputs in batch[MULTI_MODAL_KEY]]
        rows = [row for row in range(len(batch)) if world_size == 1 or with_images[row] == (rank == 0)]
        micro = attach_plan(batch.index(rows), share_prompts=True)
        log_probs, _ = response_log_probs(model, micro)
        (log_probs * micro["advantages"]).sum().backward()
        return {{name: parameter.grad for name, parameter in model.named_parameters()}}
""")


def test_two_ranks_train_the_vision_tower_when_only_one_ranks_rows_hold_images(tmp_path):
    """The tower's image features are in the model's output: a rank with images runs FSDP's pre-backward gather and
    reduces tower gradients, one without would do neither, and the two waited on each other for ever. Both now run
    the same collectives, and the gradients are one process's."""
    source = VISION_RANK.format(tests=str(REPO / "tests" / "engine"))
    script = tmp_path / "vision.py"
    script.write_text(source + textwrap.dedent("""
        rank, world_size = init_distributed("gloo")
        model = vlm("qwen2_5_vl", seed=1)
        freeze_vision_tower(model, False)
        shard_model(model, torch.device("cpu"))
        grads = {name: grad.full_tensor() for name, grad in gradients(model, rank, world_size).items()}
        if rank == 0:
            torch.save(grads, sys.argv[1])
    """))
    run_gloo_ranks(script, str(tmp_path / "two.pt"))
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    namespace: dict = {}
    exec(source, namespace)
    model = namespace["vlm"]("qwen2_5_vl", seed=1)
    namespace["freeze_vision_tower"](model, False)
    one = namespace["gradients"](model, 0, 1)
    assert any(".visual." in name for name in one)
    for name, grad in one.items():  # FSDP averages the ranks' gradients
        torch.testing.assert_close(two[name] * 2, grad, atol=1e-5, rtol=1e-4, msg=name)
