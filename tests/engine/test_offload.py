"""Optimizer offload (engine.offload): the update and the saved state equal on-device AdamW's.

On the CPU the "device" parameters and the host master copy are both in host memory, but they
are separate buffers: the step still copies gradients into the staging buffer, runs AdamW on the
master copy and copies the result back, which is the path a GPU run takes (minus pinning and
streams). The tests prove that path computes AdamW exactly, walks its buckets correctly, keeps
the two copies in step and saves/loads its state; they cannot show the copies overlap on a GPU.
"""

import copy
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from reinforge.config.schema import OptimConfig
from reinforge.engine.fsdp import full_training_state, load_full_training_state, shard_model
from reinforge.engine.offload import HostOffloadedAdamW
from reinforge.engine.optim import build_scheduler
from reinforge.engine.train_step import UpdateSettings

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_fsdp import run_gloo_ranks  # noqa: E402
from test_micro_batches_and_update import make_rollout_batch, on_policy_update, varlen_lm  # noqa: E402

CONFIG = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2)
SETTINGS = UpdateSettings(max_tokens_per_micro_batch=12, grad_clip=0.5)


def offloaded(model, chunk_numel=1500):
    return HostOffloadedAdamW(model.named_parameters(), lr=CONFIG.lr, betas=tuple(CONFIG.betas), eps=CONFIG.eps,
                              weight_decay=CONFIG.weight_decay, chunk_numel=chunk_numel)


def on_device(model):
    return torch.optim.AdamW(model.parameters(), lr=CONFIG.lr, betas=tuple(CONFIG.betas), eps=CONFIG.eps,
                             weight_decay=CONFIG.weight_decay, fused=True)


def train(model, optimizer, scheduler, steps, seed=0):
    for step in range(steps):
        on_policy_update(model, optimizer, scheduler, make_rollout_batch(rows=6, seed=seed + step), SETTINGS)


def sharded_pair():
    base = varlen_lm(seed=3).train()
    return shard_model(copy.deepcopy(base), torch.device("cpu")), shard_model(copy.deepcopy(base), torch.device("cpu"))


def test_offloaded_adamw_gives_the_on_device_update():
    """Equal to float32 rounding: the fused CPU kernel splits a tensor into vector lanes, a scalar tail and
    thread ranges, and a parameter cut across two chunks is split differently than as a whole."""
    reference, model = sharded_pair()
    reference_optimizer, optimizer = on_device(reference), offloaded(model)
    assert len(optimizer.chunks) > 3  # the pipeline over chunks (parameters split across them) is used
    assert any(len(segments) > 1 for _, _, segments, _ in optimizer.chunks)
    masters = optimizer.full_master_state()
    assert all(masters[id(p)].data_ptr() != p.to_local().data_ptr() for p in model.parameters())
    train(reference, reference_optimizer, build_scheduler(reference_optimizer, 10, CONFIG), steps=3)
    train(model, optimizer, build_scheduler(optimizer, 10, CONFIG), steps=3)
    initial = varlen_lm(seed=3).state_dict()
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert not torch.equal(expected.full_tensor(), initial[name]), name
        # 2e-8 for most; k_proj.bias gets 3e-6: its true gradient is 0 (softmax ignores a shift of all keys),
        # so Adam divides rounding noise by rounding noise and a last-bit difference becomes visible
        torch.testing.assert_close(actual.full_tensor(), expected.full_tensor(), atol=1e-5, rtol=1e-6, msg=name)
        assert torch.equal(masters[id(actual)], actual.to_local()), name  # host and device copies agree exactly


def test_offloaded_state_resumes_exactly_and_moves_to_an_on_device_optimizer(tmp_path):
    reference, model = sharded_pair()
    optimizer = offloaded(model)
    scheduler = build_scheduler(optimizer, 10, CONFIG)
    train(model, optimizer, scheduler, steps=2)
    # in a group of one the state holds the live host buffers (no copy): written at once, as a checkpoint does
    torch.save(full_training_state(model, optimizer) | {"scheduler": scheduler.state_dict()}, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert set(state["optimizer"]["state"]) == {name for name, _ in model.named_parameters()}
    train(model, optimizer, scheduler, steps=1, seed=9)

    resumed = shard_model(varlen_lm(seed=11).train(), torch.device("cpu"))  # other weights: the load must set them
    resumed_optimizer = offloaded(resumed)
    train(resumed, resumed_optimizer, _resumed_scheduler(resumed, resumed_optimizer, state), steps=1, seed=9)

    plain_optimizer = on_device(reference)
    train(reference, plain_optimizer, _resumed_scheduler(reference, plain_optimizer, state), steps=1, seed=9)
    for (name, expected), other, plain in zip(model.named_parameters(), resumed.parameters(), reference.parameters(),
                                              strict=True):
        assert torch.equal(other.full_tensor(), expected.full_tensor()), name  # resumed: exact
        torch.testing.assert_close(plain.full_tensor(), expected.full_tensor(), atol=1e-5, rtol=1e-6, msg=name)


def _resumed_scheduler(model, optimizer, state):
    """What workers.checkpointing.load_training_state does: schedule built first, then the state loaded."""
    scheduler = build_scheduler(optimizer, 10, CONFIG)
    load_full_training_state(model, optimizer, state)
    scheduler.load_state_dict(state["scheduler"])
    return scheduler


TWO_RANKS = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_offload import offloaded, train, CONFIG
    from test_micro_batches_and_update import varlen_lm
    from reinforge.engine.distributed import init_distributed
    from reinforge.engine.fsdp import full_training_state, load_full_training_state, shard_model
    from reinforge.engine.optim import build_scheduler

    rank, _ = init_distributed("gloo")
    model = shard_model(varlen_lm(seed=3).train(), torch.device("cpu"))
    optimizer = offloaded(model)
    train(model, optimizer, build_scheduler(optimizer, 10, CONFIG), steps=2, seed=rank * 10)
    state = full_training_state(model, optimizer)
    if rank == 0:
        torch.save(state, sys.argv[1])
    torch.distributed.barrier()
    again = shard_model(varlen_lm(seed=5).train(), torch.device("cpu"))
    again_optimizer = offloaded(again)
    load_full_training_state(again, again_optimizer, torch.load(sys.argv[1], weights_only=True))
    if rank == 0:
        torch.save(full_training_state(again, again_optimizer), sys.argv[1] + ".reloaded")
    else:
        full_training_state(again, again_optimizer)
""")


@pytest.mark.slow
def test_two_gloo_processes_save_and_load_whole_offloaded_state(tmp_path):
    """Two ranks hold half of every tensor each: the saved state is whole, and loading it shards it back."""
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS.format(tests=str(REPO / "tests" / "engine")))
    run_gloo_ranks(script, str(tmp_path / "state.pt"))
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    reloaded = torch.load(str(tmp_path / "state.pt") + ".reloaded", weights_only=True)
    shapes = {name: tensor.shape for name, tensor in varlen_lm(seed=3).state_dict().items()}
    for name, moments in saved["optimizer"]["state"].items():
        assert moments["exp_avg"].shape == shapes[name]
        assert moments["exp_avg_sq"].abs().sum() > 0
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(reloaded["optimizer"]["state"][name][key], moments[key]), (name, key)
    for name, tensor in saved["model"].items():
        assert tensor.shape == shapes[name]
        assert torch.equal(reloaded["model"][name], tensor), name


def test_a_parameter_the_backward_did_not_reach_is_left_as_torchs_adamw_leaves_it():
    """A vision-language model's tower and projector in a text-only step: no gradient, no decay, no move."""
    torch.manual_seed(0)
    reached, missed = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    before, start = copy.deepcopy(missed.state_dict()), reached.weight.detach().clone()
    named = [*(("reached." + name, p) for name, p in reached.named_parameters()),
             *(("missed." + name, p) for name, p in missed.named_parameters())]
    optimizer = HostOffloadedAdamW(named, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for _ in range(2):
        reached(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert all(torch.equal(missed.state_dict()[name], tensor) for name, tensor in before.items())
    assert not torch.equal(reached.weight, start)  # the reached one did move
