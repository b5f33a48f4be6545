"""The config's own rules: what the schema's fields say about each other, checked as the config loads.

Each failure says how to fix it. Rules that name entries of the registries above config (advantage
estimators, policy losses, KL estimators, schedules, trackers) are ``reinforge.trainer.preflight``'s,
which runs these too.
"""

from __future__ import annotations

import math
import re

from reinforge.config.errors import ConfigError
from reinforge.config.schema import (
    COMBINE_MODES,
    DECLARED_ROUTER_AUX_LOSS,
    DECODE_PRODUCTS,
    FILTER_METRICS,
    JUDGE_PARSE_RULES,
    REMOTE_PROTOCOLS,
    TRUNCATION_MODES,
    Config,
    DataConfig,
    LoraConfig,
    OptimConfig,
    RunConfig,
    UpdateConfig,
)
from reinforge.config.sft_schema import SFT_LOSS_TOKENS, SFT_TRUNCATION_MODES, SFTConfig, SFTDataConfig

MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""The values of model.dtype (``models.loading.DTYPES`` and auto)."""


CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": MODEL_DTYPES,
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.backend": ("local", "ray"),
    "trainer.mode": ("sync", "one_step_off", "async"),
    "trainer.proximal": ("recompute", "loglinear"),
    "rollout.kv_cache_dtype": ("auto", "fp8"),
    "rollout.decode_products": DECODE_PRODUCTS,
    "rollout.multi_turn.tool_response_truncate_side": ("middle", "left", "right"),
    "algorithm.filter_groups.metric": FILTER_METRICS,
    "reward.combine.mode": COMBINE_MODES,
    "reward.judge.parse": JUDGE_PARSE_RULES,
    "reward.remote.protocol": REMOTE_PROTOCOLS,
}
"""The values an RL config's text settings take (the loader names them where a value is no text at all)."""


def choose(key: str, value: object, choices: tuple[str, ...] | list[str] | None = None) -> None:
    choices = CHOICES[key] if choices is None else choices
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}")


KV_CACHE_DTYPE_NAMES = {"bf16": "auto", "bfloat16": "auto", "fp8_e4m3": "fp8"}
"""Other names of ``rollout.kv_cache_dtype``'s values: bf16 is the default's cache (the model's dtype, bfloat16), and
fp8_e4m3 is vLLM's name of fp8."""


def _kv_cache_dtype(config: Config) -> None:
    """``rollout.kv_cache_dtype`` is one of its values or a name of one (``KV_CACHE_DTYPE_NAMES``), which becomes
    that value; bf16 on a model run in another dtype is refused (the cache is the model's dtype or fp8)."""
    value = config.rollout.kv_cache_dtype
    if isinstance(value, str) and value.lower() in KV_CACHE_DTYPE_NAMES:
        float32_auto = config.model.dtype == "auto" and config.trainer.device == "cpu"  # auto: float32 on a CPU
        if value.lower() in ("bf16", "bfloat16") and (config.model.dtype not in ("auto", "bfloat16") or float32_auto):
            raise ConfigError(f"rollout.kv_cache_dtype={value} with model.dtype={config.model.dtype}"
                              f"{' on trainer.device=cpu (float32)' if float32_auto else ''}: the native engine "
                              "keeps the KV cache in the model's dtype (auto) or in fp8; set rollout.kv_cache_dtype="
                              "auto, or model.dtype=bfloat16 for a bfloat16 cache")
        config.rollout.kv_cache_dtype = KV_CACHE_DTYPE_NAMES[value.lower()]
    choose("rollout.kv_cache_dtype", config.rollout.kv_cache_dtype,
           (*CHOICES["rollout.kv_cache_dtype"], *KV_CACHE_DTYPE_NAMES))


def _in_range(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{key}={value} is out of range; it must be between {low:g} and {high:g}")


def _finite(key: str, value: float, *, at_least: float | None = None, fix: str = "") -> None:
    """A finite number (not nan or inf), and at least ``at_least`` when given."""
    if not -float("inf") < value < float("inf") or (at_least is not None and value < at_least):
        bound = f" >= {at_least:g}" if at_least is not None else ""
        raise ConfigError(f"{key}={value} must be a finite number{bound}{fix}")


MAX_TIMEOUT_S = 1e6
"""The longest time limit (11.6 days): waits of more than 2**31 milliseconds raise OverflowError (poll, time_t),
so reward.timeout_s=.inf or trainer.call_timeout_s=1e12 failed at the first call, after the model had loaded."""


MIN_SCORER_MEMORY_MB = 128
"""reward.max_memory_mb below this leaves a scoring process no room for its own imports."""


def _check_timeout(key: str, value: float, what: str) -> None:
    if not 0 < value <= MAX_TIMEOUT_S:  # also nan
        raise ConfigError(f"{key}={value} must be positive and at most {MAX_TIMEOUT_S:.0f} ({what})")


def validate_update(prefix: str, update: UpdateConfig) -> None:
    """The update settings of the section at ``prefix`` (actor, critic, an SFT run's trainer)."""
    if not update.grad_clip > 0:  # clip_grad_norm_ with a negative bound flips every gradient's sign; also nan
        raise ConfigError(f"{prefix}.grad_clip={update.grad_clip} must be positive: the largest gradient norm kept "
                          "(1.0 is usual; a large value such as 1e9 effectively turns clipping off)")


MAX_SEED = 2**32 - 1
"""numpy's seeds (np.random.seed, the data order's default_rng) are 0..2**32 - 1."""


def _check_seed(key: str, seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:  # numpy refused it, the data order's only when the first batch was drawn
        raise ConfigError(f"{key}={seed} must be between 0 and {MAX_SEED} (a seed numpy accepts)")


def validate_sample_limits(data: DataConfig | SFTDataConfig) -> None:
    """data.max_train_samples and data.max_val_samples (RL and SFT): a count of rows, or null for all of them."""
    _check_seed("data.seed", data.seed)
    for split in ("train", "val"):
        value = getattr(data, f"max_{split}_samples")
        if value is not None and value < 1:
            raise ConfigError(f"data.max_{split}_samples={value} must be at least 1, or null for every row")


def validate_optim(prefix: str, optim: OptimConfig) -> None:
    """Learning rate, warmup and schedule of the optimizer section at ``prefix`` (actor.optim, optim, ...)."""
    if not 0 <= optim.lr < float("inf"):  # also nan
        problem = "is negative" if optim.lr < 0 else "is not a number" if optim.lr != optim.lr else "is infinite"
        raise ConfigError(f"{prefix}.lr={optim.lr} {problem}; a learning rate is >= 0 (e.g. 1e-6)")
    if optim.warmup_steps < 0:
        raise ConfigError(f"{prefix}.warmup_steps={optim.warmup_steps} must be >= 0")
    _in_range(f"{prefix}.warmup_ratio", optim.warmup_ratio, 0.0, 1.0)
    _in_range(f"{prefix}.min_lr_ratio", optim.min_lr_ratio, 0.0, 1.0)
    # AdamW itself refuses these, but only once the model has loaded (a bare IndexError for one beta)
    if len(optim.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in optim.betas):
        raise ConfigError(f"{prefix}.betas={list(optim.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    _finite(f"{prefix}.eps", optim.eps, at_least=0.0, fix=" (AdamW's epsilon, e.g. 1e-8)")
    _finite(f"{prefix}.weight_decay", optim.weight_decay, at_least=0.0, fix=" (AdamW's weight decay, e.g. 0.01)")


def validate_model_dtype(dtype: str) -> None:
    choose("model.dtype", dtype)



def validate_lora(lora: LoraConfig) -> None:
    """model.lora of a run that trains adapters (RL's actor, DPO's policy)."""
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank={lora.rank} must be 0 (off) or a positive adapter rank such as 32")
    if lora.rank > 0 and not lora.target_modules:
        raise ConfigError("model.lora.target_modules is empty; name the linear layers that get adapters, "
                          "e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]")
    if lora.rank > 0 and not 0 < lora.alpha < float("inf"):  # also nan
        raise ConfigError(f"model.lora.alpha={lora.alpha} scales the adapters' output by alpha / rank, so they would "
                          "change nothing and learn nothing; set a positive alpha (e.g. 2 x model.lora.rank)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={lora.dropout} must be in [0, 1)")
    outside = [name for name in lora.target_modules if name in ("lm_head", "embed_tokens")]
    if lora.rank > 0 and outside:
        raise ConfigError(f"model.lora.target_modules names {outside[0]}, outside the decoder layers: the fused "
                          "log-prob pass reads the output projection's weight directly and would ignore its adapter; "
                          "adapt only the layers inside the decoder blocks (q_proj ... down_proj)")


def validate_run(trainer: RunConfig) -> None:
    """The run-folder settings that RL and SFT share: folder, length, device, cadence, resume."""
    if not str(trainer.output_dir).strip():  # an unset shell variable ($RUN_DIR): the current folder would be the run's
        raise ConfigError("trainer.output_dir is empty, which would make the current folder the run folder (its "
                          "checkpoints/, metrics.jsonl, and what trainer.resume=never removes); name the run's own "
                          "folder, e.g. trainer.output_dir=runs/my_run")
    if trainer.total_steps is not None and trainer.total_steps < 1:
        raise ConfigError(f"trainer.total_steps={trainer.total_steps} trains nothing; set it to 1 or more, or "
                          "leave it unset (null) to train trainer.total_epochs over the data")
    if trainer.total_steps is None and trainer.total_epochs < 1:
        raise ConfigError(f"trainer.total_epochs={trainer.total_epochs} must be at least 1 when trainer.total_steps "
                          "is unset")
    choose("trainer.device", trainer.device)
    for key, every in (("save_every", trainer.save_every), ("test_every", trainer.test_every)):
        if every < 0:
            raise ConfigError(f"trainer.{key}={every} must be >= 0 (a step count; 0: only at the end)")
    _check_seed("trainer.seed", trainer.seed)
    if trainer.keep_last < 1:
        raise ConfigError(f"trainer.keep_last={trainer.keep_last} must be at least 1 (the latest checkpoint)")
    if trainer.resume not in ("auto", "never") and not trainer.resume:
        raise ConfigError("trainer.resume must be auto, never, or a checkpoint path")


def validate_sft_config(config: SFTConfig) -> None:
    """The SFT run's checks: its data section, its token budget, then the run and optimizer checks RL shares."""
    data, trainer = config.data, config.trainer
    choose("data.truncation", data.truncation, SFT_TRUNCATION_MODES)
    choose("data.loss_on", data.loss_on, SFT_LOSS_TOKENS)
    validate_image_key(data.image_key, data.messages_key, "messages_key")
    validate_pixel_bounds(data.min_pixels, data.max_pixels)
    for key, value in (("data.batch_size", data.batch_size), ("data.val_batch_size", data.val_batch_size),
                       ("data.max_length", data.max_length)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    validate_sample_limits(data)
    validate_model_dtype(config.model.dtype)
    if config.model.lora.rank:
        raise ConfigError(f"model.lora.rank={config.model.lora.rank}: reinforge sft trains every parameter and would "
                          "ignore the adapters; LoRA is for the RL actor (reinforge train). Remove model.lora.rank")
    if trainer.max_tokens_per_micro_batch < data.max_length:
        raise ConfigError(f"trainer.max_tokens_per_micro_batch={trainer.max_tokens_per_micro_batch} is smaller than "
                          f"data.max_length={data.max_length}, so one conversation may not fit; raise it")
    validate_router_aux_loss_coef("trainer.router_aux_loss_coef", trainer.router_aux_loss_coef)
    validate_run(trainer)
    validate_optim("optim", config.optim)
    validate_update("trainer", trainer)


def validate_router_aux_loss_coef(key: str, value: float | str | None) -> None:
    """The weight of a mixture of experts' load-balancing loss: null, declared, or a finite number >= 0."""
    if value is None or value == DECLARED_ROUTER_AUX_LOSS:
        return
    if isinstance(value, str):
        raise ConfigError(f"{key}={value!r} is not a weight; give a finite number >= 0 (0: no aux loss), null (the "
                          "model config's router_aux_loss_coef when its output_router_logits is true) or "
                          f"{DECLARED_ROUTER_AUX_LOSS} (the model config's router_aux_loss_coef, as TRL takes it)")
    _finite(key, value, at_least=0.0,
            fix=" (the weight of a mixture of experts' load-balancing loss; null: the model config's)")


def validate_image_key(image_key: str | None, text_key: str, text_name: str) -> None:
    """data.image_key names a column of its own (or is null)."""
    if image_key is None:
        return
    if not isinstance(image_key, str) or not image_key:
        raise ConfigError(f"data.image_key={image_key!r} is not a column name; give the column of the images, or "
                          "null to read 'images' (else 'image')")
    if image_key == text_key:
        raise ConfigError(f"data.image_key={image_key!r} is also data.{text_name}; the images need a column of their "
                          "own")


def validate_pixel_bounds(min_pixels: int | None, max_pixels: int | None) -> None:
    """data.min_pixels and data.max_pixels are whole pixel counts (or null), the first no more than the second."""
    for key, value in (("data.min_pixels", min_pixels), ("data.max_pixels", max_pixels)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}={value!r} is not a positive whole number of pixels; give one (256 * 28 * 28 "
                              "for 256 image tokens of Qwen2.5-VL), or null for the model's own")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ConfigError(f"data.min_pixels={min_pixels} is more than data.max_pixels={max_pixels}; an image cannot "
                          "be resized to both: lower min_pixels or raise max_pixels")


def validate_config(config: Config) -> None:
    """Raise ConfigError with the fix in the message when fields disagree."""
    data, actor, rollout, algorithm, trainer = config.data, config.actor, config.rollout, config.algorithm, config.trainer
    choose("data.truncation", data.truncation, TRUNCATION_MODES)
    validate_image_key(data.image_key, data.prompt_key, "prompt_key")
    validate_pixel_bounds(data.min_pixels, data.max_pixels)
    validate_sample_limits(data)
    validate_model_dtype(config.model.dtype)
    if not rollout.name or not isinstance(rollout.name, str):  # which names exist is trainer/preflight.py's check
        raise ConfigError(f"rollout.name={rollout.name!r} is empty; use hf, native or an engine a package adds")
    choose("trainer.backend", trainer.backend)
    validate_run(trainer)
    validate_optim("actor.optim", actor.optim)
    validate_optim("critic.optim", config.critic.optim)
    validate_update("actor", actor)
    validate_update("critic", config.critic)
    for key, factor, null in (("actor.loss_scale_factor", actor.loss_scale_factor, "data.max_response_length"),
                              ("critic.loss_scale_factor", config.critic.loss_scale_factor, "actor.loss_scale_factor")):
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise ConfigError(f"{key}={factor} must be a positive number: the constant seq-mean-token-sum-norm "
                              f"divides each sequence's loss by (null: {null})")
    if config.reward.num_workers < 0:
        raise ConfigError(f"reward.num_workers={config.reward.num_workers} must be 0 (score in this process) or more")
    _check_timeout("reward.timeout_s", config.reward.timeout_s, "seconds a scorer may take on one sample")
    _finite("reward.fallback_score", config.reward.fallback_score, fix=" (the score of a sample whose scorer failed)")
    if config.reward.max_memory_mb is not None and config.reward.max_memory_mb < MIN_SCORER_MEMORY_MB:
        raise ConfigError(f"reward.max_memory_mb={config.reward.max_memory_mb} is too little for a scoring process "
                          f"(math-verify's needs about 64 MB); set at least {MIN_SCORER_MEMORY_MB}, or null for no cap")
    _finite("reward.max_abs_score", config.reward.max_abs_score, at_least=0.0,
            fix=" (scores beyond +-it are warned about)")
    validate_reward_model(config)
    if trainer.num_logged_samples < 0:
        raise ConfigError(f"trainer.num_logged_samples={trainer.num_logged_samples} must be 0 (none) or more")
    _check_timeout("trainer.call_timeout_s", trainer.call_timeout_s, "seconds one worker call may take; 3600 is the "
                   "default")

    multi_turn = rollout.multi_turn
    choose("rollout.multi_turn.tool_response_truncate_side", multi_turn.tool_response_truncate_side)
    if multi_turn.max_parallel_calls < 1:
        raise ConfigError(f"rollout.multi_turn.max_parallel_calls={multi_turn.max_parallel_calls} must be at least 1")
    if multi_turn.tool_timeout_s is not None:
        _check_timeout("rollout.multi_turn.tool_timeout_s", multi_turn.tool_timeout_s,
                       "seconds a tool call may take; null: no limit")
    if multi_turn.max_tool_response_length < 1:
        raise ConfigError(f"rollout.multi_turn.max_tool_response_length={multi_turn.max_tool_response_length} "
                          "must be at least 1 token")
    for key in ("max_assistant_turns", "max_user_turns"):
        value = getattr(multi_turn, key)
        if value is not None and value < 1:
            raise ConfigError(f"rollout.multi_turn.{key}={value} must be at least 1, or null for no limit")
    if rollout.n < 1:
        raise ConfigError(f"rollout.n={rollout.n} must be at least 1")
    negative = [token for token in rollout.stop_token_ids if token < 0]
    if negative:  # transformers' generate then stops at none of the ids, the EOS included
        raise ConfigError(f"rollout.stop_token_ids={rollout.stop_token_ids} holds {negative[0]}, which is no token id "
                          "(ids count from 0); give the ids of the tokens to stop at, or [] for the EOS alone")
    if data.train_batch_size < 1:
        raise ConfigError(f"data.train_batch_size={data.train_batch_size} must be at least 1")
    if data.val_batch_size is not None and data.val_batch_size < 1:  # 0 meant the whole set, -1 failed at validation
        raise ConfigError(f"data.val_batch_size={data.val_batch_size} must be at least 1, or null (the whole "
                          "validation set at once)")
    if actor.mini_batch_size is not None:
        if actor.mini_batch_size < 1 or data.train_batch_size % actor.mini_batch_size:
            raise ConfigError(
                f"actor.mini_batch_size={actor.mini_batch_size} must divide data.train_batch_size="
                f"{data.train_batch_size}; pick a divisor or leave it unset (the whole batch, on-policy)"
            )
    if actor.ppo_epochs < 1:
        raise ConfigError(f"actor.ppo_epochs={actor.ppo_epochs} must be at least 1")
    for key, length in (("data.max_prompt_length", data.max_prompt_length),
                        ("data.max_response_length", data.max_response_length)):
        if length < 1:
            raise ConfigError(f"{key}={length} must be at least 1 (tokens)")
    if data.max_image_tokens is not None and not 1 <= data.max_image_tokens <= data.max_prompt_length:
        raise ConfigError(f"data.max_image_tokens={data.max_image_tokens} must be between 1 and "
                          f"data.max_prompt_length={data.max_prompt_length} (a prompt's image tokens are among its "
                          "tokens); set it to the image tokens of your largest prompt, or null")
    longest = data.max_prompt_length + data.max_response_length
    _check_memory_settings(config)
    budgets = (("actor", actor.max_tokens_per_micro_batch), ("ref", config.ref.max_tokens_per_micro_batch),
               ("critic", config.critic.max_tokens_per_micro_batch))
    for section, budget in budgets:  # ref's and critic's None (and auto) are the actor's
        if budget not in (None, "auto") and budget < longest:
            raise ConfigError(
                f"{section}.max_tokens_per_micro_batch={budget} cannot hold one sequence of "
                f"data.max_prompt_length + data.max_response_length = {longest} tokens; raise it to at least {longest}"
                + ("" if section == "actor" else " or leave it unset (null: actor.max_tokens_per_micro_batch)"))
    clip = actor.policy_loss
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        value = getattr(clip, name)
        # a ratio bound 1 - low below 0 means nothing; geo_mean clips the log-ratio, where any positive bound is valid
        upper = float("inf") if name == "clip_ratio_high" or clip.loss_mode == "geo_mean" else 1.0
        if value is not None and not 0.0 < value <= upper:
            raise ConfigError(f"actor.policy_loss.{name}={value} is out of range; it must be in (0, {upper:g}] "
                              f"(the ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; 0.2 is usual)")
    _in_range("algorithm.gamma", algorithm.gamma, 0.0, 1.0)
    _in_range("algorithm.lam", algorithm.lam, 0.0, 1.0)
    if not clip.clip_ratio_c > 1.0:  # also nan
        raise ConfigError(f"actor.policy_loss.clip_ratio_c={clip.clip_ratio_c} must be greater than 1 (dual clip)")
    if clip.loss_mode == "sapo" and not (clip.tau_pos > 0 and clip.tau_neg > 0):  # the loss refused it at step 1
        raise ConfigError(f"actor.policy_loss.tau_pos={clip.tau_pos} and tau_neg={clip.tau_neg} must both be positive "
                          "for loss_mode=sapo (the gate's temperatures; 1.0 and 1.05 are usual)")
    for mode, key in (("clip_cov", "clip_cov_ratio"), ("kl_cov", "kl_cov_ratio")):
        if clip.loss_mode == mode and not 0.0 < getattr(clip, key) <= 1.0:
            raise ConfigError(f"actor.policy_loss.{key}={getattr(clip, key)} must be in (0, 1] for loss_mode={mode} "
                              "(a share of the valid tokens; 0.0002 is usual)")
    _finite("actor.kl_loss_coef", actor.kl_loss_coef, at_least=0.0, fix=" (the weight of the KL loss, e.g. 0.001)")
    _finite("actor.entropy_coeff", actor.entropy_coeff, fix=" (the weight of the entropy bonus; 0: none)")
    validate_router_aux_loss_coef("actor.router_aux_loss_coef", actor.router_aux_loss_coef)
    kl_ctrl = algorithm.kl_ctrl
    _finite("algorithm.kl_ctrl.kl_coef", kl_ctrl.kl_coef, at_least=0.0, fix=" (the weight of the in-reward KL penalty)")
    if kl_ctrl.type == "adaptive" and not (kl_ctrl.target_kl > 0 and kl_ctrl.horizon > 0):
        raise ConfigError(f"algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl > 0 and "
                          f"algorithm.kl_ctrl.horizon > 0 (they are {kl_ctrl.target_kl} and {kl_ctrl.horizon}); "
                          "0.1 and 10000 are usual")
    if clip.loss_mode == "dro" and (clip.dro_beta is None or clip.dro_beta <= 0):
        raise ConfigError(f"actor.policy_loss.loss_mode=dro needs actor.policy_loss.dro_beta > 0 (it is {clip.dro_beta}); "
                          "set e.g. actor.policy_loss.dro_beta=0.1")
    for prefix, sampling in (("rollout", rollout), ("rollout.val_kwargs", rollout.val_kwargs)):
        _finite(f"{prefix}.temperature", sampling.temperature, at_least=0.0, fix=" (0 is greedy, 1.0 is usual)")
    for prefix, sampling in (("rollout", rollout), ("rollout.val_kwargs", rollout.val_kwargs)):
        if sampling.temperature == 0 and sampling.n > 1:
            raise ConfigError(f"{prefix}.temperature=0 is greedy sampling, so the {prefix}.n={sampling.n} samples of a "
                              f"prompt would all be the same; set {prefix}.temperature > 0 (e.g. 1.0) or {prefix}.n=1")
    for prefix, sampling in (("rollout", rollout), ("rollout.val_kwargs", rollout.val_kwargs)):
        if not 0.0 < sampling.top_p <= 1.0:
            raise ConfigError(f"{prefix}.top_p={sampling.top_p} must be in (0, 1]")
        if sampling.top_k < -1:
            raise ConfigError(f"{prefix}.top_k={sampling.top_k} must be a number of tokens (at least 1), or -1 (or 0) "
                              "for all of them")
    if not 0.0 <= rollout.min_p <= 1.0:  # above 1 even the most likely token falls below the bar: nothing is left
        raise ConfigError(f"rollout.min_p={rollout.min_p} must be in [0, 1] (0: off)")
    if rollout.max_prefill_chunk_tokens is not None and rollout.max_prefill_chunk_tokens < 1:
        raise ConfigError(f"rollout.max_prefill_chunk_tokens={rollout.max_prefill_chunk_tokens} must be a positive "
                          "token count (or null: 16384)")
    _kv_cache_dtype(config)
    choose("rollout.decode_products", rollout.decode_products)
    if rollout.val_kwargs.n < 1:
        raise ConfigError(f"rollout.val_kwargs.n={rollout.val_kwargs.n} must be at least 1")
    for key in ("nnodes", "devices_per_node"):
        if getattr(trainer, key) < 1:
            raise ConfigError(f"trainer.{key}={getattr(trainer, key)} must be at least 1")
    validate_lora(config.model.lora)
    _validate_algorithm(config)
    _check_dapo(config)
    _check_modes(config)


def _check_dapo(config: Config) -> None:
    data, filter_groups, buffer = config.data, config.algorithm.filter_groups, config.reward.overlong_buffer
    choose("algorithm.filter_groups.metric", filter_groups.metric)
    if filter_groups.max_num_gen_batches < 0:
        raise ConfigError(f"algorithm.filter_groups.max_num_gen_batches={filter_groups.max_num_gen_batches} "
                          "must be 0 (no limit) or more")
    if data.gen_batch_size is not None:
        if not filter_groups.enable:
            raise ConfigError(f"data.gen_batch_size={data.gen_batch_size} only applies to dynamic sampling; set "
                              "algorithm.filter_groups.enable=true or remove data.gen_batch_size")
        if data.gen_batch_size < 1:
            raise ConfigError(f"data.gen_batch_size={data.gen_batch_size} must be at least 1")
        limit = filter_groups.max_num_gen_batches
        if 0 < limit and limit * data.gen_batch_size < data.train_batch_size:
            # every step would fail after its last allowed generation batch, once the model has loaded
            needed = -(-data.train_batch_size // data.gen_batch_size)
            raise ConfigError(f"algorithm.filter_groups.max_num_gen_batches={limit} generation batches of "
                              f"data.gen_batch_size={data.gen_batch_size} prompts cannot fill "
                              f"data.train_batch_size={data.train_batch_size} groups even if every group is kept; "
                              f"set max_num_gen_batches to {needed} or more (0: no limit), or raise data.gen_batch_size")
    if buffer.enable:
        if not 0 < buffer.len <= data.max_response_length:
            raise ConfigError(f"reward.overlong_buffer.len={buffer.len} must be in 1..data.max_response_length="
                              f"{data.max_response_length} when reward.overlong_buffer.enable=true")
        if not 0 <= buffer.penalty_factor < float("inf"):  # also nan
            raise ConfigError(f"reward.overlong_buffer.penalty_factor={buffer.penalty_factor} must be >= 0")


def _check_memory_settings(config: Config) -> None:
    """Each memory setting is auto or a value of its type (the planner fills in the auto ones)."""
    kinds = {
        "actor.max_tokens_per_micro_batch": (config.actor.max_tokens_per_micro_batch, (int,), "a token count"),
        "actor.logits_buffer_gib": (config.actor.logits_buffer_gib, (int, float), "a size in GiB"),
        "rollout.kv_cache_gib": (config.rollout.kv_cache_gib, (int, float), "a size in GiB"),
        "model.gradient_checkpointing": (config.model.gradient_checkpointing, (bool, int), "true, false or a layer count"),
        "rollout.free_cache_engine": (config.rollout.free_cache_engine, (bool,), "true or false"),
        "actor.optimizer_offload": (config.actor.optimizer_offload, (bool,), "true or false"),
        "actor.param_offload": (config.actor.param_offload, (bool,), "true or false"),
        "ref.param_offload": (config.ref.param_offload, (bool,), "true or false"),
        "actor.keep_gathered": (config.actor.keep_gathered, (bool,), "true or false"),
    }
    for key, (value, types, what) in kinds.items():
        if value == "auto":
            continue
        wrong_bool = isinstance(value, bool) and bool not in types
        if wrong_bool or not isinstance(value, types) or (not isinstance(value, bool) and value < 0):
            raise ConfigError(f"{key}={value!r} must be auto or {what}")
    if config.rollout.kv_cache_gib == 0:  # the planner reads 0 as "every sequence", the engine as an empty cache
        raise ConfigError("rollout.kv_cache_gib=0 leaves the native engine no KV cache; set a positive size in GiB, "
                          "or auto (room for every sequence of a step)")
    if config.actor.keep_gathered is True:
        devices = config.trainer.nnodes * config.trainer.devices_per_node
        if devices > 1:
            raise ConfigError(f"actor.keep_gathered=true keeps one device's whole model gathered, but the run has "
                              f"{devices} devices (trainer.nnodes x trainer.devices_per_node); set it to auto or false")
        if config.actor.param_offload is True:
            raise ConfigError("actor.keep_gathered=true with actor.param_offload=true: parameters streamed from the "
                              "host are gathered for each use; set one of them to auto or false")
    fraction = config.rollout.gpu_memory_utilization
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ConfigError(f"rollout.gpu_memory_utilization={fraction} must be in (0, 1], or null to let the "
                          "memory planner size the KV cache")
    for key in ("gpu_memory_gib", "host_memory_gib"):
        value = getattr(config.trainer, key)
        if value is not None and not 0 < value < float("inf"):
            raise ConfigError(f"trainer.{key}={value} must be a positive number of GiB (or null: the machine's own)")


def _validate_algorithm(config: Config) -> None:
    """GRPO's epsilon, gdpo's reward keys and bypass mode."""
    algorithm, correction = config.algorithm, config.algorithm.rollout_correction
    if not algorithm.grpo_epsilon > 0:
        raise ConfigError(f"algorithm.grpo_epsilon={algorithm.grpo_epsilon} must be positive (it keeps a group with "
                          "equal scores from dividing by 0); 1e-6 is usual")
    if algorithm.adv_estimator == "gdpo":
        if not algorithm.gdpo_reward_keys:
            raise ConfigError("algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys, the names of the "
                              "scorer's separate rewards (keys of the dict it returns), e.g. [format,acc]")
        weights = algorithm.gdpo_reward_weights
        if weights is not None and len(weights) != len(algorithm.gdpo_reward_keys):
            raise ConfigError(f"algorithm.gdpo_reward_weights has {len(weights)} values for "
                              f"{len(algorithm.gdpo_reward_keys)} gdpo_reward_keys; give one weight per key")
    if correction.bypass_mode:
        if config.actor.policy_loss.loss_mode != "vanilla":
            raise ConfigError(
                f"algorithm.rollout_correction.bypass_mode=true computes the loss named by "
                f"algorithm.rollout_correction.loss_type={correction.loss_type}, so "
                f"actor.policy_loss.loss_mode={config.actor.policy_loss.loss_mode} would be ignored; "
                "set actor.policy_loss.loss_mode=vanilla or bypass_mode=false")


def _check_modes(config: Config) -> None:
    trainer, rollout = config.trainer, config.rollout
    choose("trainer.mode", trainer.mode)
    choose("trainer.proximal", trainer.proximal)
    _finite("trainer.max_staleness", trainer.max_staleness, at_least=0,
            fix=" (0: on-policy; each unit lets the rollouter run one weight version ahead)")
    if trainer.trigger_sync_steps < 1:
        raise ConfigError(f"trainer.trigger_sync_steps={trainer.trigger_sync_steps} must be at least 1")
    if trainer.mode == "async" and trainer.max_in_flight_groups is not None:
        # the trainer takes data.train_batch_size groups at once; deterministic mode admits a version's groups ahead
        least, needs = config.data.train_batch_size, "data.train_batch_size (the groups of one update)"
        if trainer.async_deterministic:
            least *= trainer.trigger_sync_steps
            needs = "trigger_sync_steps x data.train_batch_size (with trainer.async_deterministic)"
        if trainer.max_in_flight_groups < least:
            raise ConfigError(f"trainer.max_in_flight_groups={trainer.max_in_flight_groups} must be at least "
                              f"{needs} = {least}, or the trainer waits forever for groups the rollouter may not "
                              f"admit; set it to {least} or more, or null (from trainer.max_staleness)")
    if rollout.segment_tokens is not None and (
            rollout.segment_tokens < 1 or config.data.max_response_length % rollout.segment_tokens):
        raise ConfigError(f"rollout.segment_tokens={rollout.segment_tokens} must divide data.max_response_length="
                          f"{config.data.max_response_length}; pick a divisor or null (whole samples)")
    if trainer.mode == "sync":
        return
    if config.algorithm.filter_groups.enable:
        raise ConfigError(f"algorithm.filter_groups (dynamic sampling) runs with trainer.mode=sync only, not "
                          f"trainer.mode={trainer.mode}; disable one of them")
    if config.algorithm.adv_estimator == "remax":
        raise ConfigError(f"algorithm.adv_estimator=remax needs a greedy rollout per step, which "
                          f"trainer.mode={trainer.mode} does not run; use trainer.mode=sync, or another estimator")


def model_score_source(config: Config) -> str | None:
    """The section whose score replaces or meets the rule's: reward_model, judge or remote (None: the rule's alone)."""
    reward = config.reward
    sources = [name for name in ("reward_model", "judge", "remote") if getattr(reward, name).enable]
    return sources[0] if sources else None


def validate_reward_model(config: Config) -> None:
    """reward.reward_model, reward.judge, reward.remote and reward.combine: one model-based score at most, a model
    or URL where it is enabled, sizes that make sense, weights that are numbers, and a pool of its own only where
    there are devices to place it on."""
    reward_model, combine = config.reward.reward_model, config.reward.combine
    choose("reward.combine.mode", combine.mode)
    for key in ("rm_weight", "rule_weight", "gate_threshold"):
        _finite(f"reward.combine.{key}", getattr(combine, key))
    enabled = [name for name in ("reward_model", "judge", "remote") if getattr(config.reward, name).enable]
    if len(enabled) > 1:
        raise ConfigError(f"reward.{enabled[0]}.enable and reward.{enabled[1]}.enable are both true; a run takes one "
                          "model-based score (reward.combine meets it with the rule's): disable one of them")
    if not enabled:
        if combine.mode != "replace":
            raise ConfigError(f"reward.combine.mode={combine.mode} combines a model's score with the rule's, "
                              "but no reward.reward_model, reward.judge or reward.remote is enabled; enable one, "
                              "or remove reward.combine.mode")
        return
    if combine.mode == "replace" and config.reward.overlong_buffer.enable:
        raise ConfigError("reward.overlong_buffer.enable=true shapes the rule-based score, which "
                          "reward.combine.mode=replace leaves out; set reward.combine.mode=sum (rule_weight weighs the "
                          "rule's score and its penalty) or reward.overlong_buffer.enable=false")
    if enabled[0] == "judge":
        validate_judge(config.reward.judge)
        if config.reward.judge.model_path == "policy" and config.trainer.mode != "sync":
            raise ConfigError(f"reward.judge.model_path=policy judges with the policy's own engine, which "
                              f"trainer.mode={config.trainer.mode} keeps generating; use trainer.mode=sync, or a judge "
                              "model of its own (reward.judge.model_path=/path/to/judge)")
        judge, sequence = config.reward.judge, policy_judge_sequence(config)
        if sequence is not None and judge.max_tokens >= sequence:
            raise ConfigError(f"reward.judge.max_tokens={judge.max_tokens} leaves the judge's prompts no room in the "
                              "policy's native engine, whose sequences hold data.max_prompt_length + "
                              f"data.max_response_length = {sequence} tokens; lower reward.judge.max_tokens, or give "
                              "the judge a model of its own (reward.judge.model_path=/path/to/judge)")
        return
    if enabled[0] == "remote":
        validate_remote(config.reward.remote)
        return
    if not reward_model.model_path:
        raise ConfigError("reward.reward_model.enable=true but reward.reward_model.model_path is not set; pass "
                          "reward.reward_model.model_path=/path/to/reward_model (a sequence-classification folder)")
    for key in ("max_length", "max_tokens_per_micro_batch"):
        value = getattr(reward_model, key)
        if value is not None and value < 2:
            raise ConfigError(f"reward.reward_model.{key}={value} must be at least 2 tokens, or null (the default)")
    if reward_model.enable_resource_pool:
        if config.trainer.backend != "ray":
            raise ConfigError("reward.reward_model.enable_resource_pool=true places the reward model on devices of "
                              "its own, which needs trainer.backend=ray; set it, or enable_resource_pool=false to "
                              "share the actor's device")
        for key in ("n_gpus_per_node", "nnodes"):
            if getattr(reward_model, key) < 1:
                raise ConfigError(f"reward.reward_model.{key}={getattr(reward_model, key)} must be at least 1 "
                                  "(the reward model's own pool)")


def validate_judge(judge) -> None:
    """reward.judge: a model, a template, a parse rule, numbers that make sense."""
    if not judge.model_path:
        raise ConfigError("reward.judge.enable=true but reward.judge.model_path is not set; pass "
                          "reward.judge.model_path=/path/to/judge (a causal LM) or reward.judge.model_path=policy")
    if not judge.template:
        raise ConfigError("reward.judge.enable=true but reward.judge.template is not set; pass the judge's prompt "
                          "with {prompt}, {response} and {ground_truth}, or the path of a file holding it")
    choose("reward.judge.parse", judge.parse)
    if judge.parse == "marker" and not judge.marker:
        raise ConfigError("reward.judge.parse=marker needs reward.judge.marker, the text the score follows "
                          "(e.g. 'Score:')")
    if judge.parse == "yes_no" and judge.yes_token == judge.no_token:
        raise ConfigError(f"reward.judge.yes_token and reward.judge.no_token are both {judge.yes_token!r}, so every "
                          "score would be 0.5; give the judge's two answers (e.g. 'Yes' and 'No')")
    _finite("reward.judge.scale", judge.scale)
    if judge.scale == 0:
        raise ConfigError("reward.judge.scale=0 would divide every score by zero; use 1 to keep the judge's numbers")
    _finite("reward.judge.fallback_score", judge.fallback_score)
    for key in ("max_tokens", "max_prompt_length"):
        if getattr(judge, key) < 1:
            raise ConfigError(f"reward.judge.{key}={getattr(judge, key)} must be at least 1")
    _check_timeout("reward.judge.timeout_s", judge.timeout_s, "seconds the judging of one batch may take")
    _finite("reward.judge.temperature", judge.temperature, at_least=0.0, fix=" (0: greedy)")


def policy_judge_sequence(config: Config) -> int | None:
    """The tokens of a judge's sequence where the policy judges itself on its native engine, generating its answer:
    the engine's sequences, data.max_prompt_length + data.max_response_length, which a judge prompt and its
    reward.judge.max_tokens share; None otherwise (a judge of its own sizes its engine; yes_no generates nothing)."""
    judge, data = config.reward.judge, config.data
    if judge.model_path != "policy" or config.rollout.name != "native" or judge.parse == "yes_no":
        return None
    return data.max_prompt_length + data.max_response_length


def validate_remote(remote) -> None:
    """reward.remote: URLs, a protocol, sizes that make sense."""
    if not remote.url or not remote.url.replace(",", "").strip():
        given = f"={remote.url!r} names no endpoint" if remote.url else " is not set"
        raise ConfigError(f"reward.remote.enable=true but reward.remote.url{given}; pass "
                          "reward.remote.url=http://host:port/get_reward (several: comma-separated)")
    for url in (part.strip() for part in remote.url.split(",")):
        if url and not url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.remote.url has {url!r}, which is not an http:// or https:// URL")
    choose("reward.remote.protocol", remote.protocol)
    for key in ("batch_size", "max_concurrency"):
        if getattr(remote, key) < 1:
            raise ConfigError(f"reward.remote.{key}={getattr(remote, key)} must be at least 1")
    if remote.max_retries < 0:
        raise ConfigError(f"reward.remote.max_retries={remote.max_retries} must be 0 or more")
    _check_timeout("reward.remote.timeout_s", remote.timeout_s, "seconds one request may take in all")
    _finite("reward.remote.fallback_score", remote.fallback_score)
    if remote.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", remote.api_key_env):
        raise ConfigError(f"reward.remote.api_key_env={remote.api_key_env!r} is not the name of an environment "
                          "variable; give the variable's name (e.g. REWARD_API_KEY), not the key itself")
