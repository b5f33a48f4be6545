"""TRL's (and transformers' ``TrainingArguments``) settings with no reinforge key of their own: those that change
nothing in a reinforge run (where logs go, the generation engine, the hub), taken and noted; and those reinforge takes
only at TRL's default, where another value would change the training in a way reinforge does not do.

A script written for TRL spells out many of them (``bf16``, ``logging_dir``, ``use_vllm``, ``push_to_hub``...): it
runs unchanged as long as what it asks for is what the run does, and stops in one line naming the setting where not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Mapping = Callable[[Any, dict[str, Any]], dict[str, Any]]


def no_effect(name: str, reason: str) -> tuple[str, Mapping]:
    """A setting that changes nothing here: taken, and said once (at info level) when given."""
    def note(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
        logger.info("%s=%r changes nothing in a reinforge run: %s", name, value, reason)
        return {}
    return f"(no effect: {reason})", note


def default_only(name: str, accepted: tuple[Any, ...], fix: str) -> tuple[str, Mapping]:
    """A setting taken at TRL's default (or None); another value is refused in one line with ``fix``."""
    def check(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
        if value is not None and not any(value == item and type(value) is type(item) for item in accepted):
            raise ValueError(f"{name}={value!r}: {fix}")
        return {}
    return f"(only {' or '.join(repr(item) for item in accepted)})", check


def _table(no_effects: dict[str, str], defaults: dict[str, tuple[tuple[Any, ...], str]]) -> dict[str, tuple[str, Mapping]]:
    return ({name: no_effect(name, reason) for name, reason in no_effects.items()}
            | {name: default_only(name, accepted, fix) for name, (accepted, fix) in defaults.items()})


UNUSED_BY_EVERY_TRAINER = _table(
    {
        "logging_dir": "TensorBoard (report_to='tensorboard') writes into output_dir",
        "logging_strategy": "reinforge logs every step",
        "logging_first_step": "reinforge logs every step",
        "logging_nan_inf_filter": "reinforge logs every step's values as they are",
        "log_level": "reinforge logs through Python's logging",
        "log_level_replica": "reinforge logs through Python's logging",
        "log_on_each_node": "the run's metrics are logged once",
        "disable_tqdm": "the console logger draws the progress (report_to='none' keeps only metrics.jsonl)",
        "overwrite_output_dir": "a run folder with a checkpoint is resumed (trainer.resume)",
        "do_train": "train() trains",
        "do_eval": "an eval_dataset is evaluated",
        "do_predict": "reinforge has no predict step",
        "remove_unused_columns": "every column of the rows reaches the reward functions, as TRL's GRPO default",
        "label_names": "reinforge's trainers know their labels",
        "save_only_model": "a checkpoint holds what resuming needs",
        "save_safetensors": "models are saved as safetensors",
        "dataloader_num_workers": "the rows are read in the trainer's process",
        "dataloader_pin_memory": "the rows are read in the trainer's process",
        "dataloader_persistent_workers": "the rows are read in the trainer's process",
        "dataloader_prefetch_factor": "the rows are read in the trainer's process",
        "ddp_find_unused_parameters": "reinforge shards with FSDP, not DDP",
        "ddp_timeout": "reinforge shards with FSDP, not DDP",
        "ddp_backend": "reinforge shards with FSDP, not DDP",
        "local_rank": "reinforge starts its own workers (trainer.devices_per_node)",
        "gradient_checkpointing_kwargs": "reinforge's checkpointing is its own (gradient_checkpointing)",
        "use_liger_kernel": "reinforge computes the loss in its own chunked kernels",
        "include_num_input_tokens_seen": "reinforge logs the tokens of each step",
        "include_tokens_per_second": "reinforge logs the throughput of each step",
        "torch_empty_cache_steps": "reinforge frees memory between its phases",
        "hub_model_id": "reinforge does not push to the hub (push_to_hub)",
        "hub_strategy": "reinforge does not push to the hub (push_to_hub)",
        "hub_private_repo": "reinforge does not push to the hub (push_to_hub)",
        "hub_token": "reinforge does not push to the hub (push_to_hub)",
        "tf32": "reinforge computes in bfloat16 on a GPU (bf16) and float32 on the CPU",
        "metric_for_best_model": "reinforge keeps the last checkpoints (save_total_limit), not the best",
        "greater_is_better": "reinforge keeps the last checkpoints (save_total_limit), not the best",
        "per_device_eval_batch_size": "evaluation batches are sized by reinforge",
    },
    {
        "push_to_hub": ((False,), "reinforge does not upload; trainer.save_model() writes the model folder, which "
                                  "huggingface_hub's upload_folder pushes"),
        "load_best_model_at_end": ((False,), "reinforge keeps the last checkpoints, not the best; remove it"),
        "torch_compile": ((False,), "reinforge does not compile the model; remove it"),
        "auto_find_batch_size": ((False,), "reinforge plans the micro-batches from the memory it has; remove it"),
        "group_by_length": ((False,), "reinforge batches the rows in their shuffled order; remove it"),
        "label_smoothing_factor": ((0.0, 0), "reinforge's losses have no label smoothing; remove it"),
        "optim": (("adamw_torch", "adamw_torch_fused", "adamw_hf"),
                  "reinforge's optimizer is torch's AdamW (adam_beta1, adam_beta2, adam_epsilon, weight_decay); "
                  "remove it"),
        "neftune_noise_alpha": ((), "reinforge adds no noise to the embeddings; remove it"),
        "max_tool_calling_iterations": ((), "GRPOTrainer takes no tools; reinforge's multi-turn tool runs are set "
                                            "in overrides (rollout.multi_turn)"),
        "log_completions_hub_repo": ((), "reinforge does not push to the hub; samples.jsonl in output_dir holds "
                                         "logged completions"),
    },
)
"""The ``TrainingArguments`` names every config takes without a reinforge key."""


UNUSED_BY_GRPO = _table(
    {
        "use_vllm": "generation runs on reinforge's own engine (rollout.name: hf or native)",
        "vllm_mode": "generation runs on reinforge's own engine, in the run",
        "vllm_model_impl": "generation runs on reinforge's own engine",
        "vllm_enable_sleep_mode": "reinforge's engine frees its memory for the update (rollout.free_cache_engine)",
        "vllm_server_base_url": "generation runs on reinforge's own engine, in the run",
        "vllm_server_host": "generation runs on reinforge's own engine, in the run",
        "vllm_server_port": "generation runs on reinforge's own engine, in the run",
        "vllm_server_timeout": "generation runs on reinforge's own engine, in the run",
        "vllm_group_port": "generation runs on reinforge's own engine, in the run",
        "vllm_gpu_memory_utilization": "reinforge's memory planner sizes the engine (rollout.gpu_memory_utilization)",
        "vllm_max_model_length": "the engine holds max_prompt_length + max_completion_length tokens",
        "vllm_tensor_parallel_size": "reinforge's engine runs the model whole on each device",
        "vllm_importance_sampling_correction": "reinforge's correction of the engine's log-probs is "
                                               "algorithm.rollout_correction",
        "vllm_importance_sampling_mode": "reinforge's correction of the engine's log-probs is "
                                         "algorithm.rollout_correction",
        "vllm_importance_sampling_clip_max": "reinforge's correction of the engine's log-probs is "
                                             "algorithm.rollout_correction",
        "vllm_importance_sampling_clip_min": "reinforge's correction of the engine's log-probs is "
                                             "algorithm.rollout_correction",
        "vllm_importance_sampling_cap": "reinforge's correction of the engine's log-probs is "
                                        "algorithm.rollout_correction",
        "use_transformers_paged": "generation runs on reinforge's own engine (rollout.name)",
        "use_transformers_continuous_batching": "generation runs on reinforge's own engine (rollout.name)",
        "transformers_continuous_batching_config": "generation runs on reinforge's own engine (rollout.name)",
        "cache_implementation": "generation runs on reinforge's own engine (rollout.name)",
        "ds3_gather_for_generation": "reinforge's engine holds its own copy of the weights",
        "pad_to_multiple_of": "reinforge packs sequences without padding",
        "disable_dropout": "reinforge's RL workers always switch dropout off",
        "log_completions": "samples.jsonl in output_dir holds each step's logged completions "
                           "(num_completions_to_print of them)",
        "log_unique_prompts": "samples.jsonl in output_dir holds each step's logged completions",
        "log_multimodal": "samples.jsonl in output_dir holds each step's logged completions",
        "num_generations_eval": "evaluation samples rollout.val_kwargs.n completions a prompt (greedy unless set)",
        "ref_model_mixup_alpha": "reinforge keeps the reference model fixed (sync_ref_model)",
        "ref_model_sync_steps": "reinforge keeps the reference model fixed (sync_ref_model)",
        "entropy_coef_min": "reinforge's entropy bonus has a fixed weight (use_adaptive_entropy)",
        "entropy_coef_max": "reinforge's entropy bonus has a fixed weight (use_adaptive_entropy)",
        "entropy_coef_delta": "reinforge's entropy bonus has a fixed weight (use_adaptive_entropy)",
        "entropy_target": "reinforge's entropy bonus has a fixed weight (use_adaptive_entropy)",
    },
    {
        "mask_truncated_completions": ((False,), "reinforge trains on truncated completions too; remove it, or "
                                                 "penalise them through overrides (reward.overlong_buffer)"),
        "top_entropy_quantile": ((1.0, 1), "reinforge's loss takes every completion token; remove it"),
        "sync_ref_model": ((False,), "reinforge keeps the reference model fixed; remove it"),
        "use_adaptive_entropy": ((False,), "reinforge's entropy bonus has a fixed weight (entropy_coef); remove it"),
        "multi_objective_aggregation": (("sum_then_normalize",), "reinforge sums the weighted rewards, then "
                                                                  "normalises in the group; remove it"),
        "cast_lm_head_to_fp32": ((False,), "reinforge computes the logits in its own precision; remove it"),
        "off_policy_mask_threshold": ((), "reinforge masks no off-policy sequences; remove it, or correct "
                                          "through overrides (algorithm.rollout_correction)"),
        "repetition_penalty": ((1.0, 1), "reinforge's engine samples without a repetition penalty; remove it"),
        "vllm_structured_outputs_regex": ((), "reinforge's engine samples without structured outputs; remove it"),
        "chat_template_kwargs": (({},), "reinforge renders chat messages with the template alone; pass a "
                                        "template that does what the arguments ask (overrides={'data.chat_template': "
                                        "...})"),
    },
)
"""The GRPO names with no reinforge key."""


UNUSED_BY_PREFERENCE_TRAINERS = _table(
    {
        "dataset_num_proc": "the pairs are tokenized in the trainer's process",
        "padding_free": "reinforge packs a pair's sequences without padding",
        "pad_to_multiple_of": "padding is never trained",
        "pad_token": "padding is never trained; set tokenizer.pad_token and pass it as processing_class to save "
                     "another",
    },
    {
        "disable_dropout": ((True,), "reinforge rm and dpo always switch a checkpoint's dropout off; remove it"),
        "activation_offloading": ((False,), "reinforge does not offload activations; use gradient_checkpointing=True "
                                            "to save their memory"),
        "eos_token": ((), "reinforge appends the tokenizer's own EOS token; set tokenizer.eos_token and pass the "
                          "tokenizer as processing_class"),
    },
)
"""The names of TRL's DPOConfig and RewardConfig with no reinforge key."""


UNUSED_BY_DPO = _table(
    {
        "precompute_ref_log_probs": "reinforge dpo always scores the reference log-probs once, before the first step, "
                                    "and stores them in output_dir",
        "precompute_ref_batch_size": "the reference pass runs in the training's micro-batches",
        "ref_model_mixup_alpha": "reinforge keeps the reference model fixed (sync_ref_model)",
        "ref_model_sync_steps": "reinforge keeps the reference model fixed (sync_ref_model)",
    },
    {
        "reference_free": ((False,), "reinforge dpo always compares the policy with a reference (ref_model, or the "
                                     "model's starting weights); remove it"),
        "sync_ref_model": ((False,), "reinforge keeps the reference model fixed; remove it"),
        "use_weighting": ((False,), "reinforge's DPO losses weigh every pair alike; remove it"),
        "rpo_alpha": ((), "reinforge's DPO losses add no NLL term; remove it"),
        "truncation_mode": ((), "reinforge dpo drops a pair longer than max_length (counted in the log) rather than "
                                "cutting it; remove it"),
        "max_prompt_length": ((), "reinforge dpo drops a pair longer than max_length (counted in the log) rather "
                                  "than cutting its prompt; remove it"),
        "max_completion_length": ((), "reinforge dpo drops a pair longer than max_length (counted in the log) rather "
                                      "than cutting its completions; remove it"),
        "ld_alpha": ((), "reinforge sums every completion token's log-prob; remove it"),
    },
)
"""The DPOConfig names with no reinforge key."""


UNUSED_BY_SFT = _table(
    {
        "dataset_num_proc": "the rows are tokenized in the trainer's process",
        "shuffle_dataset": "the rows are drawn in a new shuffled order each epoch (data.shuffle), as transformers' "
                           "Trainer samples them",
        "padding_free": "a packed row (packing=True) has no padding, an unpacked batch pads its rows; neither pad "
                        "token is trained, so the loss is the same",
        "pad_to_multiple_of": "padding is never trained",
        "eval_packing": "the eval_dataset is packed as the train_dataset is, and packing leaves each conversation's "
                        "loss as it is",
        "pad_token": "padding is never trained; set tokenizer.pad_token and pass it as processing_class to save another",
    },
    {
        "truncation_mode": (("keep_start",), "reinforge keeps the start of a longer row and cuts its end, as TRL's "
                                             "default keep_start; remove it"),
        "packing_strategy": (("bfd",), "reinforge packs each row whole into rows of up to max_length tokens, as "
                                       "TRL's bfd (in the rows' order, not best-fit), and cuts the end of a longer "
                                       "one; remove it"),
        "eos_token": ((), "reinforge appends the tokenizer's own EOS token; set tokenizer.eos_token and pass the "
                          "tokenizer as processing_class"),
        "loss_type": (("nll", "chunked_nll"), "reinforge trains the mean negative log-likelihood of the trained tokens "
                                              "(nll); remove it"),
        "activation_offloading": ((False,), "reinforge does not offload activations; use gradient_checkpointing=True "
                                            "to save their memory"),
    },
)
"""The SFTConfig names with no reinforge key."""


def _each(reason: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, reason)


NO_COUNTERPART: dict[str, str] = {
    **_each("reinforge places and shards the model itself (trainer.nnodes, trainer.devices_per_node, FSDP2)",
            "fsdp", "fsdp_config", "deepspeed", "accelerator_config", "parallelism_config", "ddp_broadcast_buffers",
            "ddp_bucket_cap_mb", "ddp_static_graph", "save_on_each_node", "average_tokens_across_devices"),
    **_each("reinforge evaluates an eval_dataset its own way (eval_steps, eval_strategy, eval_on_start)",
            "eval_accumulation_steps", "eval_delay", "eval_do_concat_batches", "eval_use_gather_object",
            "batch_eval_metrics", "include_for_metrics", "prediction_loss_only", "bf16_full_eval", "fp16_full_eval"),
    **_each("reinforge resumes from output_dir's latest checkpoint (overrides={'trainer.resume': 'never'} or a "
            "checkpoint's path)", "resume_from_checkpoint", "restore_callback_states_from_checkpoint",
            "ignore_data_skip", "enable_jit_checkpoint"),
    **_each("reinforge reads and batches the rows in its own shuffled order (seed, data_seed)", "dataloader_drop_last",
            "dataloader_in_order", "dataloader_multiprocessing_context", "train_sampling_strategy",
            "length_column_name"),
    **_each("reinforge does not compile the model", "torch_compile_backend", "torch_compile_mode"),
    **_each("reinforge's optimizer is torch's AdamW on every trained parameter", "optim_args", "optim_target_modules"),
    **_each("reinforge logs to the loggers of report_to and the run folder", "project", "trackio_bucket_id",
            "trackio_space_id", "trackio_static_space_id", "skip_memory_metrics", "debug"),
    **_each("reinforge does not push to the hub", "hub_always_push", "hub_revision"),
    **_each("reinforge's checkpointing is its own (gradient_checkpointing)", "activation_checkpointing",
            "activation_checkpointing_kwargs"),
    **_each("reinforge computes the loss in its own kernels", "liger_kernel_config"),
    **_each("the chat template is the tokenizer's; set tokenizer.chat_template and pass the tokenizer as "
            "processing_class", "chat_template_path"),
    **_each("reinforge seeds every run (seed) but does not force deterministic kernels", "full_determinism"),
    **_each("reinforge's engine keeps its own cache", "use_cache"),
    **_each("reinforge has no VESPO loss (loss_type takes grpo, bnpo, dapo, dr_grpo, cispo, sapo, luspo)",
            "vespo_k_neg", "vespo_k_pos", "vespo_lambda_neg", "vespo_lambda_pos"),
    **_each("reinforge dpo trains one loss (sigmoid, ipo, hinge, robust)", "discopop_tau", "f_alpha_divergence_coef",
            "f_divergence_type", "loss_weights"),
}
"""Settings of TRL's configs (and transformers' TrainingArguments) that no reinforge config takes -> why; given, they
are refused in one line naming TRL's setting, not as a misspelt name."""
