"""Every check that can run before a model loads: ``preflight(config)`` for an RL run, ``preflight_sft`` for SFT.

``RLTrainer(config)`` and ``SFTTrainer(config)`` run them first, so ``reinforge train`` and a Python caller
that builds a trainer from ``load_config(...)`` get the same one-line refusals. In order: the config's rules
(the schema's own, ``config.validate``, then the names of estimators, losses, KL estimators, schedules and
trackers against their registries, and the rules those entries bring), what a run needs (a model whose
positions hold its lengths, data, the packages of its trackers), the backend against the devices, the scorer
(imported), the memory plan (auto settings resolved), LoRA's target modules, the tools; settings the rest of the
config makes ineffective are a warning each (``ineffective_settings.py``). Then, with the tokenizer, every data
row against its scorer and agent. The trainer then opens the run folder (``TrainingRun.open_run_folder``: a second
run refused, settings a resume cannot take refused by name), still before any weight loads.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reinforge.agent import check_agent_rows, check_tool_turns, check_tools, load_tools
from reinforge.agent.checks import check_images_reach_agents
from reinforge.algorithms import (
    ADVANTAGE_ESTIMATORS,
    BYPASS_LOSS_TYPES,
    KL_CONTROLLERS,
    KL_ESTIMATOR_ALIASES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_IS_LEVELS,
    parse_is_threshold,
    parse_rejection_rules,
)
from reinforge.algorithms.roles import critic_enabled
from reinforge.config import Config, ConfigError
from reinforge.config.schema import ModelConfig
from reinforge.config.sft_schema import SFTConfig
from reinforge.config.validate import choose, model_score_source, validate_config, validate_sft_config
from reinforge.data import RLDataset
from reinforge.engine.lora import check_target_modules, require_peft
from reinforge.engine.memory_plan import ModelShape, check_model_config
from reinforge.engine.moe import ALL_DENSE, declares_experts, routed_layers, router_aux_loss_coef
from reinforge.engine.optim import LR_SCHEDULES
from reinforge.models import load_tokenizer, warn_if_beyond_context, warn_if_rollout_parts_from_training
from reinforge.models.loading import (
    check_loads_as_causal_lm,
    check_model_folder,
    is_local_path,
    read_model_config,
    vocab_rows,
)
from reinforge.models.reward_model import HEADS, check_reward_model
from reinforge.models.value_model import check_critic_folder, check_critic_reads_policy_ids
from reinforge.models.vision import run_processor, why_no_images
from reinforge.reward.data_checks import check_rows_can_be_scored, load_reward_function
from reinforge.reward.remote import authorization_headers
from reinforge.rollout.registry import check_plugin_engine
from reinforge.serve.agents import register_configured_agents
from reinforge.tracking import TRACKING_BACKENDS, backend_problem, missing_backend_package
from reinforge.trainer.ineffective_settings import warn_ineffective_settings
from reinforge.trainer.modes.partial import refuse_agent_rows
from reinforge.workers.memory_settings import apply_memory_plan, has_auto_settings

logger = logging.getLogger(__name__)

CLASSIFICATION_HEADS = tuple(HEADS)
"""Endings of architecture names whose models score text instead of writing it."""

if TYPE_CHECKING:
    from reinforge.controller import RolePlacement
    from reinforge.reward.data_checks import Scorer
    from reinforge.workers.reward_model import RewardInputs

def check_config(config: Config) -> None:
    """Every rule of an RL config: the schema's own, then those naming registry entries. Raises ConfigError."""
    validate_config(config)
    algorithm, actor = config.algorithm, config.actor
    choose("algorithm.adv_estimator", algorithm.adv_estimator, sorted(ADVANTAGE_ESTIMATORS))
    choose("actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, sorted(POLICY_LOSSES))
    choose("actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    choose("critic.loss_agg_mode", config.critic.loss_agg_mode, LOSS_AGG_MODES)
    kl_names = sorted({*KL_ESTIMATORS, *KL_ESTIMATOR_ALIASES})
    kl_names += [f"{name}+" for name in kl_names]
    choose("actor.kl_loss_type", actor.kl_loss_type, kl_names)
    choose("algorithm.kl_penalty", algorithm.kl_penalty, kl_names)
    choose("algorithm.kl_ctrl.type", algorithm.kl_ctrl.type, list(KL_CONTROLLERS))
    choose("actor.optim.schedule", actor.optim.schedule, list(LR_SCHEDULES))
    choose("critic.optim.schedule", config.critic.optim.schedule, list(LR_SCHEDULES))
    check_loggers(config.trainer.loggers)
    correction = algorithm.rollout_correction
    if correction.rollout_is is not None:
        choose("algorithm.rollout_correction.rollout_is", correction.rollout_is, ROLLOUT_IS_LEVELS)
    choose("algorithm.rollout_correction.loss_type", correction.loss_type, BYPASS_LOSS_TYPES)
    try:
        parse_is_threshold(correction.rollout_is_threshold)
        parse_rejection_rules(correction.rollout_rs, correction.rollout_rs_threshold)
    except ValueError as error:
        raise ConfigError(str(error)) from error

    estimator, rollout = ADVANTAGE_ESTIMATORS[algorithm.adv_estimator], config.rollout
    if estimator.needs_groups and rollout.n < 2:
        raise ConfigError(f"rollout.n={rollout.n} is too small for algorithm.adv_estimator={algorithm.adv_estimator}, "
                          "which compares samples of one prompt; set rollout.n to 2 or more")
    if estimator.needs_critic and config.critic.enable is False:
        raise ConfigError(f"algorithm.adv_estimator={algorithm.adv_estimator} needs a critic but critic.enable=false; "
                          "remove critic.enable or choose a critic-free estimator such as grpo")
    if correction.bypass_mode and estimator.needs_sum_pi_squared:
        raise ConfigError(f"algorithm.adv_estimator={algorithm.adv_estimator} needs the old policy's sum of pi^2 from "
                          "a log-prob pass, which algorithm.rollout_correction.bypass_mode=true skips; "
                          "set bypass_mode=false")
    if config.trainer.mode != "sync" and config.trainer.proximal == "loglinear" and estimator.needs_sum_pi_squared:
        raise ConfigError(f"algorithm.adv_estimator={algorithm.adv_estimator} needs the old policy's sum of pi^2 from "
                          f"a log-prob pass, which trainer.proximal=loglinear skips on the stale batches of "
                          f"trainer.mode={config.trainer.mode}; set trainer.proximal=recompute")
    if critic_enabled(config):
        critic = config.critic
        if not critic.cliprange_value > 0:
            raise ConfigError(f"critic.cliprange_value={critic.cliprange_value} must be positive (how far a value may "
                              "move from the one before the update; 0.5 is usual)")
        if critic.ppo_epochs is not None and critic.ppo_epochs < 1:
            raise ConfigError(f"critic.ppo_epochs={critic.ppo_epochs} must be at least 1, or null (actor.ppo_epochs)")
        if critic.warmup_steps < 0:
            raise ConfigError(f"critic.warmup_steps={critic.warmup_steps} must be 0 (none) or more")


def check_sft_config(config: SFTConfig) -> None:
    """Every rule of an SFT config: the schema's own, then the schedule's and the trackers' names."""
    validate_sft_config(config)
    choose("optim.schedule", config.optim.schedule, list(LR_SCHEDULES))
    check_loggers(config.trainer.loggers)


def check_loggers(loggers: list[str]) -> None:
    """trainer.loggers names tracking backends (the tracker starts only after the model has loaded)."""
    unknown = [name for name in loggers if name not in TRACKING_BACKENDS]
    if unknown:
        raise ConfigError(f"trainer.loggers names {unknown[0]!r}, which is not a tracking backend; use any of "
                          f"{', '.join(sorted(TRACKING_BACKENDS))}")


def require_logger_packages(loggers: list[str]) -> None:
    """What a training run needs beyond a valid config: the packages of its trackers (a config naming wandb
    stays valid, and translatable, where wandb is not installed)."""
    for name in loggers:
        missing = missing_backend_package(name)
        if missing:
            raise ConfigError(f"trainer.loggers names {name}, which needs the {missing} package, not installed here; "
                              f"pip install {missing} (or reinforge[tracking]), or remove {name} from trainer.loggers")
        problem = backend_problem(name)
        if problem:
            raise ConfigError(f"trainer.loggers names {name}: {problem}")


def check_router_aux_loss_has_experts(key: str, value: float | str | None, model: ModelConfig) -> None:
    """A weight above 0 for the routers' load-balancing loss (``key``) on a model without experts, refused before
    its weights load, as TRL refuses it: there is no router to balance (0, null and declared stay fine). An aux loss
    asked for (by ``key`` or, for a local folder, by the model config) on a family whose loss reinforge cannot
    compute as the family's is refused too (``engine.moe.router_aux_loss_coef``)."""
    weighed = not isinstance(value, str) and value is not None and value > 0
    if not weighed and (isinstance(value, (int, float)) or not is_local_path(model.path)
                        or not (Path(model.path).expanduser() / "config.json").is_file()):
        return
    model_config = read_model_config(model.path, model.trust_remote_code)
    if weighed and not declares_experts(model_config):
        raise ConfigError(f"{key}={value} weighs a mixture of experts' load-balancing loss, but model.path={model.path} "
                          f"is a {model_config.model_type!r} model without experts, which has no router to balance; "
                          f"remove {key} or set it to 0")
    try:
        coef = router_aux_loss_coef(model_config, value, key)
    except ValueError as error:
        raise ConfigError(f"{error} (model.path={model.path})") from None
    if coef > 0 and routed_layers(model_config) == 0:
        source = f"{key}={value}" if weighed else f"the model config's router_aux_loss_coef={coef} ({key}={value})"
        raise ConfigError(f"{source} weighs a mixture of experts' load-balancing loss, but model.path={model.path} is a "
                          f"{model_config.model_type!r} model whose {ALL_DENSE}, so there is no router to balance; "
                          f"set {key}=0")


def require_model_and_data(model_path: str, train_files: list[str], example_file: str) -> None:
    """What a training run needs beyond a valid config: a model and training data (RL and SFT)."""
    if not model_path:
        raise ConfigError("model.path is not set; pass model.path=/path/to/hf_model (a local folder or hub id)")
    if not train_files:
        raise ConfigError(f"data.train_files is empty; pass data.train_files=[{example_file}]")


def check_writes_text(path: str, key: str) -> None:
    """A local model folder whose config.json names a classification head (a reward model's) is refused: loaded as
    a causal LM it would get a new, random output layer. Hub ids and folders without config.json pass."""
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # transformers says what is wrong with it when the model loads
    heads = [name for name in architectures if isinstance(name, str) and name.endswith(CLASSIFICATION_HEADS)]
    if heads:
        raise ConfigError(f"{key}={path} is {heads[0]} (in its config.json), a classification model that writes no "
                          "text; point it at a causal LM folder (...ForCausalLM), and give a reward model to "
                          "reward.reward_model.model_path")


WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def check_checkpoint_room(model_path: str, output_dir: str, key: str = "trainer.output_dir") -> None:
    """One ConfigError when the disk of ``output_dir`` cannot hold even one checkpoint, which every run writes (at
    least at its end): its hf/ model alone takes about half the bytes of ``model_path``'s weight files or more (they
    may be float32 where the checkpoint is bfloat16); a LoRA run's hf/ holds the merged model as well. A model that
    is no local folder is not checked."""
    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        return
    weights = sum(path.stat().st_size for path in folder.iterdir()
                  if path.is_file() and path.name.endswith(WEIGHT_FILE_SUFFIXES))
    try:
        free = free_disk_bytes(Path(output_dir))
    except OSError:
        return  # the run folder's own checks say what is wrong with it
    if free < weights // 2:
        raise ConfigError(f"{key}={output_dir}: its disk has {_bytes_text(free)} free, and a checkpoint (every run "
                          f"writes one, at least at its end) holds the model's weights, about {_bytes_text(weights // 2)} "
                          f"or more ({model_path} has {_bytes_text(weights)} of them); free space there, or set "
                          f"{key} to a folder on a disk with room")


def free_disk_bytes(path: Path) -> int:
    """The free bytes of the disk that holds ``path``, or would hold it (that of its nearest existing folder)."""
    import shutil

    existing = path.expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def _bytes_text(count: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


def refuse_launched_processes(what: str, fix: str) -> None:
    """Refuse a run that a launcher (torchrun) started as several processes (``WORLD_SIZE`` > 1) where ``what``
    runs in one: each process would run all of it, into the same run folder."""
    world_size = os.environ.get("WORLD_SIZE", "1").strip()
    if world_size.isdigit() and int(world_size) > 1:
        raise ConfigError(f"{what}, but WORLD_SIZE={world_size}: a launcher (torchrun) started {world_size} processes, "
                          f"each of which would run all of it into the same run folder; {fix}")


def check_devices(config: Config | SFTConfig, placement: RolePlacement | None = None) -> None:
    """The backend against the devices: the local backend runs every role in this process on one device, which
    must exist when trainer.device=cuda. ``placement``: the RL run's pools (by default one of trainer.nnodes x
    trainer.devices_per_node devices)."""
    trainer = config.trainer
    backend = getattr(trainer, "backend", "local")
    if backend != "local":
        return
    if placement is None:
        num_devices = getattr(trainer, "nnodes", 1) * getattr(trainer, "devices_per_node", 1)
        if num_devices > 1:
            raise ConfigError(f"trainer.backend=local runs every worker in this process on one device, but "
                              f"trainer.nnodes x trainer.devices_per_node = {num_devices}; set trainer.backend=ray")
    else:
        too_big = {name: pool.world_size for name, pool in placement.pools.items() if pool.world_size > 1}
        if too_big:
            raise ConfigError(f"trainer.backend=local runs every role in this process on one device, but the resource "
                              f"pools ask for {too_big} devices; set trainer.backend=ray")
    if trainer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but this machine has no visible CUDA device; "
                              "use trainer.device=auto or trainer.device=cpu")


def check_fp8_kv_cache_device(config: Config) -> None:
    """rollout.kv_cache_dtype=fp8 on the native engine refused before the model loads where this process's GPU (the
    local backend's) cannot compile its fp8 kernels (``kv_quant.fp8_device_refusal``); a Ray member's engine refuses
    it on its own GPU."""
    import torch

    from reinforge.workers.memory_settings import native_engine_runs

    if config.rollout.kv_cache_dtype != "fp8" or config.trainer.backend != "local" or \
            config.trainer.device == "cpu" or not torch.cuda.is_available() or not native_engine_runs(config):
        return
    from reinforge.rollout.native.engine import _triton_available
    from reinforge.rollout.native.kv_quant import fp8_device_refusal

    refusal = fp8_device_refusal(torch.device("cuda", torch.cuda.current_device())) if _triton_available() else None
    if refusal is not None:
        raise ConfigError(refusal)


def check_batch_splits(config: Config, placement: RolePlacement | None = None) -> None:
    """On Ray, the samples of a step, and of each mini-batch, split evenly over the members of the roles that train:
    a share one row short is padded with copies of other rows, which an update would train on twice (the local
    backend runs one member: ``check_devices``)."""
    if config.trainer.backend != "ray":
        return
    trainer, n = config.trainer, config.rollout.n
    samples = config.data.train_batch_size * n
    mini_batch = (config.actor.mini_batch_size or config.data.train_batch_size) * n
    roles = ["actor_rollout"] + (["critic"] if critic_enabled(config) else [])
    for role in roles:
        members = (placement.pool_for(role).world_size if placement is not None
                   else trainer.nnodes * trainer.devices_per_node)
        for count, what in ((samples, "data.train_batch_size"), (mini_batch, "actor.mini_batch_size")):
            if count % members:
                raise ConfigError(f"{what} x rollout.n = {count} samples do not split evenly over the {members} members "
                                  f"of role {role!r}; the padding rows would be trained on twice. Choose sizes whose "
                                  f"product is a multiple of {members}, or another number of devices")


@dataclass
class Checked:
    """What ``preflight`` loaded while checking, for the trainer to use: nothing is loaded twice."""

    tokenizer: Any
    tools: dict[str, Any]
    custom_scorer: Scorer | None
    train_set: RLDataset
    val_set: RLDataset | None


def preflight(config: Config, placement: RolePlacement | None = None,
              reward_functions: Sequence[Callable[..., Any]] | None = None,
              prompt_sets: Mapping[str, RLDataset] | None = None) -> Checked:
    """Every check of an RL run that can run before a model loads; resolves the memory plan's auto settings in
    ``config``. Raises ConfigError (or the check's own one-line error) naming the value and the fix.
    ``reward_functions``: reward function objects that score every row instead of the scorers. ``prompt_sets``:
    the train (and, with data.val_files, val) ``RLDataset`` already tokenized from config.data with the run's
    tokenizer, no prompt longer than data.max_prompt_length (``api.inputs.whole_prompts``), taken rather than
    tokenized again."""
    check_config(config)
    refuse_launched_processes("an RL run's controller runs in one process and starts its workers itself",
                              "start it as one process, with trainer.backend=ray trainer.devices_per_node=N to train "
                              "on N devices")
    require_model_and_data(config.model.path, config.data.train_files, "path/to/train.parquet")
    check_writes_text(config.model.path, "model.path")
    check_model_config(config.model.path)  # its experts and window, also where no memory setting is auto
    check_loads_as_causal_lm(config.model.path, config.model.trust_remote_code)
    check_checkpoint_room(config.model.path, config.trainer.output_dir)
    longest, source = config.data.max_prompt_length + config.data.max_response_length, \
        "data.max_prompt_length + data.max_response_length"
    warn_if_beyond_context(config.model.path, longest, source)  # refused here where positions are a learned table
    warn_if_rollout_parts_from_training(config.model.path, longest, source)
    check_router_aux_loss_has_experts("actor.router_aux_loss_coef", config.actor.router_aux_loss_coef, config.model)
    check_target_modules(config.model.lora, config.model.path)  # adapters that would match no layer
    require_peft(config.model.lora)
    if critic_enabled(config) and config.critic.model_path and is_local_path(config.critic.model_path):
        # else it fails once the actor has loaded
        check_critic_folder(config.critic.model_path, "critic.model_path", config.model.trust_remote_code)
        warn_if_beyond_context(config.critic.model_path, longest, source)  # it scores every whole sequence
    total_steps = config.trainer.total_steps
    if critic_enabled(config) and total_steps is not None and config.critic.warmup_steps >= total_steps:
        logger.warning("critic.warmup_steps=%d trains the critic alone for that many steps, and the run has %d "
                       "(trainer.total_steps): its actor never updates; lower critic.warmup_steps, unless the run "
                       "is to warm up the critic alone", config.critic.warmup_steps, total_steps)
    require_logger_packages(config.trainer.loggers)
    check_devices(config, placement)
    check_fp8_kv_cache_device(config)
    check_batch_splits(config, placement)
    warn_ineffective_settings(config)  # before the memory plan writes its choices into the auto settings
    custom_scorer = load_reward_function(config.reward, reward_functions)  # a broken one fails before any model
    if config.trainer.backend == "ray" and reward_functions:  # they travel to the reward role's member processes
        from reinforge.controller.ray_backend import check_sendable

        for index, function in enumerate(reward_functions):
            name = getattr(function, "__name__", type(function).__name__)
            check_sendable(function, f"reward_functions[{index}] ({name})")
    reward_inputs = check_reward_model_settings(config)
    check_judge_settings(config)
    if config.reward.remote.enable:  # the endpoint's key is read from the environment now, not at the first step
        try:
            authorization_headers(config.reward.remote.api_key_env)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    # a vision-language model's plan counts the image tokens of its rows (unless data.max_image_tokens bounds them)
    plan_after_data = config.data.max_image_tokens is None and has_auto_settings(config) and \
        ModelShape.from_model_path(config.model.path).vision is not None
    check_ray_cluster(config, placement)  # a cluster short of devices names its fix; a plan split over them would not
    if not plan_after_data:
        apply_memory_plan(config)  # auto memory settings resolved, or MemoryPlanError
    check_plugin_engine(config.rollout.name)  # hf, native, or an engine a package adds through its entry point
    register_configured_agents(config.rollout.multi_turn)  # rollout.multi_turn.openai_agents, as agent loops
    tools = load_tools(config.rollout.multi_turn)
    check_tools(config.rollout.multi_turn.format, tools)  # an unknown format, a tool that cannot work

    tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path,
                               trust_remote_code=config.model.trust_remote_code)
    check_stop_tokens(config.rollout.stop_token_ids, config.model)
    if critic_enabled(config) and config.critic.model_path and is_local_path(config.critic.model_path) \
            and not _same_folder(config.critic.model_path, config.model.path):  # the policy's own model reads its ids
        check_critic_reads_policy_ids(config.critic.model_path, tokenizer, "critic.model_path",
                                      config.model.trust_remote_code,
                                      vocab_rows(config.model.path, config.model.trust_remote_code))
    schemas = [tool.schema for tool in tools.values()]
    processor = run_processor(config.model, config.data)  # a vision-language model's: rows may hold images
    if processor is not None and critic_enabled(config):
        raise ConfigError(f"algorithm.adv_estimator={config.algorithm.adv_estimator} trains a critic, and "
                          f"{config.model.path} is a vision-language model, whose critic reinforge does not build; "
                          "use a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...)")
    why = None if processor is not None else why_no_images(config.model.path, config.model.trust_remote_code)

    def prompt_set(split: str) -> RLDataset:
        if prompt_sets is None:
            return RLDataset.from_config(config.data, tokenizer, split=split, tool_schemas=schemas,
                                         processor=processor, why_no_images=why)
        dataset = prompt_sets[split]
        assert all(len(example.prompt_ids) <= config.data.max_prompt_length for example in dataset.examples)
        dataset.report(config.data)  # counted under the run's limit, as the run's own build would count them
        return dataset

    train_set = prompt_set("train")
    if not (model_score_source(config) is not None and config.reward.combine.mode == "replace"):  # else no rule scores
        check_rows_can_be_scored(train_set, config.reward, custom_scorer, reward_functions)
    check_agent_rows(((f"train {train_set.where(example)}", example.agent_name, example.extra_info)
                      for example in train_set.examples), tools)
    if config.trainer.mode == "async":  # its rollouter runs no agent loop
        refuse_agent_rows(example.agent_name for example in train_set.examples)
    val_set = None
    if config.data.val_files:
        val_set = prompt_set("val")
        check_rows_can_be_scored(val_set, config.reward, custom_scorer, reward_functions)
        check_agent_rows(((f"val {val_set.where(example)}", example.agent_name, example.extra_info)
                          for example in val_set.examples), tools)
    check_tool_turns((example.agent_name for dataset in (train_set, val_set) if dataset is not None
                      for example in dataset.examples), tokenizer, config.data.chat_template)
    check_images_reach_agents((f"{name} {dataset.where(example)}", example.agent_name, bool(example.images))
                              for name, dataset in (("train", train_set), ("val", val_set)) if dataset is not None
                              for example in dataset.examples)
    if reward_inputs is not None:
        check_reward_model_renders(reward_inputs, [dataset for dataset in (train_set, val_set) if dataset is not None],
                                   config.reward.reward_model.model_path)
    if config.reward.judge.enable:
        check_judge_reads_ground_truths(config.reward.judge.template, train_set)
    if plan_after_data:
        if processor is not None:
            config.data.max_image_tokens = most_image_tokens([train_set, val_set], processor.image_token_id)
        apply_memory_plan(config)
    return Checked(tokenizer, tools, custom_scorer, train_set, val_set)


def check_ray_cluster(config: Config, placement: RolePlacement | None = None) -> None:
    """On Ray, the pools of the run's roles against the cluster's devices (or CPU slots), before the memory plan: a
    plan for more members than the cluster holds splits the host's memory over devices that are not there, and its
    refusal would name a larger device instead of fewer trainer.devices_per_node. Joins (or starts) Ray."""
    if config.trainer.backend != "ray":
        return
    from reinforge.controller.ray_backend import check_cluster_holds, connect_ray
    from reinforge.trainer.placement import default_placement, roles_with_groups

    connect_ray(config.trainer.ray_address, device=config.trainer.device)
    placement = placement or default_placement(config)
    check_cluster_holds([placement.pool_for(role) for role in roles_with_groups(config)])


def check_stop_tokens(stop_token_ids: list[int], model: ModelConfig) -> None:
    """rollout.stop_token_ids past the model's embedding rows (ids of another tokenizer, say) are refused: the model
    never writes them, so a sample would run on to data.max_response_length where it was meant to stop."""
    if not stop_token_ids or not is_local_path(model.path):
        return
    rows = vocab_rows(model.path, model.trust_remote_code)
    beyond = [token for token in stop_token_ids if rows is not None and token >= rows]
    if beyond:
        raise ConfigError(f"rollout.stop_token_ids={stop_token_ids} holds {beyond[0]}, past the {rows} token ids of "
                          f"model.path={model.path} (vocab_size in its config.json), so the model never writes it; "
                          "give ids of the model's own tokenizer (tokenizer.convert_tokens_to_ids)")


def _same_folder(path: str, other: str) -> bool:
    return Path(path).expanduser().resolve() == Path(other).expanduser().resolve()


def most_image_tokens(datasets: Sequence[RLDataset | None], image_token_id: int) -> int | None:
    """The most image tokens a prompt of ``datasets`` holds (what a vision-language run's memory plan counts the
    tower's patches by, as data.max_image_tokens); None when no prompt has an image."""
    most = max((example.prompt_ids.count(image_token_id) for dataset in datasets if dataset is not None
                for example in dataset.examples), default=0)
    return most or None


def check_reward_model_settings(config: Config) -> RewardInputs | None:
    """With reward.reward_model.enable: its model is a classification model with num_labels=1 with a tokenizer (read
    from its folder, before any model loads), and reward.reward_model.input_tokenizer loads; the packed passes run
    any architecture transformers loads. Returns the reward model's ``RewardInputs`` (None when it is off)."""
    from reinforge.workers.reward_model import build_reward_inputs

    settings = config.reward.reward_model
    if not settings.enable:
        return None
    check_reward_model(settings.model_path, settings.trust_remote_code)
    if settings.max_length is not None:
        warn_if_beyond_context(settings.model_path, settings.max_length, "reward.reward_model.max_length")
        return build_reward_inputs(config)  # both tokenizers load, and whether responses are re-rendered is settled
    fix = ("reward.reward_model.max_length is unset, so the reward model reads that many; set it to {limit} or fewer "
           "(a longer input loses its end, counted in reward_model/truncated), or lower data.max_prompt_length + "
           "data.max_response_length")
    lengths = config.data.max_prompt_length + config.data.max_response_length
    source = "the reward model's input, data.max_prompt_length + data.max_response_length"
    warned = warn_if_beyond_context(settings.model_path, lengths, source, fix=fix + " to {limit} or fewer")
    inputs = build_reward_inputs(config)
    if not warned and inputs.max_length > lengths:  # with the tokens its template writes after a finished turn
        warn_if_beyond_context(settings.model_path, inputs.max_length,
                               f"{source}, plus the {inputs.max_length - lengths} token(s) the chat template writes "
                               "after a finished turn", fix=fix + " below {limit}")
    return inputs


def check_reward_model_renders(inputs: RewardInputs, datasets: Sequence[RLDataset], path: str) -> None:
    """Where the responses are re-rendered in the reward model's chat template, every chat prompt renders there with
    an answer after it: a template that refuses a prompt's messages (a system role, turns that do not alternate) is
    one line naming the row, before any model loads, not an error of the first step's scoring."""
    from reinforge.data.chat_template import apply_chat_template, template_error_message

    if inputs.policy_tokenizer is None:
        return
    for dataset in datasets:
        for example in dataset.examples:
            if isinstance(example.raw_prompt, str):
                continue
            messages = [dict(message) for message in example.raw_prompt] + [{"role": "assistant", "content": "?"}]
            try:
                apply_chat_template(inputs.rm_tokenizer, messages, add_generation_prompt=False, tokenize=False)
            except Exception as error:
                raise ConfigError(f"{dataset.where(example)}: " + template_error_message(
                    error, "its prompt with an answer after it",
                    f"the chat_template of reward.reward_model.model_path={path}").replace(
                    "the model's chat template", "the reward model's chat template", 1)) from None


def check_judge_reads_ground_truths(template: str, dataset: RLDataset) -> None:
    """Where reward.judge.template shows ``{ground_truth}``: refused in one line when no training row has one (the
    judge would read an empty reference answer for every sample), one warning line when some lack it."""
    from reinforge.reward.judge import read_template, template_fields

    if "ground_truth" not in template_fields(read_template(template)):
        return
    missing = [example for example in dataset.examples if example.ground_truth is None]
    if not missing:
        return
    if len(missing) == len(dataset.examples):
        files = ", ".join(sorted({dataset.where(example).split(" of ", 1)[1] for example in missing}))
        raise ConfigError(f"no row of {files} has a ground truth (reward_model.ground_truth or a ground_truth column), "
                          "which reward.judge.template shows ({ground_truth}), so the judge would read an empty "
                          "reference answer for every sample; add one to the rows, or remove {ground_truth} from the "
                          "template")
    logger.warning("%d of %d rows of the training data have no ground truth, which reward.judge.template "
                   "shows ({ground_truth}): the judge reads an empty reference answer for them (first: %s)",
                   len(missing), len(dataset.examples), dataset.where(missing[0]))


def check_judge_settings(config: Config) -> None:
    """With reward.judge.enable: its template shows the response and names known fields, its model folder is there
    (or it is the policy), and parse=yes_no's answers are one token each of its vocabulary; a judge without the chat
    template reward.judge.chat_template asks for is one warning line."""
    from reinforge.reward.judge import answer_token_id, check_template, read_template

    settings = config.reward.judge
    if not settings.enable:
        return
    try:
        check_template(read_template(settings.template), "reward.judge.template")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    path = config.model.tokenizer_path or config.model.path if settings.model_path == "policy" else settings.model_path
    if settings.model_path != "policy" and is_local_path(path):
        check_model_folder(path, "reward.judge.model_path")
        check_writes_text(path, "reward.judge.model_path")
    if settings.parse == "yes_no" or settings.chat_template:
        tokenizer = load_tokenizer(path, trust_remote_code=settings.trust_remote_code)
    if settings.chat_template and not getattr(tokenizer, "chat_template", None):
        logger.warning("reward.judge.chat_template=true, but the judge at %s has no chat template: it reads "
                       "reward.judge.template's text as it is; set reward.judge.chat_template=false to say so, or "
                       "add a chat template to its tokenizer_config.json", path)
    if settings.parse == "yes_no":
        try:
            answer_token_id(tokenizer, settings.yes_token, "reward.judge.yes_token")
            answer_token_id(tokenizer, settings.no_token, "reward.judge.no_token")
        except ValueError as error:
            raise ConfigError(str(error)) from None


def preflight_sft(config: SFTConfig) -> Any:
    """Every check of an SFT run that can run before its model loads; returns the run's processor (``run_processor``,
    its pixel bounds checked; None for a text model), for the trainer: it is loaded once."""
    check_sft_config(config)
    refuse_launched_processes("reinforge sft trains in one process",
                              "start it as one process (reinforge rm and dpo shard over torchrun's processes)")
    require_model_and_data(config.model.path, config.data.train_files, "path/to/train.jsonl (rows with messages)")
    check_model_config(config.model.path)
    check_checkpoint_room(config.model.path, config.trainer.output_dir)
    check_router_aux_loss_has_experts("trainer.router_aux_loss_coef", config.trainer.router_aux_loss_coef, config.model)
    processor = run_processor(config.model, config.data)  # its pixel bounds refused before the run folder opens
    require_logger_packages(config.trainer.loggers)
    require_peft(config.model.lora)
    check_devices(config)
    warn_ineffective_settings(config)
    warn_if_beyond_context(config.model.path, config.data.max_length, "data.max_length")
    return processor
