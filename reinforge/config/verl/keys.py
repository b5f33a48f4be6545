"""verl's configuration keys and what each becomes in reinforge: the one table of the translation.

``VERL_KEYS`` maps a key of verl's ``ppo_trainer.yaml`` (as written on its Hydra command line)
to a ``Rename`` (our key, a value conversion, and verl's default where it differs from ours in a
way that changes the run) or to a ``NoEquivalent`` with the reason. A key ending in ``.*`` covers
every key below it; the exact key wins over a covering one. ``reinforge.config.verl.translate``
reads this table, and so does the "did you mean" of ``reinforge.config.loader`` (through ``translate.verl_hint``).

A conversion gets the value and every verl key given (for keys that only mean something
together); it returns our value, ``UNSET`` when the value leaves our default alone, or raises
``NoEquivalentValue`` when this value (not the key) has no counterpart. ``SameAsOurs`` marks a
setting whose usual values are what reinforge always does (strategy=fsdp, lora_rank=0).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from reinforge.config.schema import TRUNCATION_MODES

UNSET = object()
"""A conversion's answer when the verl value means "use the default" (-1, None, fsdp, ...)."""

_MISSING = object()


class NoEquivalentValue(Exception):
    """This value of a verl key has no counterpart here; the message says why."""


class RefusedValue(Exception):
    """This value of a verl key would make the run something else than the command asks; the message says the fix."""


def _same(value: Any, given: Mapping[str, Any]) -> Any:
    return value


@dataclass(frozen=True)
class Rename:
    ours: str
    """Our dotted key; a trailing ``.*`` takes the rest of the verl key along (reward.kwargs.*)."""
    convert: Callable[[Any, Mapping[str, Any]], Any] = _same
    verl_default: Any = _MISSING
    """verl's default, carried over when a command leaves the key out and it differs from ours."""
    note: str | Callable[[Any, Mapping[str, Any]], str] = ""
    """Printed beside the translation when the meaning differs in a detail (or a function of the value and the keys
    given that returns it, "" for none)."""

    @property
    def has_verl_default(self) -> bool:
        return self.verl_default is not _MISSING


@dataclass(frozen=True)
class NoEquivalent:
    reason: str


@dataclass(frozen=True)
class SameAsOurs:
    """A verl setting whose ``values`` are what reinforge always does; any other value has no equivalent."""
    values: tuple[Any, ...]
    reason: str


@dataclass(frozen=True)
class Refused(SameAsOurs):
    """A verl setting whose ``values`` are what reinforge does; any other value would change what the run computes
    and reinforge cannot do it, so the translation stops with one line naming the key (nothing dropped silently)."""


class _EveryValue(tuple):
    """``values`` of a setting that leaves the result as reinforge computes it whatever its value (a detail of
    verl's engines or sharding)."""

    def __contains__(self, value: object) -> bool:
        return True


EVERY_VALUE = _EveryValue()

Translation = Rename | NoEquivalent | SameAsOurs

# ---- value conversions ------------------------------------------------------------------


def _unset_if(*defaults: Any) -> Callable[[Any, Mapping[str, Any]], Any]:
    """The value as it is, unless it is one of verl's "not set" markers (-1, None, ...)."""
    def convert(value: Any, given: Mapping[str, Any]) -> Any:
        return UNSET if value in defaults else value
    return convert


def _epochs_unless_steps_given(value: Any, given: Mapping[str, Any]) -> Any:
    """verl's default of 30 epochs is not carried over when the command gives total_training_steps: the run's length
    is that number of steps."""
    if "trainer.total_epochs" not in given and given.get("trainer.total_training_steps") is not None:
        return UNSET
    return value


def _only_if_true(value: Any, given: Mapping[str, Any]) -> Any:
    return True if value is True else UNSET


def _path(value: Any, given: Mapping[str, Any]) -> Any:
    """A path with ``~`` expanded, as verl does (its defaults start with ~/)."""
    if value is None:
        return UNSET
    return os.path.expanduser(value) if isinstance(value, str) else value


VERL_PROJECT_NAME, VERL_EXPERIMENT_NAME = "verl_examples", "gsm8k"
VERL_LOCAL_DIR = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
"""verl's trainer.default_local_dir: its checkpoints (and here the whole run folder) go under the run's names."""


def _local_dir(value: Any, given: Mapping[str, Any]) -> Any:
    """verl's checkpoint folder with its ``${trainer.project_name}``/``${trainer.experiment_name}`` resolved."""
    if value is None:
        return UNSET
    names = {"trainer.project_name": given.get("trainer.project_name", VERL_PROJECT_NAME),
             "trainer.experiment_name": given.get("trainer.experiment_name", VERL_EXPERIMENT_NAME)}
    for key, name in names.items():
        value = str(value).replace("${" + key + "}", str(name))
    return _path(value, given)


DATA_CONVERTERS = {"retool": "reinforge data retool --src GSM8K_DIR --out DIR",
                   "gsm8k": "reinforge data gsm8k --src GSM8K_DIR --out DIR"}


def _custom_dataset(value: Any, given: Mapping[str, Any]) -> Any:
    """verl's own dataset class builds the prompts from raw rows: here the rows are converted once, beforehand."""
    if value is None:
        return UNSET
    kind = next((name for name in DATA_CONVERTERS if name in str(value).lower()), None)
    run = (f"convert the data with `{DATA_CONVERTERS[kind]}`" if kind else
           f"convert the data to reinforge's rows (`{DATA_CONVERTERS['retool']}` for ReTool, "
           f"`{DATA_CONVERTERS['gsm8k']}` for GSM8K, or rows with prompt, data_source, reward_model, extra_info)")
    raise RefusedValue(f"is a dataset class, which reinforge does not load; {run}, pass the converted files as "
                       "data.train_files/val_files and leave data.custom_cls.* out")


def _file_list(value: Any, given: Mapping[str, Any]) -> Any:
    """verl takes one path or a list; ours is always a list."""
    if value is None:
        return UNSET
    return [_path(path, given) for path in ([value] if isinstance(value, str) else value)]


def _lora_targets(value: Any, given: Mapping[str, Any]) -> Any:
    """verl's all-linear is our default list (every linear layer of a decoder block)."""
    if value in ("all-linear", None):
        return UNSET
    return [value] if isinstance(value, str) else list(value)


def _lora_exclusions(value: Any, given: Mapping[str, Any]) -> Any:
    """verl's exclude_modules: layers kept without an adapter. The vision tower's (verl's examples exclude
    ``.*visual.*``) is reinforge's frozen tower, which gets no adapter (and under LoRA verl's tower trains through its
    adapters only); any other exclusion would put adapters where the verl run had none."""
    names = [] if value is None else [value] if isinstance(value, str) else list(value)
    if not names:
        return UNSET
    if all(re.search("visual|vision", str(name)) for name in names) and given.get(f"{_ACTOR}.freeze_vision_tower",
                                                                                  True) is not False:
        return True  # the frozen vision tower gets no adapter (reinforge.engine.lora)
    raise RefusedValue("keeps layers without LoRA adapters; reinforge puts one on every layer that "
                       "model.lora.target_modules names (the vision tower's excepted while actor.freeze_vision_tower "
                       "is true): set actor_rollout_ref.model.target_modules to the layers that should get adapters "
                       "and leave exclude_modules out")


ADAPTER_REFUSAL = ("reinforge's LoRA starts from fresh adapters and loads none; merge the adapter into the model "
                   "(peft's merge_and_unload) and pass that folder as actor_rollout_ref.model.path, or leave the "
                   "adapter path out to start fresh")
MEGATRON_LORA_TARGETS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_q": ("q_proj",), "linear_k": ("k_proj",),
    "linear_v": ("v_proj",), "linear_proj": ("o_proj",), "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc1_gate": ("gate_proj",), "linear_fc1_up": ("up_proj",), "linear_fc2": ("down_proj",),
    "linear_q_proj": ("q_proj",), "linear_q_down_proj": ("q_a_proj",), "linear_q_up_proj": ("q_b_proj",),
    "linear_kv_down_proj": ("kv_a_proj_with_mqa",), "linear_kv_up_proj": ("kv_b_proj",),
}
"""Megatron's LoRA target names and the Hugging Face linear layers they are."""


def _megatron_lora_targets(value: Any, given: Mapping[str, Any]) -> Any:
    """verl's Megatron LoRA targets as the Hugging Face layer names; its default (every linear layer) is ours."""
    names = [value] if isinstance(value, str) else list(value or [])
    if not names or sorted(names) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]:
        return UNSET
    unknown = [name for name in names if name not in MEGATRON_LORA_TARGETS]
    if unknown:
        raise RefusedValue(f"names {', '.join(map(str, unknown))}, which reinforge cannot map to a Hugging Face layer "
                           f"(it maps {', '.join(MEGATRON_LORA_TARGETS)}); pass model.lora.target_modules=[...] "
                           "with the layers' Hugging Face names after -- and leave this key out")
    return list(dict.fromkeys(layer for name in names for layer in MEGATRON_LORA_TARGETS[name]))


def _kv_cache_dtype(value: Any, given: Mapping[str, Any]) -> Any:
    """vLLM's and SGLang's kv_cache_dtype engine argument (TensorRT-LLM's kv_cache_config.dtype): auto keeps the
    model's dtype, fp8 is float8 e4m3."""
    if value in (None, "auto"):
        return UNSET
    if value in ("fp8", "fp8_e4m3"):
        return "fp8"
    raise RefusedValue("is not a KV-cache type reinforge's engine has; it keeps the cache in the model's dtype "
                       "(auto) or in float8 e4m3 with a scale per token and KV head (fp8): pass auto or fp8")


SEQUENCE_PARALLEL_KEYS = {
    "actor": ("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
              "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
              "actor_rollout_ref.actor.megatron.context_parallel_size",
              "actor_rollout_ref.actor.veomni.ulysses_parallel_size"),
    "ref": ("actor_rollout_ref.ref.ulysses_sequence_parallel_size",
            "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size",
            "actor_rollout_ref.ref.megatron.context_parallel_size",
            "actor_rollout_ref.ref.veomni.ulysses_parallel_size"),
    "critic": ("critic.ulysses_sequence_parallel_size", "critic.model.fsdp_config.ulysses_sequence_parallel_size",
               "critic.fsdp.ulysses_sequence_parallel_size", "critic.megatron.context_parallel_size",
               "critic.veomni.ulysses_parallel_size"),
    "reward_model": ("reward_model.ulysses_sequence_parallel_size", "reward_model.megatron.context_parallel_size"),
}
"""Where verl reads each role's sequence (Ulysses) or context parallel size; the reference's defaults to the actor's."""


def _sequence_parallel_size(role: str, given: Mapping[str, Any]) -> int:
    size = next((given[key] for key in SEQUENCE_PARALLEL_KEYS[role] if given.get(key) is not None), None)
    if size is None:
        return _sequence_parallel_size("actor", given) if role == "ref" else 1
    return size if isinstance(size, int) and size > 0 else 1


def _tokens_per_device(role: str, unset: tuple[Any, ...] = ()) -> Callable[[Any, Mapping[str, Any]], Any]:
    """verl's per-GPU token budget as our micro-batch budget: verl multiplies it by the role's sequence (or context)
    parallel size, since a micro-batch is split over that many devices, and reinforge runs each sequence whole on
    one device."""
    def convert(value: Any, given: Mapping[str, Any]) -> Any:
        if value in unset:
            return UNSET
        return value * _sequence_parallel_size(role, given) if isinstance(value, int) else value
    return convert


def _generated_not_filtered(given: Mapping[str, Any]) -> bool:
    return given.get("data.gen_batch_size") is not None and given.get("algorithm.filter_groups.enable") is not True


GEN_BATCH_NOTE = ("data.gen_batch_size's: without algorithm.filter_groups verl trains on every prompt of its "
                  "generation batch")


def _prompts_per_step(value: Any, given: Mapping[str, Any]) -> Any:
    """verl's data loader hands out data.gen_batch_size prompts a step; only dynamic sampling (filter_groups) keeps
    train_batch_size of them, so without it a step trains on the whole generation batch."""
    return given["data.gen_batch_size"] if _generated_not_filtered(given) else value


def _gen_batch_size(value: Any, given: Mapping[str, Any]) -> Any:
    if value is None:
        return UNSET
    if given.get("algorithm.filter_groups.enable") is not True:
        raise NoEquivalentValue("without algorithm.filter_groups a step trains on all of its prompts, which "
                                "data.train_batch_size becomes")
    return value


VECTORIZED_ESTIMATORS = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}
"""verl's vectorized implementations of an estimator -> the estimator they compute."""


def _estimator(value: Any, given: Mapping[str, Any]) -> Any:
    return VECTORIZED_ESTIMATORS.get(value, value) if isinstance(value, str) else value


def _estimator_note(value: Any, given: Mapping[str, Any]) -> str:
    if value in VECTORIZED_ESTIMATORS:
        return f"verl's {value} computes {VECTORIZED_ESTIMATORS[value]}'s advantages"
    return ""


def _rollout_engine(value: Any, given: Mapping[str, Any]) -> Any:
    if value in ("vllm", "sglang", "trtllm"):
        return "native"
    if value == "hf":
        return "hf"
    raise NoEquivalentValue(f"rollout engine {value!r} is not one of verl's vllm, sglang, trtllm or hf")


VERL_SCHEDULES = {"constant": "constant", "cosine": "cosine"}
"""verl's learning-rate schedules, by verl's name: each is a name of ``engine.optim.LR_SCHEDULES``
(tests/config/verl/test_keys.py checks it); verl has no linear one."""


def _schedule(value: Any, given: Mapping[str, Any]) -> Any:
    if value is None:
        return UNSET
    if value in VERL_SCHEDULES:
        return VERL_SCHEDULES[value]
    raise NoEquivalentValue(f"the {value!r} schedule is not here; reinforge has {' and '.join(VERL_SCHEDULES.values())}")



VERL_LR = {"actor_rollout_ref.actor": 1e-6, "critic": 1e-5}
"""verl's learning rate of each section when the command leaves optim.lr out."""


def _megatron_schedule(value: Any, given: Mapping[str, Any]) -> Any:
    """verl's Megatron engine decays the learning rate by Megatron's lr_decay_style, not by lr_scheduler_type."""
    if value in (None, "constant"):
        return UNSET
    if value in ("cosine", "linear"):
        return value
    raise RefusedValue("is not a schedule reinforge has; it decays the learning rate after warmup as constant, cosine "
                       "or linear: pass one of them")


def _megatron_min_lr(section: str) -> Callable[[Any, Mapping[str, Any]], Any]:
    """Megatron's floor of the decay (an absolute rate) as our min_lr_ratio; a constant schedule never reaches it."""
    def convert(value: Any, given: Mapping[str, Any]) -> Any:
        style = given.get(f"{section}.optim.lr_decay_style", "constant")
        if not value or style in (None, "constant"):
            return UNSET
        if style == "cosine":
            return value / given.get(f"{section}.optim.lr", VERL_LR[section])
        raise RefusedValue(f"is where the {style} schedule ends, and reinforge's ends at 0 (its min_lr_ratio is the "
                           "cosine schedule's floor); set it to 0 or use lr_decay_style=cosine")
    return convert


def _veomni_min_lr(section: str) -> Callable[[Any, Mapping[str, Any]], Any]:
    """VeOmni's floor of the cosine schedule (an absolute rate) as our min_lr_ratio."""
    def convert(value: Any, given: Mapping[str, Any]) -> Any:
        if not value or given.get(f"{section}.optim.lr_scheduler_type", "cosine") == "constant":
            return UNSET
        return value / given.get(f"{section}.optim.lr", VERL_LR[section])
    return convert


RATIO_CLIPPED_LOSSES = ("vanilla", "cispo", "gspo", None)
"""Policy losses that clip the importance ratio to [1 - clip_ratio_low, 1 + clip_ratio_high]."""


def _clip_ratio_low(value: Any, given: Mapping[str, Any]) -> Any:
    """A lower bound at or below 0 never clips a ratio (a ratio is positive): verl's CISPO example passes 10 to
    bound the weight above only. reinforge takes at most 1, which clips just as little."""
    mode = given.get(f"{_ACTOR}.policy_loss.loss_mode")
    if isinstance(value, int | float) and value > 1 and mode in RATIO_CLIPPED_LOSSES:
        return 1.0
    return value


def _clip_low_note(value: Any, given: Mapping[str, Any]) -> str:
    if _clip_ratio_low(value, given) != value:
        return f"1 - {value} is below 0, so no ratio is clipped from below, as with 1"
    return ""


def _device(value: Any, given: Mapping[str, Any]) -> Any:
    if value in ("cuda", "cpu", "auto"):
        return value
    raise RefusedValue("is not a device reinforge trains on; it runs on CUDA GPUs (trainer.device=cuda, the default "
                       "when one is present) or the CPU: leave the key out or pass cuda")


def _truncation(value: Any, given: Mapping[str, Any]) -> Any:
    if value in TRUNCATION_MODES:
        return value
    raise NoEquivalentValue(f"truncation {value!r} is not here; use {', '.join(TRUNCATION_MODES)}")


def _resume_mode(value: Any, given: Mapping[str, Any]) -> Any:
    if value == "auto":
        return "auto"
    if value == "disable":
        return "never"
    if value == "resume_path":
        return UNSET  # trainer.resume_from_path gives the path
    raise RefusedValue("is not one of verl's resume modes auto, disable, resume_path; use one of them")


def _resume_path(value: Any, given: Mapping[str, Any]) -> Any:
    if value is None:
        return UNSET
    if given.get("trainer.resume_mode") != "resume_path":
        raise NoEquivalentValue("verl reads it only with trainer.resume_mode=resume_path")
    return value


def _loss_mode(value: Any, given: Mapping[str, Any]) -> Any:
    if value != "bypass_mode":
        return value
    if given.get("algorithm.rollout_correction.bypass_mode") is True:
        return UNSET  # verl's own choice under bypass_mode; ours follows algorithm.rollout_correction.bypass_mode
    raise NoEquivalentValue("verl's bypass loss runs with algorithm.rollout_correction.bypass_mode=true, which "
                            "selects it by itself (reinforge likewise); set that instead")


def _custom_function(value: Any, given: Mapping[str, Any]) -> Any:
    if value is None:
        return UNSET
    name = given.get("custom_reward_function.name") or given.get("reward.custom_reward_function.name")
    return f"{_path(value, given)}:{name or 'compute_score'}"


def _custom_function_name(value: Any, given: Mapping[str, Any]) -> Any:
    path = given.get("custom_reward_function.path") or given.get("reward.custom_reward_function.path")
    if path is None:
        raise NoEquivalentValue("without custom_reward_function.path verl ignores it too")
    return _custom_function(path, given)  # joined to the path: reward.custom_function=path:name


TRACKERS = {"console": "console", "file": "jsonl", "tensorboard": "tensorboard", "wandb": "wandb",
            "mlflow": "mlflow"}


def _loggers(value: Any, given: Mapping[str, Any]) -> Any:
    names = [value] if isinstance(value, str) else list(value)
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise NoEquivalentValue(f"reinforge cannot log to {', '.join(unknown)}; it logs to "
                                "console, jsonl (verl's file), tensorboard, wandb and mlflow")
    ours = [TRACKERS[name] for name in names]
    # the run folder keeps metrics.jsonl and the charts of every reinforge run
    return [*ours, *(name for name in ("jsonl", "plots") if name not in ours)]






# ---- reasons shared by many keys --------------------------------------------------------

TOKEN_BUDGET = NoEquivalent("micro-batches are formed from the token budget actor.max_tokens_per_micro_batch "
                            "(verl's ppo_max_token_len_per_gpu), and the update does not depend on the split")
DYNAMIC_BSZ = NoEquivalent("micro-batches are always balanced by tokens under actor.max_tokens_per_micro_batch, "
                           "which ppo_max_token_len_per_gpu becomes")
LOG_PROB_BUDGET = NoEquivalent("the actor's log-prob pass uses actor.max_tokens_per_micro_batch, the reference's "
                               "ref.max_tokens_per_micro_batch")
REWARD_MANAGER = Refused(("naive", "dapo", "prime", "limit", "rate_limited", "gdpo", None),
                         "reinforge's reward manager scores each sample as verl's naive one does (in "
                         "reward.num_workers processes, reward.timeout_s each); verl's batch and remote "
                         "managers call scorers another way: write a reward.custom_function")
"""verl 0.7's reward_model.reward_manager and 0.9's reward.reward_manager.name."""
ENGINE_KNOB = NoEquivalent("a setting of vLLM/SGLang; reinforge's rollout engine (rollout.name=native) runs on "
                           "each training device and sizes its batches itself")
PARALLELISM = NoEquivalent("reinforge shards every model with FSDP2 over all devices of its role and has no "
                           "tensor, sequence, expert or pipeline parallelism")
FSDP_DETAIL = NoEquivalent("an FSDP detail reinforge fixes: FSDP2, float32 master weights, bf16 compute on CUDA")
PROFILING = NoEquivalent("reinforge logs timing_s/* each step; for traces run `reinforge bench train` under "
                         "PyTorch's profiler")
MULTI_TURN = NoEquivalent("not in reinforge's agent loops (reinforge.agent: a row's agent_name column picks its "
                          "loop, rollout.multi_turn.* configures them)")
MULTIMODAL = NoEquivalent("reinforge reads a row's images from its data.image_key column (else images or image) and makes their pixels with the model's own processor as it is saved; it reads no video or audio")
CHECKPOINT_FORMAT = NoEquivalent("reinforge always saves weights, optimizer and trainer state, plus an HF "
                                 "folder, in trainer.output_dir/checkpoints")
MODEL_OVERRIDE = ("changes what the model computes (its attention window, rotary scaling, ...), and reinforge "
                  "takes the model's config from model.path; set the same key in that folder's config.json and leave "
                  "the override out")
ATTENTION_KERNEL = ("reinforge's packed passes run its own varlen attention with the model's sliding windows and "
                    "logit softcapping, computing what transformers' eager, sdpa and flash attention do")
PER_DEVICE_NOTE = "times the sequence-parallel size, as verl's micro-batch is spread over that many devices"
ALWAYS_PADDING_FREE = NoEquivalent("reinforge's passes are always padding-free (packed rows)")
COMPILE = NoEquivalent("on CUDA reinforge always compiles its decoder layers (not with gradient checkpointing)")
FROM_DATA = NoEquivalent("taken from data.max_prompt_length / data.max_response_length")
RAY_DETAIL = NoEquivalent("a detail of verl's Ray setup; see trainer.backend=ray and trainer.ray_address")
OWN_DATA_PIPELINE = NoEquivalent("reinforge's dataset reads verl-schema rows itself (parquet, JSONL, datasets "
                                 "folders) and keeps the raw chat with every prompt")
OPTIMIZER = NoEquivalent("reinforge's optimizer is torch's AdamW")
TOTAL_STEPS = NoEquivalent("the schedule's length follows trainer.total_steps / total_epochs")
FSDP2 = SameAsOurs(("fsdp", "fsdp2"), "reinforge trains with FSDP2 only")
SEEDS = NoEquivalent("reinforge seeds everything from trainer.seed and data.seed")


HYDRA_TARGET = NoEquivalent("the class Hydra builds this section with; reinforge's config is its own dataclasses")
MEGATRON = NoEquivalent("a setting of verl's Megatron backend; reinforge shards every model with FSDP2 over all "
                        "devices of its role (no tensor, pipeline, expert or context parallelism)")
QAT = NoEquivalent("reinforge has no quantization-aware training")
CHAT_TEMPLATE_KWARGS = ("reinforge renders prompts with the chat template alone, without template variables; leave "
                        "the key out where its value is the template's own default (gpt-oss's reasoning_effort=medium), "
                        "or write the prompt it asks for into a template passed as "
                        "actor_rollout_ref.model.custom_chat_template")
VEOMNI = NoEquivalent("a setting of verl's VeOmni backend; reinforge shards every model with FSDP2 over all devices "
                      "of its role (no sequence or expert parallelism)")
VERL_ENGINES = ("verl's dp (FSDP), megatron and veomni engines train the same model as reinforge's FSDP2 engine, "
                "which has none of their parallel layouts; another engine has no translation: use model_engine=dp")
DISTILLATION = NoEquivalent("reinforge has no on-policy distillation from a teacher model")
SKIP_ROLLOUT = NoEquivalent("reinforge always generates; it has no dumped-rollout replay")
SANDBOX = NoEquivalent("set the SandboxFusion address on the code tools (rollout.multi_turn.tool_config_path)")
TRAINER_V1 = NoEquivalent("verl's experimental v1 trainer; reinforge's modes are trainer.mode=sync, one_step_off "
                          "or async")
MEGATRON_LORA = NoEquivalent("a setting of verl's Megatron LoRA; reinforge's LoRA takes model.lora.rank, alpha and "
                             "target_modules (Hugging Face module names)")
MEGATRON_OPTIM = ("lr_decay_style lr_decay_steps lr_warmup_init min_lr weight_decay_incr_style lr_wsd_decay_style "
                  "lr_wsd_decay_steps use_checkpoint_opt_param_scheduler use_precision_aware_optimizer "
                  "main_grads_dtype exp_avg_dtype exp_avg_sq_dtype use_layer_wise_distributed_optimizer "
                  "muon_momentum muon_nesterov muon_split_qkv muon_scale_mode muon_coefficient_type "
                  "muon_num_ns_steps muon_tp_mode muon_fp32_matmul_prec muon_extra_scale_factor "
                  "muon_scalar_optimizer muon_match_adamw_update_rms")

# ---- the reward model: verl 0.7's reward_model section and verl 0.9's reward.reward_model ----------------------
# Every key is translated, already what reinforge does whatever its value (a detail of verl's engines), or
# refused in one line when its value would change the scores: a reward model is never dropped silently.


def _samples_as_tokens(value: Any, given: Mapping[str, Any]) -> Any:
    """verl's samples per micro-batch as our token budget: that many sequences at full length (verl's 512 + 512
    when the command leaves the lengths out); with use_dynamic_bsz verl reads forward_max_token_len_per_gpu."""
    if value is None or given.get("reward_model.use_dynamic_bsz") is True:
        return UNSET
    return int(value) * (int(given.get("data.max_prompt_length", 512)) + int(given.get("data.max_response_length", 512)))


def _dynamic_token_budget(value: Any, given: Mapping[str, Any]) -> Any:
    """verl reads forward_max_token_len_per_gpu only with use_dynamic_bsz (by default the critic's, false), times the
    reward model's sequence-parallel size."""
    dynamic = given.get("reward_model.use_dynamic_bsz", given.get("critic.use_dynamic_bsz"))
    return int(value) * _sequence_parallel_size("reward_model", given) if dynamic is True and value is not None else UNSET


def _overlong_end(value: Any, given: Mapping[str, Any]) -> Any:
    """DAPO's max_resp_len: where the overlong buffer ends, which is data.max_response_length here."""
    response_length = given.get("data.max_response_length", 512)
    if value is None:
        return UNSET
    if value == response_length:
        return value
    raise RefusedValue(f"ends the overlong buffer at {value} tokens, but reinforge ends it at "
                       f"data.max_response_length={response_length}; set the two equal")


RM_ENGINE = SameAsOurs(EVERY_VALUE, "reinforge scores with the reward model's packed forward on its worker, not through "
                                    "an inference server; the scores do not depend on this")
RM_SHARDING = SameAsOurs(EVERY_VALUE, "reinforge shards the reward model with FSDP2 over its devices; the scores do "
                                      "not depend on this")
RM_BUDGET = SameAsOurs(EVERY_VALUE, "the reward model's micro-batches are balanced by tokens under "
                                    "reward.reward_model.max_tokens_per_micro_batch")
_RM = "reward_model"
REWARD_MODEL_KEYS: dict[str, Translation] = {
    f"{_RM}.enable": Rename("reward.reward_model.enable"),
    f"{_RM}.enable_resource_pool": Rename("reward.reward_model.enable_resource_pool"),
    f"{_RM}.n_gpus_per_node": Rename("reward.reward_model.n_gpus_per_node", _unset_if(0, None)),
    f"{_RM}.nnodes": Rename("reward.reward_model.nnodes", _unset_if(0, None)),
    f"{_RM}.strategy": RM_SHARDING,
    f"{_RM}.model.path": Rename("reward.reward_model.model_path", _path),
    f"{_RM}.model.input_tokenizer": Rename("reward.reward_model.input_tokenizer", note="re-rendered only where the "
                                           "reward model's tokenizer or chat template differs from it"),
    f"{_RM}.model.trust_remote_code": Rename("reward.reward_model.trust_remote_code"),
    f"{_RM}.model.external_lib": Refused((None,), "reinforge imports no model package by name; register the reward "
                                                  "model's architecture with transformers or use trust_remote_code"),
    f"{_RM}.model.override_config": Refused(({}, None), "edit the reward model folder's config.json instead"),
    f"{_RM}.model.override_config.*": Refused((), "edit the reward model folder's config.json instead"),
    f"{_RM}.model.use_shm": SameAsOurs(EVERY_VALUE, "the reward model loads from its path directly"),
    f"{_RM}.model.use_remove_padding": SameAsOurs(EVERY_VALUE, "reinforge's reward-model passes are always "
                                                               "padding-free (packed rows)"),
    f"{_RM}.model.use_fused_kernels": SameAsOurs(EVERY_VALUE, "on CUDA reinforge always fuses and compiles the "
                                                              "reward model's decoder layers"),
    f"{_RM}.model.fsdp_config.param_offload": Rename("reward.reward_model.offload", note="the weights wait on the host "
                                                     "between scoring calls, and are on the device during one"),
    f"{_RM}.model.fsdp_config.*": RM_SHARDING,
    f"{_RM}.micro_batch_size": Rename("reward.reward_model.max_tokens_per_micro_batch", _samples_as_tokens,
                                      note="as tokens: samples x (prompt + response length)"),
    f"{_RM}.micro_batch_size_per_gpu": Rename("reward.reward_model.max_tokens_per_micro_batch", _samples_as_tokens,
                                              note="as tokens: samples x (prompt + response length)"),
    f"{_RM}.forward_max_token_len_per_gpu": Rename("reward.reward_model.max_tokens_per_micro_batch",
                                                   _dynamic_token_budget),
    f"{_RM}.use_dynamic_bsz": RM_BUDGET,
    f"{_RM}.max_length": Rename("reward.reward_model.max_length", _unset_if(None)),
    f"{_RM}.ulysses_sequence_parallel_size": RM_SHARDING,
    f"{_RM}.reward_manager": REWARD_MANAGER,
    f"{_RM}.reward_loop_source": Refused(("register", None), "reinforge has no custom reward loop classes; write a "
                                                             "reward.custom_function"),
    f"{_RM}.reward_loop_module_path": Refused((None,), "reinforge has no custom reward loop classes; write a "
                                                       "reward.custom_function"),
    f"{_RM}.reward_loop_class_name": Refused((None,), "reinforge has no custom reward loop classes; write a "
                                                      "reward.custom_function"),
    f"{_RM}.launch_reward_fn_async": SameAsOurs(EVERY_VALUE, "reinforge's rule-based scorers run in worker processes "
                                                             "(reward.num_workers) beside the reward model"),
    f"{_RM}.use_reward_loop": RM_ENGINE,
    f"{_RM}.num_workers": Rename("reward.num_workers"),
    f"{_RM}.sandbox_fusion.url": Refused((None,), SANDBOX.reason),
    f"{_RM}.sandbox_fusion.*": SameAsOurs(EVERY_VALUE, "read only with sandbox_fusion.url"),
    f"{_RM}.profiler.*": SameAsOurs(EVERY_VALUE, PROFILING.reason),
    f"{_RM}.rollout.max_model_len": Rename("reward.reward_model.max_length", _unset_if(None)),
    f"{_RM}.megatron.param_offload": Rename("reward.reward_model.offload"),
    f"{_RM}.megatron.override_transformer_config": Refused(({}, None), "edit the reward model folder's config.json "
                                                                       "instead"),
    f"{_RM}.megatron.use_dist_checkpointing": Refused((False, None), "reinforge loads the reward model from "
                                                                     "reward.reward_model.model_path (an HF folder)"),
    f"{_RM}.megatron.*": RM_SHARDING,
    f"{_RM}.load_weight": Refused((True, None), "reinforge loads the reward model's weights from "
                                                "reward.reward_model.model_path"),
    f"{_RM}.nccl_timeout": SameAsOurs(EVERY_VALUE, "a call's deadline is trainer.call_timeout_s"),
    f"{_RM}.rollout.*": RM_ENGINE,
    f"{_RM}.*": Refused((), "reinforge knows no such reward-model setting of verl's; remove it"),
    "reward.reward_model.enable": Rename("reward.reward_model.enable"),
    "reward.reward_model.enable_resource_pool": Rename("reward.reward_model.enable_resource_pool"),
    "reward.reward_model.n_gpus_per_node": Rename("reward.reward_model.n_gpus_per_node", _unset_if(0, None)),
    "reward.reward_model.nnodes": Rename("reward.reward_model.nnodes", _unset_if(0, None)),
    "reward.reward_model.model_path": Rename("reward.reward_model.model_path", _path),
    "reward.reward_model.rollout.max_model_len": Rename("reward.reward_model.max_length", _unset_if(None)),
    "reward.reward_model.rollout.*": RM_ENGINE,
    "reward.reward_model.*": Refused((), "reinforge knows no such reward-model setting of verl's; remove it"),
}
# Hydra's class names, which a command line never needs; exact keys win over the general _target_ rule
REWARD_MODEL_KEYS |= {f"{prefix}._target_": SameAsOurs(EVERY_VALUE, HYDRA_TARGET.reason)
                      for prefix in (f"{_RM}.model.fsdp_config", f"{_RM}.profiler", f"{_RM}.rollout", "reward.reward_model",
                                     "reward.reward_model.rollout", f"{_RM}.megatron")}


def _each(prefix: str, names: str, entry: Translation) -> dict[str, Translation]:
    """``entry`` for each of the space-separated ``names`` under ``prefix``: explicit keys, so a typo is caught."""
    return {f"{prefix}.{name}": entry for name in names.split()}


FSDP_DETAILS = ("wrap_policy.min_num_params reshard_after_forward fsdp_size forward_prefetch model_dtype "
                "use_orig_params seed full_determinism entropy_from_logits_with_chunking use_torch_compile "
                "entropy_checkpointing forward_only strategy dtype wrap_policy.transformer_layer_cls_to_wrap")
ENGINE_KNOBS = ("mode dtype enforce_eager cudagraph_capture_sizes max_num_batched_tokens max_model_len "
                "max_num_seqs enable_chunked_prefill logprobs_mode scheduling_policy load_format "
                "over_sample_rate multi_stage_wake_up skip_rollout skip_dump_dir skip_tokenizer_init "
                "enable_rollout_routing_replay mtp layered_summon "
                "update_weights_bucket_megabytes max_loras max_lora_rank repetition_penalty")


def _updates_per_step(section: str, given: Mapping[str, Any]) -> int:
    """Optimizer steps of one training step in verl: its mini-batches (data.train_batch_size over the actor's
    ppo_mini_batch_size, which the critic's defaults to, as reinforge's critic takes the actor's) times the epochs."""
    batch = int(given.get("data.train_batch_size", 1024))
    mini = int(given.get(f"{_ACTOR}.ppo_mini_batch_size", 256))
    epochs = int(given.get(f"{section}.ppo_epochs", given.get(f"{_ACTOR}.ppo_epochs", 1)))
    return max(1, batch // max(1, mini)) * max(1, epochs)


def _warmup_steps(section: str) -> Callable[[Any, Mapping[str, Any]], Any]:
    """verl steps its learning-rate schedule once per training step, reinforge once per optimizer step: verl's
    lr_warmup_steps training steps are that many times the optimizer steps of one."""
    def convert(value: Any, given: Mapping[str, Any]) -> Any:
        if value in (-1, None):
            return UNSET
        return int(value) * _updates_per_step(section, given)
    return convert


def _warmup_note(section: str) -> Callable[[Any, Mapping[str, Any]], str]:
    def note(value: Any, given: Mapping[str, Any]) -> str:
        updates = _updates_per_step(section, given)
        if value in (-1, None) or updates == 1:
            return ""
        return (f"verl counts warmup in training steps, reinforge in optimizer steps: {value} x {updates} "
                "(mini-batches x epochs of a step)")
    return note


def _optim(section: str, ours: str) -> dict[str, Translation]:
    """The optimizer keys of verl's actor or critic (``section``) onto ours (``ours``)."""
    return {
        f"{section}.optim.lr": Rename(f"{ours}.optim.lr"),
        f"{section}.optim.weight_decay": Rename(f"{ours}.optim.weight_decay"),
        f"{section}.optim.betas": Rename(f"{ours}.optim.betas"),
        f"{section}.optim.lr_warmup_steps": Rename(f"{ours}.optim.warmup_steps", _warmup_steps(section),
                                                   note=_warmup_note(section)),
        f"{section}.optim.lr_warmup_steps_ratio": Rename(f"{ours}.optim.warmup_ratio"),
        f"{section}.optim.min_lr_ratio": Rename(f"{ours}.optim.min_lr_ratio", _unset_if(None)),
        f"{section}.optim.lr_scheduler_type": Rename(f"{ours}.optim.schedule", _schedule),
        f"{section}.optim.warmup_style": Rename(f"{ours}.optim.schedule", _schedule),
        f"{section}.optim.num_cycles": SameAsOurs((0.5,), "reinforge's cosine schedule is the half cycle (0.5) only"),
        f"{section}.optim.clip_grad": Rename(f"{ours}.grad_clip"),
        f"{section}.optim.optimizer": OPTIMIZER,
        f"{section}.optim.optimizer_impl": OPTIMIZER,
        f"{section}.optim.override_optimizer_config": OPTIMIZER,
        f"{section}.optim.total_training_steps": TOTAL_STEPS,
        f"{section}.optim.weight_decay_incr_ratio": OPTIMIZER,
    }


_ACTOR = "actor_rollout_ref.actor"
_ROLLOUT = "actor_rollout_ref.rollout"
_REF = "actor_rollout_ref.ref"
_MODEL = "actor_rollout_ref.model"

VERL_KEYS: dict[str, Translation] = {
    # ---- data
    "data.train_files": Rename("data.train_files", _file_list),
    "data.val_files": Rename("data.val_files", _file_list),
    "data.prompt_key": Rename("data.prompt_key"),
    "data.train_batch_size": Rename("data.train_batch_size", _prompts_per_step, verl_default=1024,
                                    note=lambda value, given: GEN_BATCH_NOTE if _generated_not_filtered(given) else ""),
    "data.val_batch_size": Rename("data.val_batch_size"),
    "data.max_prompt_length": Rename("data.max_prompt_length"),
    "data.max_response_length": Rename("data.max_response_length", verl_default=512),
    "data.filter_overlong_prompts": Rename("data.filter_overlong_prompts", verl_default=False),
    "data.truncation": Rename("data.truncation", _truncation),
    "data.shuffle": Rename("data.shuffle"),
    "data.seed": Rename("data.seed", _unset_if(None)),
    "data.train_max_samples": Rename("data.max_train_samples", _unset_if(-1, None)),
    "data.val_max_samples": Rename("data.max_val_samples", _unset_if(-1, None)),
    "data.reward_fn_key": SameAsOurs(("data_source",), "reinforge picks the scorer by the data_source column; "
                                                       "rename your column to it"),
    "data.validation_shuffle": NoEquivalent("validation goes over the prompts in file order"),
    "data.tokenizer": NoEquivalent("the tokenizer is model.tokenizer_path (actor_rollout_ref.model.tokenizer_path)"),
    "data.trust_remote_code": NoEquivalent("see model.trust_remote_code (actor_rollout_ref.model.trust_remote_code)"),
    "data.use_shm": OWN_DATA_PIPELINE,
    "data.return_raw_input_ids": OWN_DATA_PIPELINE,
    "data.return_raw_chat": OWN_DATA_PIPELINE,
    "data.return_full_prompt": OWN_DATA_PIPELINE,
    "data.dataloader_num_workers": OWN_DATA_PIPELINE,
    "data.filter_overlong_prompts_workers": OWN_DATA_PIPELINE,
    "data.custom_cls.path": Rename("data.train_files", _custom_dataset),
    "data.custom_cls.*": OWN_DATA_PIPELINE,
    "data.sampler.*": NoEquivalent("prompts are drawn in a seeded shuffled order (data.shuffle, data.seed); "
                                   "there are no curriculum samplers"),
    "data.datagen.*": NoEquivalent("reinforge has no dynamic data generation"),
    "data.apply_chat_template_kwargs": Refused(({}, None), CHAT_TEMPLATE_KWARGS),
    "data.apply_chat_template_kwargs.*": Refused((), CHAT_TEMPLATE_KWARGS),
    "data.tool_config_path": Rename("rollout.multi_turn.tool_config_path", _unset_if(None)),
    "data.image_key": Rename("data.image_key", _unset_if("images")),
    "data.video_key": MULTIMODAL,
    "data.image_patch_size": MULTIMODAL,
    "data.return_multi_modal_inputs": MULTIMODAL,
    "data.gen_batch_size": Rename("data.gen_batch_size", _gen_batch_size),
    # ---- model
    f"{_MODEL}.path": Rename("model.path", _path),
    f"{_MODEL}.tokenizer_path": Rename("model.tokenizer_path", _path),
    f"{_MODEL}.trust_remote_code": Rename("model.trust_remote_code"),
    f"{_MODEL}.custom_chat_template": Rename("data.chat_template"),
    f"{_MODEL}.enable_gradient_checkpointing": Rename("model.gradient_checkpointing", verl_default=True),
    f"{_MODEL}.use_remove_padding": ALWAYS_PADDING_FREE,
    f"{_MODEL}.use_fused_kernels": NoEquivalent("log-probs are always fused with the output projection, and "
                                                "on CUDA RMSNorm and the MLP too"),
    f"{_MODEL}.fused_kernel_options.*": NoEquivalent("log-probs are always fused with the output projection"),
    f"{_MODEL}.use_liger": NoEquivalent("reinforge has its own fused kernels, always on with CUDA"),
    f"{_MODEL}.lora_rank": Rename("model.lora.rank", _unset_if(None)),
    f"{_MODEL}.lora_alpha": Rename("model.lora.alpha"),
    f"{_MODEL}.target_modules": Rename("model.lora.target_modules", _lora_targets),
    f"{_MODEL}.exclude_modules": Rename("actor.freeze_vision_tower", _lora_exclusions),
    f"{_MODEL}.lora_adapter_path": Refused((None,), ADAPTER_REFUSAL),
    f"{_MODEL}.hf_config_path": NoEquivalent("the model's config is read from model.path"),
    f"{_MODEL}.override_config": Refused(({}, None), MODEL_OVERRIDE),
    f"{_MODEL}.override_config.*": Refused((), MODEL_OVERRIDE),
    f"{_MODEL}.override_config.attn_implementation": SameAsOurs(EVERY_VALUE, ATTENTION_KERNEL),
    **_each(f"{_MODEL}.override_config", "max_position_embeddings model_config.max_position_embeddings", NoEquivalent(
        "positions past the config's max_position_embeddings run as in transformers (rotary embeddings have no "
        "table to outgrow; reinforge warns when a run's sequences reach past it); edit config.json only for a "
        "model whose rope scaling reads it")),
    **_each(f"{_MODEL}.override_config", "attention_dropout embd_pdrop resid_pdrop hidden_dropout",
            Refused((0,), "reinforge turns every dropout of the model off for RL (as this key does at 0); "
                          "training with dropout has no equivalent here")),
    **_each(f"{_MODEL}.override_config", "output_router_logits router_aux_loss_coef",
            SameAsOurs(EVERY_VALUE, "verl's actor adds no router load-balancing loss whatever the model config "
                                    "says; the translated run adds none either (actor.router_aux_loss_coef=0, which "
                                    "an override after -- changes)")),
    **_each(f"{_ACTOR}.megatron.override_transformer_config", "fp8 fp8_recipe", NoEquivalent(
        "Megatron's fp8 training; reinforge trains in the model's dtype (bf16 on CUDA) with float32 master weights")),
    f"{_ACTOR}.megatron.override_transformer_config.moe_aux_loss_coeff": NoEquivalent(
        "Megatron's router loss, in the form its moe_router_load_balancing_type picks; reinforge's is the "
        "Switch-style actor.router_aux_loss_coef: pass actor.router_aux_loss_coef=... after -- for one"),
    f"{_MODEL}.external_lib": NoEquivalent("import your model's package in a sitecustomize or register it "
                                           "with transformers' Auto classes"),
    f"{_MODEL}.use_shm": NoEquivalent("models load from model.path directly"),
    f"{_MODEL}.enable_activation_offload": NoEquivalent("use model.gradient_checkpointing to save activation memory"),
    f"{_MODEL}.tiled_mlp.*": NoEquivalent("use model.gradient_checkpointing to save activation memory"),
    f"{_MODEL}.mtp.*": NoEquivalent("reinforge has no multi-token prediction or speculative decoding"),
    "actor_rollout_ref.hybrid_engine": NoEquivalent("reinforge's actor and rollout always share one weight copy "
                                                    "per device (the hybrid engine)"),
    "actor_rollout_ref.nccl_timeout": NoEquivalent("worker calls have trainer.call_timeout_s"),
    # ---- actor
    **_optim(_ACTOR, "actor"),
    f"{_ACTOR}.ppo_mini_batch_size": Rename("actor.mini_batch_size", verl_default=256),
    f"{_ACTOR}.ppo_micro_batch_size": TOKEN_BUDGET,
    f"{_ACTOR}.ppo_micro_batch_size_per_gpu": TOKEN_BUDGET,
    f"{_ACTOR}.use_dynamic_bsz": DYNAMIC_BSZ,
    f"{_ACTOR}.ppo_max_token_len_per_gpu": Rename("actor.max_tokens_per_micro_batch", _tokens_per_device("actor"),
                                                  note=PER_DEVICE_NOTE),
    f"{_ACTOR}.ppo_epochs": Rename("actor.ppo_epochs"),
    f"{_ACTOR}.shuffle": Rename("actor.shuffle"),
    f"{_ACTOR}.grad_clip": Rename("actor.grad_clip"),
    f"{_ACTOR}.loss_agg_mode": Rename("actor.loss_agg_mode"),
    f"{_ACTOR}.entropy_coeff": Rename("actor.entropy_coeff"),
    f"{_ACTOR}.use_kl_loss": Rename("actor.use_kl_loss"),
    f"{_ACTOR}.kl_loss_coef": Rename("actor.kl_loss_coef"),
    f"{_ACTOR}.kl_loss_type": Rename("actor.kl_loss_type"),
    f"{_ACTOR}.clip_ratio": Rename("actor.policy_loss.clip_ratio"),
    f"{_ACTOR}.clip_ratio_low": Rename("actor.policy_loss.clip_ratio_low", _clip_ratio_low, note=_clip_low_note),
    f"{_ACTOR}.clip_ratio_high": Rename("actor.policy_loss.clip_ratio_high"),
    f"{_ACTOR}.clip_ratio_c": Rename("actor.policy_loss.clip_ratio_c"),
    f"{_ACTOR}.tau_pos": Rename("actor.policy_loss.tau_pos"),
    f"{_ACTOR}.tau_neg": Rename("actor.policy_loss.tau_neg"),
    f"{_ACTOR}.policy_loss.loss_mode": Rename("actor.policy_loss.loss_mode", _loss_mode),
    f"{_ACTOR}.policy_loss.clip_cov_ratio": Rename("actor.policy_loss.clip_cov_ratio"),
    f"{_ACTOR}.policy_loss.clip_cov_lb": Rename("actor.policy_loss.clip_cov_lb"),
    f"{_ACTOR}.policy_loss.clip_cov_ub": Rename("actor.policy_loss.clip_cov_ub"),
    f"{_ACTOR}.policy_loss.kl_cov_ratio": Rename("actor.policy_loss.kl_cov_ratio"),
    f"{_ACTOR}.policy_loss.ppo_kl_coef": Rename("actor.policy_loss.ppo_kl_coef"),
    f"{_ACTOR}.policy_loss.dro_beta": Rename("actor.policy_loss.dro_beta"),
    f"{_ACTOR}.fsdp_config.param_offload": Rename("actor.param_offload", _only_if_true),
    f"{_ACTOR}.fsdp_config.optimizer_offload": Rename("actor.optimizer_offload", _only_if_true),
    f"{_ACTOR}.fsdp_config.offload_policy": Rename("actor.param_offload", _only_if_true),
    **_each(f"{_ACTOR}.fsdp_config", FSDP_DETAILS, FSDP_DETAIL),
    f"{_ACTOR}.fsdp_config.reshard_after_forward": NoEquivalent(
        "the memory planner decides whether the update keeps each layer's gathered parameters from forward to "
        "backward (actor.keep_gathered, on one device with room)"),
    f"{_ACTOR}.fsdp_config.ulysses_sequence_parallel_size": PARALLELISM,
    f"{_ACTOR}.strategy": FSDP2,
    f"{_ACTOR}.ulysses_sequence_parallel_size": PARALLELISM,
    f"{_ACTOR}.loss_scale_factor": Rename("actor.loss_scale_factor"),
    f"{_ACTOR}.calculate_entropy": NoEquivalent("the entropy is always computed and logged (actor/entropy)"),
    f"{_ACTOR}.entropy_from_logits_with_chunking": NoEquivalent("entropy is computed with the fused log-prob pass"),
    f"{_ACTOR}.entropy_checkpointing": NoEquivalent("entropy is computed with the fused log-prob pass"),
    f"{_ACTOR}.calculate_sum_pi_squared": NoEquivalent("the log-prob pass adds sum_pi_squared by itself when "
                                                       "algorithm.adv_estimator is an optimal token baseline"),
    f"{_ACTOR}.sum_pi_squared_checkpointing": NoEquivalent("sum_pi_squared comes from the scoring pass, which "
                                                           "keeps no activations"),
    f"{_ACTOR}.use_torch_compile": COMPILE,
    f"{_ACTOR}.use_fused_kernels": NoEquivalent("log-probs are always fused with the output projection"),
    f"{_ACTOR}.use_remove_padding": ALWAYS_PADDING_FREE,
    f"{_ACTOR}.use_prefix_grouper": NoEquivalent("reinforge always runs a prompt shared by its samples once"),
    f"{_ACTOR}.rollout_n": FROM_DATA,
    f"{_ACTOR}.data_loader_seed": SEEDS,
    f"{_ACTOR}.checkpoint.*": CHECKPOINT_FORMAT,
    f"{_ACTOR}.router_replay.*": NoEquivalent("reinforge has no mixture-of-experts routing replay"),
    f"{_ACTOR}.freeze_vision_tower": Rename("actor.freeze_vision_tower", verl_default=False),
    f"{_ACTOR}.profiler.*": PROFILING,
    f"{_ACTOR}.tis_imp_ratio_cap": NoEquivalent("use algorithm.rollout_correction.rollout_is=token with "
                                                "rollout_is_threshold"),
    # ---- reference
    f"{_REF}.fsdp_config.param_offload": Rename("ref.param_offload", _only_if_true),
    **_each(f"{_REF}.fsdp_config", FSDP_DETAILS + " optimizer_offload offload_policy", FSDP_DETAIL),
    f"{_REF}.fsdp_config.ulysses_sequence_parallel_size": PARALLELISM,
    f"{_REF}.log_prob_max_token_len_per_gpu": Rename("ref.max_tokens_per_micro_batch",
                                                     _tokens_per_device("ref", (None,)), note=PER_DEVICE_NOTE),
    f"{_REF}.log_prob_micro_batch_size": LOG_PROB_BUDGET,
    f"{_REF}.log_prob_micro_batch_size_per_gpu": LOG_PROB_BUDGET,
    f"{_REF}.log_prob_use_dynamic_bsz": LOG_PROB_BUDGET,
    f"{_REF}.ulysses_sequence_parallel_size": PARALLELISM,
    f"{_REF}.strategy": FSDP2,
    f"{_REF}.use_torch_compile": COMPILE,
    f"{_REF}.entropy_from_logits_with_chunking": NoEquivalent("the reference computes log-probs only"),
    f"{_REF}.entropy_checkpointing": NoEquivalent("the reference computes log-probs only"),
    f"{_REF}.rollout_n": FROM_DATA,
    f"{_REF}.router_replay.*": NoEquivalent("reinforge has no mixture-of-experts routing replay"),
    f"{_REF}.profiler.*": PROFILING,
    # ---- rollout
    f"{_ROLLOUT}.name": Rename("rollout.name", _rollout_engine, note="reinforge's own paged engine"),
    f"{_ROLLOUT}.n": Rename("rollout.n", verl_default=1),
    f"{_ROLLOUT}.temperature": Rename("rollout.temperature"),
    f"{_ROLLOUT}.top_p": Rename("rollout.top_p"),
    f"{_ROLLOUT}.top_k": Rename("rollout.top_k"),
    f"{_ROLLOUT}.gpu_memory_utilization": Rename("rollout.gpu_memory_utilization"),
    f"{_ROLLOUT}.free_cache_engine": Rename("rollout.free_cache_engine"),
    f"{_ROLLOUT}.enable_prefix_caching": Rename("rollout.enable_prefix_caching"),
    f"{_ROLLOUT}.val_kwargs.n": Rename("rollout.val_kwargs.n"),
    f"{_ROLLOUT}.val_kwargs.temperature": Rename("rollout.val_kwargs.temperature"),
    f"{_ROLLOUT}.val_kwargs.top_p": Rename("rollout.val_kwargs.top_p"),
    f"{_ROLLOUT}.val_kwargs.top_k": Rename("rollout.val_kwargs.top_k"),
    f"{_ROLLOUT}.val_kwargs.do_sample": NoEquivalent("rollout.val_kwargs.temperature=0 is greedy, above 0 samples"),
    f"{_ROLLOUT}.do_sample": NoEquivalent("rollout.temperature=0 is greedy, above 0 samples"),
    f"{_ROLLOUT}.calculate_log_probs": SameAsOurs(EVERY_VALUE, "the rollout always returns its log-probs "
                                                               "(rollout_log_probs)"),
    f"{_ROLLOUT}.prompt_length": FROM_DATA,
    f"{_ROLLOUT}.response_length": FROM_DATA,
    f"{_ROLLOUT}.log_prob_micro_batch_size": LOG_PROB_BUDGET,
    f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu": LOG_PROB_BUDGET,
    f"{_ROLLOUT}.log_prob_use_dynamic_bsz": LOG_PROB_BUDGET,
    f"{_ROLLOUT}.log_prob_max_token_len_per_gpu": LOG_PROB_BUDGET,
    f"{_ROLLOUT}.tensor_model_parallel_size": PARALLELISM,
    f"{_ROLLOUT}.data_parallel_size": PARALLELISM,
    f"{_ROLLOUT}.expert_parallel_size": PARALLELISM,
    f"{_ROLLOUT}.pipeline_model_parallel_size": PARALLELISM,
    f"{_ROLLOUT}.moe_tensor_parallel_size": PARALLELISM,
    **{f"{_ROLLOUT}.multi_turn.{name}": Rename(f"rollout.multi_turn.{name}")
       for name in ("tool_config_path", "format", "max_assistant_turns", "max_user_turns", "max_parallel_calls",
                    "tool_response_truncate_side")},
    f"{_ROLLOUT}.multi_turn.max_tool_response_length": Rename("rollout.multi_turn.max_tool_response_length",
                                                              note="verl counts characters, reinforge tokens"),
    f"{_ROLLOUT}.multi_turn.enable": NoEquivalent("a row runs the agent loop its agent_name column names "
                                                  "(single_turn without one)"),
    f"{_ROLLOUT}.multi_turn.*": MULTI_TURN,
    f"{_ROLLOUT}.agent.default_agent_loop": NoEquivalent("a row's agent_name column picks its loop "
                                                         "(single_turn without one)"),
    f"{_ROLLOUT}.agent.*": NoEquivalent("reinforge runs every trajectory of a batch concurrently over one engine "
                                        "(reinforge.agent.AgentRunner)"),
    f"{_ROLLOUT}.trace.*": MULTI_TURN,
    f"{_ROLLOUT}.interaction_config_path": MULTI_TURN,
    f"{_ROLLOUT}.profiler.*": PROFILING,
    f"{_ROLLOUT}.prometheus.*": PROFILING,
    f"{_ROLLOUT}.disable_log_stats": PROFILING,
    **_each(_ROLLOUT, ENGINE_KNOBS, ENGINE_KNOB),
    f"{_ROLLOUT}.ignore_eos": Refused((False, None), "reinforge's rollout ends a response at the model's end of "
                                                     "sequence; generating past it to the length limit has no "
                                                     "equivalent"),
    f"{_ROLLOUT}.engine_kwargs.vllm.kv_cache_dtype": Rename("rollout.kv_cache_dtype", _kv_cache_dtype),
    f"{_ROLLOUT}.engine_kwargs.sglang.kv_cache_dtype": Rename("rollout.kv_cache_dtype", _kv_cache_dtype),
    f"{_ROLLOUT}.engine_kwargs.trtllm.kv_cache_config.dtype": Rename("rollout.kv_cache_dtype", _kv_cache_dtype),
    f"{_ROLLOUT}.engine_kwargs.*": ENGINE_KNOB,
    **_each(_ROLLOUT, "quantization quantization_config_file", NoEquivalent(
        "reinforge's rollout runs the weights in the model's dtype, without fp8 or other weight quantization "
        "(rollout.kv_cache_dtype=fp8 stores the KV cache in fp8)")),
    f"{_ROLLOUT}.checkpoint_engine.*": ENGINE_KNOB,
    # ---- critic
    **_optim("critic", "critic"),
    "critic.enable": Rename("critic.enable"),
    "critic.model.path": Rename("critic.model_path", _path),
    "critic.model.fsdp_config.param_offload": Rename("critic.param_offload", _only_if_true),
    "critic.model.fsdp_config.optimizer_offload": Rename("critic.optimizer_offload", _only_if_true),
    "critic.model.fsdp_config.offload_policy": Rename("critic.param_offload", _only_if_true),
    **_each("critic.model.fsdp_config", FSDP_DETAILS, FSDP_DETAIL),
    "critic.model.fsdp_config.ulysses_sequence_parallel_size": PARALLELISM,
    "critic.model.lora_rank": SameAsOurs((0, None), "reinforge's LoRA is the actor's; the critic trains every "
                                                    "parameter"),
    **_each("critic.model", "tokenizer_path override_config external_lib trust_remote_code use_shm "
            "enable_gradient_checkpointing enable_activation_offload use_remove_padding lora_alpha target_modules",
            NoEquivalent("the critic shares the model.* settings (gradient checkpointing, remote code) and the "
                         "tokenizer of the actor")),
    "critic.model.tiled_mlp.*": NoEquivalent("use model.gradient_checkpointing to save activation memory"),
    "critic.cliprange_value": Rename("critic.cliprange_value"),
    "critic.loss_agg_mode": Rename("critic.loss_agg_mode"),
    "critic.ppo_epochs": Rename("critic.ppo_epochs"),
    "critic.grad_clip": Rename("critic.grad_clip"),
    "critic.ppo_max_token_len_per_gpu": Rename("critic.max_tokens_per_micro_batch", _tokens_per_device("critic"),
                                               note=PER_DEVICE_NOTE),
    "critic.forward_max_token_len_per_gpu": NoEquivalent("the critic's value pass uses "
                                                         "critic.max_tokens_per_micro_batch too"),
    "critic.ppo_mini_batch_size": NoEquivalent("the critic updates on actor.mini_batch_size"),
    "critic.ppo_micro_batch_size": TOKEN_BUDGET,
    "critic.ppo_micro_batch_size_per_gpu": TOKEN_BUDGET,
    "critic.forward_micro_batch_size": TOKEN_BUDGET,
    "critic.forward_micro_batch_size_per_gpu": TOKEN_BUDGET,
    "critic.use_dynamic_bsz": NoEquivalent("the critic's micro-batches are always balanced by tokens under "
                                           "critic.max_tokens_per_micro_batch, which its ppo_max_token_len_per_gpu "
                                           "becomes"),
    "critic.shuffle": NoEquivalent("the critic's mini-batches follow actor.shuffle"),
    "critic.strategy": FSDP2,
    "critic.ulysses_sequence_parallel_size": PARALLELISM,
    "critic.rollout_n": FROM_DATA,
    "critic.data_loader_seed": SEEDS,
    "critic.checkpoint.*": CHECKPOINT_FORMAT,
    "critic.profiler.*": PROFILING,
    # ---- reward
    "custom_reward_function.path": Rename("reward.custom_function", _custom_function),
    "custom_reward_function.name": Rename("reward.custom_function", _custom_function_name),
    "custom_reward_function.reward_kwargs": Rename("reward.kwargs"),
    "custom_reward_function.reward_kwargs.*": Rename("reward.kwargs.*"),
    **REWARD_MODEL_KEYS,
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": Rename("reward.overlong_buffer.enable"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": Rename("reward.overlong_buffer.len"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": Rename("reward.overlong_buffer.penalty_factor"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": SameAsOurs(EVERY_VALUE, "reward/overlong/* is always "
                                                                     "logged when the buffer is on"),
    "reward_model.reward_kwargs.max_resp_len": Rename("data.max_response_length", _overlong_end),
    # the DAPO recipe's form (recipe/dapo, tests/special_e2e/run_dapo.sh): its buffer ends at data.max_response_length
    "reward_model.overlong_buffer.enable": Rename("reward.overlong_buffer.enable"),
    "reward_model.overlong_buffer.len": Rename("reward.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": Rename("reward.overlong_buffer.penalty_factor"),
    "reward_model.overlong_buffer.log": SameAsOurs(EVERY_VALUE, "reward/overlong/* is always logged when the buffer "
                                                                "is on"),
    # the DAPO recipe's form on verl 0.9's reward section (dapo/config/dapo_trainer.yaml)
    "reward.reward_kwargs.overlong_buffer_cfg.enable": Rename("reward.overlong_buffer.enable"),
    "reward.reward_kwargs.overlong_buffer_cfg.len": Rename("reward.overlong_buffer.len"),
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": Rename("reward.overlong_buffer.penalty_factor"),
    "reward.reward_kwargs.overlong_buffer_cfg.log": SameAsOurs(EVERY_VALUE, "reward/overlong/* is always logged when "
                                                                            "the buffer is on"),
    "reward.reward_kwargs.max_resp_len": Rename("data.max_response_length", _overlong_end),
    "reward.reward_kwargs.*": Refused((), "its reward manager's options have no equivalent; pass a scorer's options "
                                          "with reward.kwargs (verl's custom_reward_function.reward_kwargs)"),
    "reward_model.reward_kwargs.*": Refused((), "its reward manager's options have no equivalent; pass a scorer's "
                                                "options with reward.kwargs (verl's custom_reward_function.reward_kwargs)"),
    "reward_manager.*": NoEquivalent("one reward manager scores every sample in worker processes"),
    # ---- algorithm
    "algorithm.adv_estimator": Rename("algorithm.adv_estimator", _estimator, verl_default="gae",
                                      note=_estimator_note),
    "algorithm.gamma": Rename("algorithm.gamma"),
    "algorithm.lam": Rename("algorithm.lam"),
    "algorithm.norm_adv_by_std_in_grpo": Rename("algorithm.norm_adv_by_std"),
    "algorithm.use_kl_in_reward": Rename("algorithm.use_kl_in_reward"),
    "algorithm.kl_penalty": Rename("algorithm.kl_penalty"),
    "algorithm.kl_ctrl.type": Rename("algorithm.kl_ctrl.type"),
    "algorithm.kl_ctrl.kl_coef": Rename("algorithm.kl_ctrl.kl_coef"),
    "algorithm.kl_ctrl.target_kl": Rename("algorithm.kl_ctrl.target_kl"),
    "algorithm.kl_ctrl.horizon": Rename("algorithm.kl_ctrl.horizon"),
    "algorithm.rollout_correction.rollout_is": Rename("algorithm.rollout_correction.rollout_is"),
    "algorithm.rollout_correction.rollout_is_threshold": Rename("algorithm.rollout_correction.rollout_is_threshold",
                                                                _unset_if(None)),
    "algorithm.rollout_correction.rollout_rs": Rename("algorithm.rollout_correction.rollout_rs"),
    "algorithm.rollout_correction.rollout_rs_threshold": Rename("algorithm.rollout_correction.rollout_rs_threshold",
                                                                _unset_if(None)),
    "algorithm.rollout_correction.bypass_mode": Rename("algorithm.rollout_correction.bypass_mode"),
    "algorithm.rollout_correction.loss_type": Rename("algorithm.rollout_correction.loss_type"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": Rename(
        "algorithm.rollout_correction.rollout_is_batch_normalize"),
    "algorithm.gdpo_reward_keys": Rename("algorithm.gdpo_reward_keys", _unset_if(None)),
    "algorithm.gdpo_reward_weights": Rename("algorithm.gdpo_reward_weights"),
    "algorithm.use_pf_ppo": SameAsOurs((False,), "reinforge has no PF-PPO resampling"),
    "algorithm.pf_ppo.*": NoEquivalent("reinforge has no PF-PPO resampling"),
    "algorithm.filter_groups.enable": Rename("algorithm.filter_groups.enable"),
    "algorithm.filter_groups.metric": Rename("algorithm.filter_groups.metric"),
    "algorithm.filter_groups.max_num_gen_batches": Rename("algorithm.filter_groups.max_num_gen_batches"),
    # ---- trainer
    "trainer.total_epochs": Rename("trainer.total_epochs", _epochs_unless_steps_given, verl_default=30),
    "trainer.total_training_steps": Rename("trainer.total_steps", _unset_if(None), note="exactly this many steps, the "
                                           "data repeated as needed; verl stops sooner if trainer.total_epochs run out"),
    "trainer.project_name": Rename("trainer.project_name", verl_default=VERL_PROJECT_NAME),
    "trainer.experiment_name": Rename("trainer.experiment_name", verl_default=VERL_EXPERIMENT_NAME),
    "trainer.logger": Rename("trainer.loggers", _loggers),
    "trainer.nnodes": Rename("trainer.nnodes"),
    "trainer.n_gpus_per_node": Rename("trainer.devices_per_node"),
    "trainer.device": Rename("trainer.device", _device),
    "trainer.save_freq": Rename("trainer.save_every", _unset_if(-1, 0, None),
                                note="reinforge also saves at the end"),
    "trainer.test_freq": Rename("trainer.test_every", _unset_if(-1, 0, None),
                                note="reinforge also validates at the end when data.val_files is set"),
    "trainer.val_before_train": Rename("trainer.val_before_train"),
    "trainer.critic_warmup": Rename("critic.warmup_steps"),
    "trainer.default_local_dir": Rename("trainer.output_dir", _local_dir, verl_default=VERL_LOCAL_DIR,
                                        note="the run folder: config, metrics, samples and checkpoints/"),
    "trainer.resume_mode": Rename("trainer.resume", _resume_mode),
    "trainer.resume_from_path": Rename("trainer.resume", _resume_path),
    "trainer.max_actor_ckpt_to_keep": Rename("trainer.keep_last", _unset_if(None)),
    "trainer.max_critic_ckpt_to_keep": NoEquivalent("actor and critic checkpoints are kept together "
                                                    "(trainer.keep_last)"),
    "trainer.log_val_generations": NoEquivalent("samples.jsonl holds trainer.num_logged_samples generations "
                                                "of every step"),
    "trainer.rollout_data_dir": NoEquivalent("samples.jsonl in the run folder holds logged generations"),
    "trainer.validation_data_dir": NoEquivalent("samples.jsonl in the run folder holds logged generations"),
    "trainer.balance_batch": NoEquivalent("micro-batches are always balanced by tokens"),
    "trainer.val_only": NoEquivalent("use `reinforge eval MODEL DATA` to validate a model"),
    "trainer.default_hdfs_dir": NoEquivalent("checkpoints go to trainer.output_dir"),
    "trainer.del_local_ckpt_after_load": NoEquivalent("trainer.keep_last bounds the checkpoints on disk"),
    "trainer.esi_redundant_time": NoEquivalent("checkpoint with trainer.save_every"),
    "trainer.ray_wait_register_center_timeout": RAY_DETAIL,
    "trainer.use_legacy_worker_impl": NoEquivalent("reinforge has one worker implementation"),
    # ---- the rest of verl's config
    "global_profiler.*": PROFILING,
    "ray_kwargs.*": RAY_DETAIL,
    "hydra.*": NoEquivalent("a setting of Hydra itself (its output folder, job name, logging); reinforge writes its "
                            "run to trainer.output_dir"),
    "transfer_queue.*": NoEquivalent("batches go straight from the controller to the workers"),
    # ---- verl's Megatron trainer (--config-name=ppo_megatron_trainer)
    f"{_ACTOR}.megatron.param_offload": Rename("actor.param_offload", _only_if_true),
    f"{_ACTOR}.megatron.optimizer_offload": Rename("actor.optimizer_offload", _only_if_true),
    f"{_ACTOR}.megatron.*": MEGATRON,
    f"{_REF}.megatron.param_offload": Rename("ref.param_offload", _only_if_true),
    f"{_REF}.megatron.*": MEGATRON,
    "critic.megatron.param_offload": Rename("critic.param_offload", _only_if_true),
    "critic.megatron.optimizer_offload": Rename("critic.optimizer_offload", _only_if_true),
    "critic.megatron.*": MEGATRON,
    **{f"{section}.optim.{name}": MEGATRON for section in (_ACTOR, "critic") for name in MEGATRON_OPTIM.split()},
    **{f"{section}.optim.lr_decay_style": Rename(f"{ours}.optim.schedule", _megatron_schedule)
       for section, ours in ((_ACTOR, "actor"), ("critic", "critic"))},
    **{f"{section}.optim.min_lr": Rename(f"{ours}.optim.min_lr_ratio", _megatron_min_lr(section))
       for section, ours in ((_ACTOR, "actor"), ("critic", "critic"))},
    # ---- verl's VeOmni engine (model_engine=veomni)
    "model_engine": Refused(("dp", "megatron", "veomni", None), VERL_ENGINES),
    **{f"{section}.veomni.{name}": Rename(f"{ours}.{name}", _only_if_true)
       for section, ours in ((_ACTOR, "actor"), ("critic", "critic")) for name in ("param_offload", "optimizer_offload")},
    f"{_REF}.veomni.param_offload": Rename("ref.param_offload", _only_if_true),
    **{f"{section}.veomni.*": VEOMNI for section in (_ACTOR, _REF, "critic")},
    **{f"{section}.optim.lr_min": Rename(f"{ours}.optim.min_lr_ratio", _veomni_min_lr(section))
       for section, ours in ((_ACTOR, "actor"), ("critic", "critic"))},
    **{f"{section}.optim.{name}": Refused((default, None), reason) for section in (_ACTOR, "critic")
       for name, default, reason in (
           ("lr_start", 0, "reinforge's warmup rises from 0 (VeOmni's lr_start=0)"),
           ("lr_decay_ratio", 1, "reinforge's schedule decays over every step after warmup (VeOmni's "
                                 "lr_decay_ratio=1)"))},
    # ---- verl's TorchTitan engine (model_engine=torchtitan, refused above: it decays the learning rate linearly)
    **{f"{section}.torchtitan.*": NoEquivalent("a setting of verl's TorchTitan backend; reinforge shards every model "
                                               "with FSDP2 over all devices of its role")
       for section in (_ACTOR, _REF, "critic")},
    **{f"{section}.optim.eps": Rename(f"{ours}.optim.eps") for section, ours in ((_ACTOR, "actor"), ("critic", "critic"))},
    **{f"{section}.optim.name": OPTIMIZER for section in (_ACTOR, "critic")},
    **{f"{section}.optim.{name}": Refused((None,), "a schedule setting of verl's TorchTitan engine, which reinforge "
                                                   "has no translation for; translate the command with model_engine=dp")
       for section in (_ACTOR, "critic") for name in ("decay_type", "min_lr_factor")},
    f"{_REF}.optim.*": NoEquivalent("the reference model is not trained"),
    "critic.nccl_timeout": RAY_DETAIL,
    # ---- keys verl 0.9.1 added
    f"{_MODEL}.lora.rank": Rename("model.lora.rank", _unset_if(None, 0)),
    f"{_MODEL}.lora.alpha": Rename("model.lora.alpha"),
    f"{_MODEL}.lora.dropout": Rename("model.lora.dropout"),
    f"{_MODEL}.lora.target_modules": Rename("model.lora.target_modules", _megatron_lora_targets),
    f"{_MODEL}.lora.exclude_modules": Rename("actor.freeze_vision_tower", _lora_exclusions),
    f"{_MODEL}.lora.adapter_path": Refused((None,), ADAPTER_REFUSAL),
    f"{_MODEL}.lora.type": Refused(("lora", "canonical_lora", None), "reinforge's adapters are peft's LoRA, one per "
                                                                     "linear layer; DoRA and vlm_lora have none"),
    f"{_MODEL}.lora.merge": SameAsOurs(EVERY_VALUE, "how verl hands adapters to its inference engine; reinforge's "
                                                    "engine runs the adapted weights"),
    f"{_MODEL}.lora.*": MEGATRON_LORA,
    "critic.model.lora.*": NoEquivalent("reinforge's LoRA is the actor's; the critic trains every parameter"),
    **{f"{section}.{name}": FSDP_DETAIL for section in (f"{_ACTOR}.fsdp_config", f"{_REF}.fsdp_config",
                                                       "critic.model.fsdp_config", "critic.fsdp")
       for name in ("entropy_from_logits_chunk_size use_no_sync_for_gradient_accumulation pad_to_length "
                    "pad_to_length_bucket mixed_precision.* turbo_config.*").split()},
    **_each("critic.fsdp", FSDP_DETAILS, FSDP_DETAIL),
    "critic.fsdp.param_offload": Rename("critic.param_offload", _only_if_true),
    "critic.fsdp.optimizer_offload": Rename("critic.optimizer_offload", _only_if_true),
    "critic.fsdp.offload_policy": Rename("critic.param_offload", _only_if_true),
    "critic.fsdp.ulysses_sequence_parallel_size": PARALLELISM,
    f"{_ACTOR}.fsdp_config.qat.*": QAT,
    f"{_REF}.fsdp_config.qat.*": QAT,
    "critic.fsdp.qat.*": QAT,
    f"{_ACTOR}.qat.*": QAT,
    f"{_ROLLOUT}.qat": QAT,
    f"{_ACTOR}.entropy_from_logits_chunk_size": FSDP_DETAIL,
    f"{_REF}.entropy_from_logits_chunk_size": FSDP_DETAIL,
    f"{_ACTOR}.pad_to_length": ALWAYS_PADDING_FREE,
    f"{_REF}.pad_to_length": ALWAYS_PADDING_FREE,
    f"{_ACTOR}.optim.zero_indexed_step": OPTIMIZER,
    "critic.optim.zero_indexed_step": OPTIMIZER,
    f"{_ROLLOUT}.nnodes": RAY_DETAIL,
    f"{_ROLLOUT}.n_gpus_per_node": RAY_DETAIL,
    f"{_ROLLOUT}.full_determinism": SEEDS,
    f"{_ROLLOUT}.seed": SEEDS,
    f"{_ROLLOUT}.router_config_path": ENGINE_KNOB,
    f"{_ROLLOUT}.moe_load_balance_metrics_interval": ENGINE_KNOB,
    f"{_ROLLOUT}.disaggregation.*": ENGINE_KNOB,
    "data.function_tool_path": NoEquivalent("tools are declared in rollout.multi_turn.tool_config_path"),
    "data.audio_key": MULTIMODAL,
    "data.mm_processor_kwargs": MULTIMODAL,
    "critic.loss_scale_factor": Rename("critic.loss_scale_factor"),
    **_each("critic.model", "hf_config_path custom_chat_template exclude_modules lora_adapter_path use_liger "
            "use_fused_kernels fused_kernel_options.impl_backend mtp.*",
            NoEquivalent("the critic shares the model.* settings of the actor")),
    "reward.custom_reward_function.path": Rename("reward.custom_function", _custom_function),
    "reward.custom_reward_function.name": Rename("reward.custom_function", _custom_function_name),
    "reward.num_workers": Rename("reward.num_workers"),
    "reward.reward_manager.name": REWARD_MANAGER,
    "reward.reward_manager.source": Refused(("register", None), "reinforge has no custom reward manager classes; "
                                                                "write a reward.custom_function"),
    "reward.reward_manager.module.path": Refused((None,), "reinforge has no custom reward manager classes; write a "
                                                          "reward.custom_function"),
    "reward.reward_manager.*": NoEquivalent("one reward manager scores every sample in worker processes "
                                            "with reward.timeout_s and reward.num_workers"),
    "reward.sandbox_fusion.*": SANDBOX,
    "sandbox_fusion.*": SANDBOX,
    "algorithm.filter_groups.max_inflight_gen_batches": NoEquivalent(
        "generation batches are drawn one at a time up to algorithm.filter_groups.max_num_gen_batches"),
    "distillation.enabled": Refused((False, None), f"{DISTILLATION.reason}; leave distillation.* out to train on "
                                                   "the task's rewards alone"),
    "distillation.*": DISTILLATION,
    "trainer.checkpoint_callback_class": NoEquivalent("reinforge's checkpoints have no callback hook"),
    "trainer.use_v1": SameAsOurs((False, None), TRAINER_V1.reason),
    "trainer.v1.*": TRAINER_V1,
    "skip.*": SKIP_ROLLOUT,
}


def implied_settings(given: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """Our keys that a verl command implies without naming them: (key, value, why)."""
    implied = []
    nnodes, per_node = given.get("trainer.nnodes", 1), given.get("trainer.n_gpus_per_node", 1)
    num_devices = nnodes * per_node if isinstance(nnodes, int) and isinstance(per_node, int) else 1
    if num_devices > 1:
        implied.append(("trainer.backend", "ray", f"verl runs on Ray; {num_devices} devices need trainer.backend=ray"))
    if given.get(f"{_MODEL}.lora_rank") and f"{_MODEL}.lora_alpha" not in given:
        implied.append(("model.lora.alpha", 16.0, "verl's lora_alpha is 16 when the command leaves it out"))
    if given.get(f"{_MODEL}.lora.rank") and f"{_MODEL}.lora.alpha" not in given:
        implied.append(("model.lora.alpha", 32.0, "verl's Megatron lora.alpha is 32 when the command leaves it out"))
    if given.get("algorithm.filter_groups.enable") is True and "algorithm.filter_groups.max_num_gen_batches" not in given:
        implied.append(("algorithm.filter_groups.max_num_gen_batches", 0,
                        "verl's max_num_gen_batches is 0 (no limit) when the command leaves it out"))
    for buffer in ("reward_model.overlong_buffer", "reward.reward_kwargs.overlong_buffer_cfg"):
        if given.get(f"{buffer}.enable") is True and f"{buffer}.penalty_factor" not in given:
            implied.append(("reward.overlong_buffer.penalty_factor", 0.0,
                            f"the DAPO recipe's {buffer}.penalty_factor is 0 when the command leaves it out"))
    if given.get("model_engine") == "veomni":  # its optim.yaml decays on a cosine, the others keep lr constant
        with_critic = given.get("critic.enable") is True or given.get("algorithm.adv_estimator", "gae") == "gae"
        for section, ours in ((_ACTOR, "actor"), *((("critic", "critic"),) if with_critic else ())):
            if not {f"{section}.optim.lr_scheduler_type", f"{section}.optim.warmup_style"} & set(given):
                implied.append((f"{ours}.optim.schedule", "cosine", f"verl's VeOmni engine decays {ours}'s learning "
                                "rate on a cosine when the command leaves optim.lr_scheduler_type out"))
    implied.append(("actor.router_aux_loss_coef", 0.0,
                    "verl's actor adds no router load-balancing loss to a mixture of experts' policy loss, "
                    "whatever its config's output_router_logits says"))
    if f"{_ACTOR}.clip_ratio" in given:  # verl's clip_ratio_low/high (0.2 in its actor.yaml) win over clip_ratio
        for side in ("low", "high"):
            if f"{_ACTOR}.clip_ratio_{side}" not in given:
                implied.append((f"actor.policy_loss.clip_ratio_{side}", 0.2,
                                f"verl's clip_ratio_{side} is 0.2 when the command leaves it out, and it takes "
                                "precedence over clip_ratio"))
    return implied


def lookup(verl_key: str, table: Mapping[str, Translation] | None = None) -> tuple[str, Translation] | None:
    """The entry that covers ``verl_key`` (its own, else the nearest ``a.b.*`` above it) with its pattern, in
    ``table`` (an entry point's keys over ``VERL_KEYS``; ``VERL_KEYS`` when None)."""
    table = VERL_KEYS if table is None else table
    if verl_key in table:
        return verl_key, table[verl_key]
    if verl_key.rsplit(".", 1)[-1] == "_target_" and verl_key.split(".")[0] in VERL_SECTIONS:
        return verl_key, HYDRA_TARGET
    parts = verl_key.split(".")
    for length in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:length])
        if f"{parent}.*" in table:
            return f"{parent}.*", table[f"{parent}.*"]
        if isinstance(table.get(parent), NoEquivalent):  # a key of a mapping with no equivalent (override_config.x)
            return parent, table[parent]
    return None


def our_key(pattern: str, rename: Rename, verl_key: str) -> str:
    """``rename.ours`` with a trailing ``.*`` replaced by the part of ``verl_key`` below ``pattern``."""
    if not rename.ours.endswith(".*"):
        return rename.ours
    return rename.ours[:-1] + verl_key[len(pattern) - 1:]


VERL_SECTIONS = ("actor_rollout_ref", "algorithm", "critic", "custom_reward_function", "data", "distillation",
                 "global_profiler", "ray_kwargs", "reward", "reward_manager", "reward_model", "sandbox_fusion", "skip",
                 "trainer", "transfer_queue")
"""verl's top-level sections; a key under one of them that the table lacks is not a verl key we know."""

