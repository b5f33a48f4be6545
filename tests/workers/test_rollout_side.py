"""The actor worker's rollout side on the CPU: the response tensors, and how the weights reach each engine."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import reinforge.workers.rollout_side as rollout_side
from reinforge.rollout.base import SamplingParams
from reinforge.workers.actor_rollout import ActorRolloutWorker
from reinforge.workers.rollout_side import _response_tensors

sys.path.insert(0, str(Path(__file__).parent))
from test_actor_rollout import make_config, prompt_batch, scored_batch  # noqa: E402


def test_response_tensors_pad_each_completion_and_keep_its_finish_reason():
    completions = [SimpleNamespace(token_ids=[5, 6, 7], log_probs=[-0.1, -0.2, -0.3], finish_reason="stop"),
                   SimpleNamespace(token_ids=[], log_probs=[], finish_reason="length"),
                   SimpleNamespace(token_ids=[9, 9, 9, 9], log_probs=[-1.0] * 4, finish_reason="length")]
    responses, mask, log_probs, stop = _response_tensors(completions, width=4, pad_id=0)
    assert responses.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0], [9, 9, 9, 9]]
    assert mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert log_probs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0])
    assert stop.tolist() == [True, False, False] and responses.dtype == torch.long and mask.dtype == torch.float32


def test_native_rollout_on_one_device_copies_the_shards_without_gathering(tiny_model_dir, monkeypatch):
    """On one device the engine reads each FSDP parameter's local shard (the whole parameter): no unshard, and
    the same tokens and log-probs as when the parameters are gathered first (the path of several devices)."""
    from torch.distributed.fsdp import FSDPModule

    config = make_config(tiny_model_dir)
    config.rollout.name = "native"
    worker = ActorRolloutWorker(config, total_training_steps=2)
    worker.update_actor(scored_batch())  # weights that differ from the loaded ones
    batch = prompt_batch().repeat(2, interleave=True)
    sampling = SamplingParams(max_tokens=6, temperature=1.0)
    unshards = []
    original = FSDPModule.unshard
    monkeypatch.setattr(FSDPModule, "unshard", lambda self, *a, **k: (unshards.append(self), original(self, *a, **k))[1])
    direct = worker.generate(batch, sampling, 7)
    assert unshards == []
    monkeypatch.setattr(rollout_side, "world_size", lambda: 2)  # take the gathering path on the same device
    gathered = worker.generate(batch, sampling, 7)
    assert unshards, "the gathering path did not gather"
    assert torch.equal(direct["responses"], gathered["responses"])
    torch.testing.assert_close(direct["rollout_log_probs"], gathered["rollout_log_probs"])


@pytest.mark.parametrize("rollout_name, strategy, gathered_while_generating", [
    ("hf", rollout_side.InPlaceWeights, True),  # generate runs on the training module itself
    ("native", rollout_side.CopiedWeights, False),  # the engine has its copy: sharded again before the first token
])
def test_the_engine_decides_whether_the_parameters_stay_gathered_while_it_generates(
        tiny_model_dir, monkeypatch, rollout_name, strategy, gathered_while_generating):
    from torch.distributed.fsdp import FSDPModule

    config = make_config(tiny_model_dir)
    config.rollout.name = rollout_name
    config.model.lora.rank = 4
    worker = ActorRolloutWorker(config, total_training_steps=1)
    assert type(worker.rollout_side.weights) is strategy
    monkeypatch.setattr(rollout_side, "world_size", lambda: 2)  # the gathering path of several devices
    events: list[str] = []
    for name in ("unshard", "reshard"):
        original = getattr(FSDPModule, name)
        monkeypatch.setattr(FSDPModule, name, lambda self, *a, _name=name, _original=original, **k: (
            events.append(_name), _original(self, *a, **k))[1])
    generate = worker.rollout_engine.generate
    at_generate: list[int] = []
    monkeypatch.setattr(worker.rollout_engine, "generate", lambda requests: (
        at_generate.append(events.count("unshard") - events.count("reshard")), generate(requests))[1])
    output = worker.generate(prompt_batch(), SamplingParams(max_tokens=4), 7)
    assert output["responses"].shape == (2, 4)
    assert events.count("unshard") > 0 and events.count("unshard") == events.count("reshard")
    assert (at_generate[0] > 0) == gathered_while_generating


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_offloaded_parameters_train_and_generate_like_resident_ones(tiny_model_dir, lora_rank):
    """actor.param_offload (FSDP's CPU offload; with LoRA too): the same update and the same samples from the
    native engine, which copies the weights at wake-up onto the worker's device, not the parameters' (the CPU
    between phases on a GPU machine)."""
    batch = prompt_batch().repeat(2, interleave=True)
    results = []
    for offload in (False, True):
        config = make_config(tiny_model_dir)
        config.rollout.name = "native"
        config.actor.param_offload = offload
        config.model.lora.rank = lora_rank
        worker = ActorRolloutWorker(config, total_training_steps=2)
        assert worker.rollout_engine.device == worker.device
        metrics = worker.update_actor(scored_batch())
        results.append((metrics["actor/grad_norm"], worker.generate(batch, SamplingParams(max_tokens=6), 7)))
    (norm, resident), (offloaded_norm, offloaded) = results
    assert offloaded_norm == pytest.approx(norm, rel=1e-5)
    assert torch.equal(resident["responses"], offloaded["responses"])
    torch.testing.assert_close(resident["rollout_log_probs"], offloaded["rollout_log_probs"])


@pytest.mark.parametrize("rollout_name", ["hf", "native"])
def test_a_batch_of_no_prompts_gets_no_responses_without_waking_the_engine(tiny_model_dir, monkeypatch, rollout_name):
    from torch.distributed.fsdp import FSDPModule

    config = make_config(tiny_model_dir)
    config.rollout.name = rollout_name
    worker = ActorRolloutWorker(config, total_training_steps=1)
    monkeypatch.setattr(rollout_side, "world_size", lambda: 2)  # the gathering path of several devices
    calls: list[str] = []
    unshard = FSDPModule.unshard
    monkeypatch.setattr(FSDPModule, "unshard", lambda self, *a, **k: (calls.append("unshard"), unshard(self, *a, **k))[1])
    for name in ("sync_weights", "wake_up", "generate", "sleep"):
        method = getattr(worker.rollout_engine, name)
        monkeypatch.setattr(worker.rollout_engine, name, lambda *a, _name=name, _method=method, **k: (
            calls.append(_name), _method(*a, **k))[1])
    output = worker.generate(prompt_batch().index(slice(0, 0)), SamplingParams(max_tokens=4), 7)
    assert calls == []
    assert output["responses"].shape == (0, 4) and output["input_ids"].shape == (0, 10)
    assert not any(name.startswith("rollout/") for name in output.meta["rollout_metrics"])



def test_a_share_of_padding_alone_takes_part_in_the_gather_of_the_weights_and_generates_nothing(tiny_model_dir,
                                                                                               monkeypatch):
    """Rows that leave the last member padding alone: it samples nothing, but still joins the gather of the sharded
    weights, a collective every member of several devices must join (the others would wait for it forever)."""
    from torch.distributed.fsdp import FSDPModule

    from reinforge.controller.dispatch import PADDING_ROWS

    config = make_config(tiny_model_dir)
    config.rollout.name = "native"
    worker = ActorRolloutWorker(config, total_training_steps=1)
    monkeypatch.setattr(rollout_side, "world_size", lambda: 2)
    calls: list[str] = []
    unshard = FSDPModule.unshard
    monkeypatch.setattr(FSDPModule, "unshard", lambda self, *a, **k: (calls.append("unshard"), unshard(self, *a, **k))[1])
    generate = worker.rollout_engine.generate
    monkeypatch.setattr(worker.rollout_engine, "generate", lambda requests: (calls.append("generate"),
                                                                             generate(requests))[1])
    share = prompt_batch()
    share.meta[PADDING_ROWS] = len(share)
    output = worker.generate(share, SamplingParams(max_tokens=4), 7)
    assert "unshard" in calls and "generate" not in calls
    assert output["responses"].shape == (2, 4) and output["response_mask"].sum() == 0

def test_a_failed_rollout_raises_its_own_error_and_the_next_one_runs(tiny_model_dir, monkeypatch):
    config = make_config(tiny_model_dir)
    config.rollout.name = "native"
    worker = ActorRolloutWorker(config, total_training_steps=1)
    batch = prompt_batch()
    decode = worker.rollout_engine.runner.decode

    def failing_decode(*args, **kwargs):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(worker.rollout_engine.runner, "decode", failing_decode)
    with pytest.raises(RuntimeError, match="decode failed"):  # not "sleep() was called while requests ..."
        worker.generate(batch, SamplingParams(max_tokens=6), 7)
    monkeypatch.setattr(worker.rollout_engine.runner, "decode", decode)
    assert worker.generate(batch, SamplingParams(max_tokens=6), 7)["responses"].shape == (2, 6)


def test_a_prompts_samples_split_over_members_are_the_samples_of_one_member(tiny_model_dir):
    """Three samples of each prompt over three members (two rows each, as DP_COMPUTE splits them): a prompt's
    third sample, first on its member, is still its third sample, not a repeat of its first."""
    from reinforge.protocol import Batch, samples_of

    worker = ActorRolloutWorker(make_config(tiny_model_dir), total_training_steps=1)
    batch = samples_of(prompt_batch(), 3)
    sampling = SamplingParams(max_tokens=6, temperature=1.0)
    whole = worker.generate(batch, sampling, 7)["responses"]
    split = Batch.concat_unpadded([worker.generate(chunk, sampling, 7) for chunk in batch.split(3)])["responses"]
    assert torch.equal(split, whole)
    assert len({tuple(row) for row in whole[:3].tolist()}) == 3  # the samples of one prompt differ


def test_validation_samples_past_the_engine_sized_for_a_step_are_generated(tiny_model_dir):
    """The planner sizes the native engine for one device's samples of a step (1 prompt x rollout.n=2: two sequence
    slots); a validation of rollout.val_kwargs.n=5 asks for five samples of each prompt, which run in groups."""
    from reinforge.protocol import samples_of

    config = make_config(tiny_model_dir)
    config.rollout.name, config.data.train_batch_size, config.rollout.n = "native", 1, 2
    worker = ActorRolloutWorker(config, total_training_steps=1)
    assert worker.rollout_engine.max_num_seqs == 2
    responses = worker.generate(samples_of(prompt_batch(), 5), SamplingParams(max_tokens=6, temperature=1.0), 7)
    assert responses["responses"].shape == (10, 6)
    assert len({tuple(row) for row in responses["responses"][:5].tolist()}) > 1  # each sample its own


def test_weights_for_a_separate_rollout_keep_the_routers_transformers_keeps_in_float32():
    """A DeepSeek actor in bfloat16 hands the rollout worker its weights in bfloat16, but for the router weights,
    which transformers (and the rollout copy, ``cast_as_loaded``) keeps in float32: rounded, they route otherwise."""
    import copy

    from reinforge.engine.fsdp import shard_model
    from reinforge.models.tiny import build_tiny_causal_lm

    plain = build_tiny_causal_lm("deepseek_v3", vocab_size=64, seed=8)
    rollout_copy = rollout_side.rollout_copy_of(plain, torch.bfloat16)
    sharded = shard_model(copy.deepcopy(plain), torch.device("cpu"), "bfloat16")
    weights = rollout_side.full_weights_on_cpu(sharded, torch.bfloat16, rank=0, lora_scale=None)
    assert weights.keys() == dict(rollout_copy.named_parameters()).keys()
    for name, parameter in rollout_copy.named_parameters():
        assert weights[name].dtype == parameter.dtype == (torch.float32 if name.endswith("gate.weight")
                                                          else torch.bfloat16), name
        torch.testing.assert_close(weights[name], plain.get_parameter(name).to(parameter.dtype), atol=0, rtol=0)


@pytest.mark.parametrize(("arch", "dtype"), [("gpt_oss", torch.float16), ("gpt_oss", torch.bfloat16),
                                             ("deepseek_v3", torch.float16), ("deepseek_v3", torch.bfloat16)])
def test_the_rollout_copy_keeps_in_float32_what_transformers_keeps_loading_in_its_dtype(tmp_path, arch, dtype):
    """transformers keeps ``_keep_in_fp32_modules_strict`` (DeepSeek's routers) in float32 in float16 and bfloat16,
    and ``_keep_in_fp32_modules`` (gpt-oss's norms) in float16 only: the rollout copy, the weights a separate rollout
    gets and FSDP's float32 units are the parameters of the model it loads."""
    import copy

    from transformers import AutoModelForCausalLM

    from reinforge.engine.fsdp import float32_units
    from reinforge.models import save_hf_folder
    from reinforge.models.tiny import build_tiny_causal_lm

    plain = build_tiny_causal_lm(arch, vocab_size=64, seed=8)
    loaded = AutoModelForCausalLM.from_pretrained(save_hf_folder(plain, None, tmp_path / "hf"), dtype=dtype)
    expected = {name: parameter.dtype for name, parameter in loaded.named_parameters()}
    assert (torch.float32 in expected.values()) == (arch == "deepseek_v3" or dtype == torch.float16)
    rollout_copy = rollout_side.rollout_copy_of(plain, dtype)
    assert {name: parameter.dtype for name, parameter in rollout_copy.named_parameters()} == expected
    weights = rollout_side.full_weights_on_cpu(copy.deepcopy(plain), dtype, rank=0, lora_scale=None)
    assert {name: weight.dtype for name, weight in weights.items()} == expected
    kept = {f"{prefix}.{name}" for unit in float32_units(plain, dtype) for prefix, module in plain.named_modules()
            if module is unit for name, _ in module.named_parameters()}
    assert kept == {name for name, parameter_dtype in expected.items() if parameter_dtype == torch.float32}


def test_the_native_engines_counts_add_up_over_the_members(tiny_model_dir):
    """Two members generate half the samples each: the group's rollout/num_generated_tokens is the one member's count
    of the whole batch, not the members' mean."""
    from reinforge.controller.dispatch import collect_results, plan_member_calls
    from reinforge.controller.register import Dispatch, Execute, MethodSpec
    from reinforge.protocol import samples_of

    config = make_config(tiny_model_dir)
    config.rollout.name = "native"
    worker = ActorRolloutWorker(config, total_training_steps=1)
    batch, sampling, spec = samples_of(prompt_batch(), 2), SamplingParams(max_tokens=6), MethodSpec(Dispatch.DP_COMPUTE,
                                                                                                   Execute.ALL)
    whole = worker.generate(batch, sampling, 7)
    plan = plan_member_calls(spec, "generate", 2, (batch, sampling, 7), {})
    merged = collect_results(spec, plan, "generate", [worker.generate(*args) for args, _ in plan.member_arguments])
    assert torch.equal(merged["responses"], whole["responses"])
    count = whole.meta["rollout_metrics"]["rollout/num_generated_tokens"]
    assert count == float(whole["response_mask"].sum()) > 0
    assert merged.meta["rollout_metrics"]["rollout/num_generated_tokens"] == count


@pytest.mark.parametrize("rows, members", [(5, 2), (4, 3)])
def test_the_padding_rows_are_not_generated_and_count_nowhere(tiny_model_dir, monkeypatch, rows, members):
    """Rows that do not split evenly (a share of padding and real rows, or of padding alone): the engines sample the
    batch's rows alone, so the group's rollout/num_generated_tokens and the sequences its decode steps ran
    (rollout/num_decode_rows) are one member's counts of the rows, and a share of padding alone reports no engine
    work."""
    from reinforge.controller.dispatch import collect_results, plan_member_calls
    from reinforge.controller.register import Dispatch, Execute, MethodSpec
    from reinforge.protocol import samples_of

    config = make_config(tiny_model_dir)
    config.rollout.name = "native"
    worker = ActorRolloutWorker(config, total_training_steps=1)
    batch, sampling = samples_of(prompt_batch(), 3).index(slice(0, rows)), SamplingParams(max_tokens=6)
    spec = MethodSpec(Dispatch.DP_COMPUTE, Execute.ALL)
    whole = worker.generate(batch, sampling, 7)
    plan = plan_member_calls(spec, "generate", members, (batch, sampling, 7), {})
    assert plan.num_padding > 0
    sampled: list[int] = []
    generate = worker.rollout_engine.generate
    monkeypatch.setattr(worker.rollout_engine, "generate", lambda requests: (
        sampled.append(sum(request.sampling.n for request in requests)), generate(requests))[1])
    shares = [worker.generate(*args) for args, _ in plan.member_arguments]
    merged = collect_results(spec, plan, "generate", shares)
    assert torch.equal(merged["responses"], whole["responses"]) and sum(sampled) == rows
    assert all(len(share) == plan.chunk_size for share in shares)
    counts, merged_counts = whole.meta["rollout_metrics"], merged.meta["rollout_metrics"]
    for name in ("rollout/num_generated_tokens", "rollout/num_decode_rows"):
        assert merged_counts[name] == counts[name] > 0
    assert counts["rollout/num_generated_tokens"] == float(whole["response_mask"].sum())
    if rows <= plan.chunk_size * (members - 1):
        assert not any(name.startswith("rollout/") for name in shares[-1].meta["rollout_metrics"])
