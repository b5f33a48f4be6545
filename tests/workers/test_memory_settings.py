"""The plan of a config: rollout.gpu_memory_utilization sizes the native engine's cache, and the table says where
each setting comes from."""

import json
import sys
from pathlib import Path

import pytest

from reinforge.engine.memory_plan import GiB, MemoryPlanError
from reinforge.workers.memory_settings import memory_plan

sys.path.insert(0, str(Path(__file__).parents[1]))
from plan_configs import QWEN25_1_5B, standard_config  # noqa: E402


@pytest.fixture
def config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_1_5B))
    config = standard_config(tmp_path)  # long responses: 128 sequences, where the engine could hold 512
    config.data.train_batch_size, config.data.max_response_length, config.trainer.host_memory_gib = 16, 8192, 500.0
    return config


def test_the_cache_fills_the_fraction_and_a_kept_cache_counts_in_the_update(config):
    """The plan counted a cache of the step's 128 sequences (28.5 GiB) where the engine takes what 0.9 of the device
    leaves (102 GiB), and an update beside a kept cache had that much less than planned."""
    config.rollout.gpu_memory_utilization = 0.9
    plan = memory_plan(config)
    rollout, update = plan.phases["rollout"], plan.phases["update"]
    assert rollout["kv cache"] > 100 * GiB
    assert sum(rollout.values()) == pytest.approx(0.9 * 139 * GiB)
    assert plan.fits and not plan.settings.keep_rollout_memory and "kv cache" not in update
    config.rollout.free_cache_engine = False  # kept: the update runs beside the whole cache
    kept = memory_plan(config).phases
    assert kept["update"]["kv cache"] == kept["rollout"]["kv cache"] > 100 * GiB
    config.rollout.free_cache_engine = "auto"
    assert "rollout.kv_cache_gib                 " f"{rollout['kv cache'] / GiB:.1f}" in plan.table()
    assert "(rollout.gpu_memory_utilization=0.9)" in plan.table()
    config.rollout.gpu_memory_utilization = None  # the planner's own size: every sequence at full length
    assert memory_plan(config).phases["rollout"]["kv cache"] < 30 * GiB


def test_a_fraction_that_leaves_no_cache_or_more_than_the_device_is_refused_naming_it(config):
    config.rollout.gpu_memory_utilization = 0.05
    with pytest.raises(MemoryPlanError, match=r"^rollout.gpu_memory_utilization=0.05 leaves 0.00 GiB for the KV cache "
                                              r".* less than one sequence of .* = 8320 tokens .*; raise it, or leave it "
                                              r"null"):
        memory_plan(config)
    config.rollout.gpu_memory_utilization, config.trainer.gpu_memory_gib = 1.0, 80.0  # no room for the overhead
    with pytest.raises(MemoryPlanError, match=r"it would fit with rollout.gpu_memory_utilization=null"):
        memory_plan(config)


def test_the_table_marks_what_the_run_fixes_apart_from_what_the_user_set(config):
    """The hf engine's freed memory read '(set)' in a table of a run that set nothing."""
    config.rollout.name, config.data.max_response_length = "hf", 512
    table = memory_plan(config).table()
    assert "rollout.free_cache_engine            True       (fixed)" in table
    assert "(set)" not in table
    config.rollout.free_cache_engine = True
    assert "rollout.free_cache_engine            True       (set)" in memory_plan(config).table()


GPT2_SMALL = dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024)
"""A model the native engine has no table entry for: rollout.name=native rolls it out with the hf backend."""


@pytest.mark.parametrize("engine, sizes", [
    ("hf", QWEN25_1_5B),
    ("native", GPT2_SMALL),
    ("native", dict(QWEN25_1_5B, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),  # the engine's rope refused
])
def test_an_fp8_cache_is_counted_in_the_model_dtype_where_the_native_engine_does_not_run(config, engine, sizes):
    """The hf backend, also where rollout.name=native falls back to it, keeps its cache in the model dtype; the plan
    halved it for rollout.kv_cache_dtype=fp8, and kept it between rollouts (free_cache_engine=False)."""
    Path(config.model.path, "config.json").write_text(json.dumps(sizes))
    config.rollout.name = engine
    kv_cache = {}
    for dtype in ("auto", "fp8"):
        config.rollout.kv_cache_dtype = dtype
        plan = memory_plan(config)
        kv_cache[dtype] = plan.phases["rollout"]["kv cache"]
        assert "rollout.free_cache_engine            True       (fixed)" in plan.table()
    assert kv_cache["fp8"] == kv_cache["auto"] > 20 * GiB
    Path(config.model.path, "config.json").write_text(json.dumps(QWEN25_1_5B))
    config.rollout.name = "native"  # the native engine's fp8 cache: a byte a value and its scales
    assert memory_plan(config).phases["rollout"]["kv cache"] < 0.6 * kv_cache["auto"]


PHI3_MINI = dict(model_type="phi3", vocab_size=32064, hidden_size=3072, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, intermediate_size=8192, tie_word_embeddings=False)
DEEPSEEK_V2_LITE = dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_hidden_layers=27,
                        num_attention_heads=16, num_key_value_heads=16, intermediate_size=10944,
                        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False)


@pytest.mark.parametrize("sizes, targets, adapters", [
    # rank 16 x (in + out) of qkv_proj, o_proj, gate_up_proj, down_proj, 32 layers
    (PHI3_MINI, ("o_proj", "down_proj", "qkv_proj", "gate_up_proj"),
     32 * 16 * ((3072 + 3 * 3072) + 2 * 3072 + (3072 + 2 * 8192) + (8192 + 3072))),
    # q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj on 27 layers; the dense first MLP and 26 shared experts of 2816
    (DEEPSEEK_V2_LITE, ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
     27 * 16 * ((2048 + 16 * 192) + (2048 + 576) + (512 + 16 * 256) + 2 * 2048)
     + 3 * 16 * (2048 + 10944) + 26 * 3 * 16 * (2048 + 2816)),
])
def test_default_adapters_are_counted_on_the_familys_own_projections(tmp_path, sizes, targets, adapters):
    """The load puts Phi-3's fused and DeepSeek's latent projections in place of the default targets; the plan
    counted Llama-style q_proj ... down_proj instead (Phi-3's fused layers none, DeepSeek's kv_a and kv_b none)."""
    from reinforge.engine.memory_plan import ModelShape, lora_params
    from reinforge.workers.memory_settings import run_shape

    (tmp_path / "config.json").write_text(json.dumps(sizes))
    config = standard_config(tmp_path)
    config.model.lora.rank = 16
    run, shape = run_shape(config), ModelShape.from_hf_config(sizes)
    assert tuple(name for name in run.lora_targets if lora_params(shape, 16, (name,))) == targets  # those it has
    assert lora_params(shape, 16, run.lora_targets) == adapters
    config.model.lora.target_modules = ["o_proj"]  # targets given: kept as given
    assert run_shape(config).lora_targets == ("o_proj",)


def test_a_run_that_sets_every_memory_setting_still_refuses_a_cache_that_holds_no_sequence(config):
    """Train planned nothing when no memory setting was auto, so a rollout.kv_cache_gib or gpu_memory_utilization
    that leaves no room for one sequence passed (``reinforge plan`` refused it) and failed in the first rollout."""
    from reinforge.workers.memory_settings import SETTING_KEYS, apply_memory_plan, config_values

    planned = memory_plan(config)
    for key, value in config_values(planned.settings, *_shapes(config)).items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    assert apply_memory_plan(config) is None  # nothing left to plan, and the cache holds the step
    config.rollout.kv_cache_gib = 0.01
    with pytest.raises(MemoryPlanError, match=r"^rollout.kv_cache_gib=0.01 cannot hold one sequence"):
        apply_memory_plan(config)
    config.rollout.kv_cache_gib, config.rollout.gpu_memory_utilization = 1.0, 0.05
    with pytest.raises(MemoryPlanError, match=r"^rollout.gpu_memory_utilization=0.05 leaves 0.00 GiB"):
        apply_memory_plan(config)
    config.rollout.name = "hf"  # the hf backend reads neither
    assert apply_memory_plan(config) is None and all(
        getattr(getattr(config, key.split(".")[0]), key.split(".")[1]) != "auto" for key in SETTING_KEYS.values())


def test_every_setting_given_past_the_device_is_warned_of_in_one_line(config, caplog):
    """reinforge plan refuses settings whose estimate is past the device; train, planning nothing, said nothing."""
    from reinforge.workers.memory_settings import apply_memory_plan, config_values

    planned = memory_plan(config)
    for key, value in config_values(planned.settings, *_shapes(config)).items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    with caplog.at_level("WARNING"):
        apply_memory_plan(config)
    assert not caplog.records  # the planner's own choice fits
    config.actor.max_tokens_per_micro_batch, config.model.gradient_checkpointing = 10**6, False
    with caplog.at_level("WARNING"):
        apply_memory_plan(config)
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith("every memory setting is given, and the memory plan estimates their update at ")
    assert "the run may run out of memory; `reinforge plan` with these settings names the largest consumers" in line


def _shapes(config):
    from reinforge.engine.memory_plan import ModelShape
    from reinforge.workers.memory_settings import run_shape

    return ModelShape.from_model_path(config.model.path), run_shape(config)


def test_a_critic_of_its_own_model_is_counted_by_its_sizes_and_a_missing_one_names_its_key(config, tmp_path):
    """A critic at critic.model_path was counted as a copy of the policy (a 7B critic beside a 1.5B policy planned
    as 1.5B's 16 bytes a parameter, and a missing folder passed); critic.optimizer_offload moved nothing."""
    from reinforge.engine.memory_plan import ModelShape, reward_model_params

    big = tmp_path / "critic"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({**QWEN25_1_5B, "hidden_size": 3584, "num_attention_heads": 28,
                                                 "num_key_value_heads": 4, "intermediate_size": 18944}))
    config.algorithm.adv_estimator = "gae"
    own = memory_plan(config).phases["update"]["critic"]
    assert own == 16 * reward_model_params(ModelShape.from_model_path(config.model.path))
    config.critic.model_path = str(big)
    critic = reward_model_params(ModelShape.from_model_path(str(big)))
    assert memory_plan(config).phases["update"]["critic"] == 16 * critic > 4 * own
    config.critic.optimizer_offload = True
    plan = memory_plan(config)
    assert plan.phases["update"]["critic"] == 8 * critic and plan.host["critic"] == 12 * critic
    config.critic.optimizer_offload, config.trainer.gpu_memory_gib = False, 80.0
    with pytest.raises(MemoryPlanError, match=r"critic \d+\.\d GiB.*it would fit with critic.optimizer_offload=true"):
        memory_plan(config)
    config.critic.model_path = str(tmp_path / "missing")
    with pytest.raises(MemoryPlanError, match=r"so critic.model_path must be a model folder"):
        memory_plan(config)


def test_the_host_holds_what_every_process_of_its_machine_offloads(config):
    """Each of a machine's processes offloads its own shard, and the plan compared one process's share with the whole
    host: two processes of a machine offloading 9 GiB each planned as fitting in 18 GiB of host memory."""
    from reinforge.engine.memory_plan import ModelShape

    params = ModelShape.from_model_path(config.model.path).num_params
    config.trainer.backend, config.trainer.devices_per_node, config.actor.optimizer_offload = "ray", 2, True
    host = memory_plan(config).host
    assert host["optimizer state"] == 8 * params and host["master copy"] == 4 * params  # two shares of half each
    config.trainer.host_memory_gib = 18.0
    with pytest.raises(MemoryPlanError, match=r"needs 18.3 GiB of host memory but 16.9 GiB are usable"):
        memory_plan(config)


def test_train_plans_for_the_card_where_trainer_gpu_memory_gib_asks_for_more(config, monkeypatch, caplog):
    """trainer.gpu_memory_gib=139 on a 40 GiB card planned settings for 139 GiB, which the card cannot hold; reinforge
    plan still answers for the card it names, on any machine."""
    import torch

    from reinforge.engine.memory_plan import HEADROOM
    from reinforge.workers.memory_settings import apply_memory_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GiB, 40 * GiB))
    assert memory_plan(config).gpu_budget == 139 * GiB * HEADROOM  # reinforge plan: the card it is asked about
    with caplog.at_level("WARNING"):
        plan = apply_memory_plan(config, log=False)
    assert plan.gpu_budget == 40 * GiB * HEADROOM and plan.fits
    assert "trainer.gpu_memory_gib=139 is more than the 40.0 GiB of this process's GPU" in caplog.text


def test_a_cpu_run_with_a_memory_cap_is_planned_in_float32_and_eager_layers(config):
    """trainer.gpu_memory_gib on a CPU run (trainer.device=cpu) planned it as a GPU's: bf16 and compiled layers' few
    activations, a third of what the CPU's float32 eager layers keep."""
    from reinforge.workers.memory_settings import run_shape

    config.trainer.device, config.trainer.gpu_memory_gib = "cpu", 64.0
    assert (run_shape(config).dtype_bytes, run_shape(config).eager) == (4, True)
    config.trainer.device = "auto"  # no GPU here: the size names the card it plans for
    assert (run_shape(config).dtype_bytes, run_shape(config).eager) == (2, False)


def test_the_critics_update_counts_its_own_models_activations(config, tmp_path):
    """A critic wider than the policy (critic.model_path) was planned with the policy's activations, whose update
    it does not run beside: its own update keeps its own widths' activations."""
    from reinforge.engine.memory_plan import ModelShape, micro_batch_split
    from reinforge.workers.memory_settings import run_shape

    wide = tmp_path / "critic"
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps({**QWEN25_1_5B, "hidden_size": 3584, "num_attention_heads": 28,
                                                  "num_key_value_heads": 4, "intermediate_size": 18944}))
    config.algorithm.adv_estimator, config.critic.model_path = "gae", str(wide)
    config.critic.optimizer_offload, config.model.gradient_checkpointing = True, False
    config.critic.max_tokens_per_micro_batch = 8192
    critic, run = ModelShape.from_model_path(str(wide)), run_shape(config)
    phase = memory_plan(config).phases["critic update"]
    _, tokens = micro_batch_split(run, 8192)
    assert phase["critic activations"] == tokens * (28 * critic.activation_bytes_per_token(2) + 4 * 3584 * 2)
    assert "logits" not in phase and phase["critic"] == 8 * (critic.num_params + 3584)  # tied: no head, one output


def test_the_kv_cache_holds_one_sequence_of_the_judges_own_model(config, tmp_path):
    """The judge's engine takes rollout.kv_cache_gib too: a small step's planned cache (1 sequence of 640 tokens of
    the 1.5B's) could not hold one judge sequence of a wider model, and the judge failed in its first generation."""
    from reinforge.workers.memory_settings import apply_memory_plan

    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text(json.dumps({**QWEN25_1_5B, "num_key_value_heads": 12}))  # 6 x 1.5B's KV
    config.data.train_batch_size, config.rollout.n, config.data.max_response_length = 1, 1, 512
    config.reward.judge.enable, config.reward.judge.model_path = True, str(judge)
    config.reward.judge.template = "{prompt} {response}"
    needed = 28 * 2 * 12 * 128 * 2 * 16 * -(-(2048 + 256 + 1) // 16) / GiB  # the judge's 2,304 tokens, in blocks
    apply_memory_plan(config, log=False)
    assert needed <= config.rollout.kv_cache_gib < needed + 0.01
    config.rollout.kv_cache_gib = 0.05  # set: refused before any model loads
    with pytest.raises(MemoryPlanError, match=r"^rollout.kv_cache_gib=0.05, which the judge's engine takes too, "
                                              r"cannot hold one judge sequence of .* = 2304 tokens"):
        apply_memory_plan(config)


def test_cpu_processes_of_one_machine_plan_for_their_share_of_its_memory(config, monkeypatch):
    """Each of a machine's CPU processes planned for the whole host's memory, which they all use at once."""
    from reinforge.workers import memory_settings

    monkeypatch.setattr(memory_settings, "host_memory_bytes", lambda: 64 * GiB)
    config.trainer.device, config.trainer.gpu_memory_gib = "cpu", None
    assert memory_settings.device_memory_bytes(config) == 64 * GiB
    config.trainer.backend, config.trainer.devices_per_node = "ray", 4
    assert memory_settings.device_memory_bytes(config) == 16 * GiB


def test_async_between_syncs_plans_the_hosts_copy_of_the_rollouts_weights(config):
    """A validation or a checkpoint between two syncs (trainer.trigger_sync_steps > 1) copies the rollout's weights
    to the host, and the plan did not count them: a host too small for them was planned as fitting."""
    config.trainer.mode, config.trainer.host_memory_gib = "async", 3.0
    assert "rollout weights between syncs" not in memory_plan(config).host  # a sync after every update
    config.trainer.trigger_sync_steps = 2
    with pytest.raises(MemoryPlanError, match=r"needs 2.9 GiB of host memory but 2.8 GiB are usable \(rollout weights "
                                              r"between syncs 2.9 GiB\).* or trainer.trigger_sync_steps=1"):
        memory_plan(config)


def test_prefill_chunks_longer_than_the_engines_step_count_in_the_rollouts_activations(config):
    """rollout.max_prefill_chunk_tokens=32768 prefills a long prompt, or a preempted 8k sample, in one forward of up
    to the whole sequence (8,320 tokens here, under the engine's 16,384-token step) or of a 32k one: the plan sized
    the engine's activations for 16,384 tokens whatever the chunk."""
    per_token = (4 * QWEN25_1_5B["intermediate_size"] + 8 * QWEN25_1_5B["hidden_size"]) * 2
    default = memory_plan(config).phases["rollout"]["rollout activations"]
    config.rollout.max_prefill_chunk_tokens = 32768
    assert memory_plan(config).phases["rollout"]["rollout activations"] == default  # no 8k sequence is longer
    config.data.train_batch_size, config.data.max_response_length = 8, 32768
    assert memory_plan(config).phases["rollout"]["rollout activations"] == pytest.approx(default + 16384 * per_token)
    config.rollout.max_prefill_chunk_tokens = 4096  # smaller forwards than the step: the step's still counts
    assert memory_plan(config).phases["rollout"]["rollout activations"] == default
