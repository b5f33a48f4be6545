"""verl command lines as verl's examples and recipes write them (volcengine/verl 0.9.1, verl-recipe), as test data.

``COMMANDS`` (nine) train two steps here; ``TRANSLATED`` and ``REFUSED`` (the Gemma, Mistral, DeepSeek-V3, Qwen3,
Qwen3-MoE, GSPO, DAPO, reward-model, LoRA, vision-language and multi-turn scripts, and verl 0.9.1's Megatron and
VeOmni engine, CISPO, SAPO, distillation, gpt-oss, Megatron Lite and Ascend ones, and its one-step-off, fully async
and SFT trainers' scripts) are translated only.

Each is the list of words the script passes to ``python3 -m verl.trainer.main_ppo`` (or, with the launch
command in front, to verl's one-step-off, fully async or SFT entry point), its shell
variables substituted, with only these changed: the model, data, tool-config, reward-function and
checkpoint paths ({MODEL}, {TRAIN}, {VAL}, {TOOLS}, {REWARD}, {RUN}), and trainer.nnodes /
trainer.n_gpus_per_node set to this machine's one device. The ReTool recipe's rows are converted
beforehand (``reinforge data retool``), so its two ``data.custom_cls`` words, which name the
recipe's own dataset class, go with the data-path swap.
"""

from __future__ import annotations

GRPO_7B = """
algorithm.adv_estimator=grpo data.train_files={TRAIN} data.val_files={VAL} data.train_batch_size=1024
data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation='error'
actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger='["console","wandb"]'
trainer.project_name='verl_grpo_example_gsm8k' trainer.experiment_name='qwen2_7b_function_rm'
trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
"""

GRPO_LORA = """
algorithm.adv_estimator=grpo trainer.val_before_train=False data.train_files={TRAIN} data.val_files={VAL}
data.train_batch_size=16 data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=True
data.truncation='error' data.shuffle=False actor_rollout_ref.model.path={MODEL} actor_rollout_ref.model.lora_rank=64
actor_rollout_ref.model.lora_alpha=32 actor_rollout_ref.actor.optim.lr=3e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.rollout.load_format=safetensors actor_rollout_ref.rollout.layered_summon=True
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger='["console","wandb"]'
trainer.project_name='verl_grpo_example_gsm8k' trainer.experiment_name='qwen2.5_3b_grpo_lora'
trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
"""

PPO_CRITIC = """
algorithm.adv_estimator=gae data.train_files={TRAIN} data.val_files={VAL} data.train_batch_size=1024
data.max_prompt_length=512 data.max_response_length=512 data.filter_overlong_prompts=True data.truncation='error'
actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.tensor_model_parallel_size=4
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.4 critic.optim.lr=1e-5
critic.model.use_remove_padding=True critic.model.path={MODEL} critic.model.enable_gradient_checkpointing=True
critic.ppo_micro_batch_size_per_gpu=32 critic.model.fsdp_config.param_offload=False
critic.model.fsdp_config.optimizer_offload=False algorithm.use_kl_in_reward=False trainer.critic_warmup=0
trainer.logger='["console","wandb"]' trainer.project_name='verl_example_gsm8k'
trainer.experiment_name='deepseek_llm_7b_function_rm' trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=20
trainer.test_freq=1 trainer.use_legacy_worker_impl=auto trainer.total_epochs=15
"""

SEQ_BALANCE = """
algorithm.adv_estimator=grpo data.train_files={TRAIN} data.val_files={VAL} data.return_raw_chat=True
data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=True
data.truncation='error' actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.multi_turn.format=hermes
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False trainer.critic_warmup=0
trainer.logger='["console","wandb"]' trainer.project_name='verl_grpo_example_gsm8k'
trainer.experiment_name='qwen2_7b_function_rm_kl1e-3' trainer.val_before_train=False trainer.n_gpus_per_node=1
trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
"""

REINFORCE_PLUS_PLUS = """
algorithm.adv_estimator=reinforce_plus_plus data.train_files="['{TRAIN}', '{TRAIN}']" data.val_files="['{VAL}', '{VAL}']"
data.train_batch_size=1024 data.max_prompt_length=1024 data.max_response_length=1024 data.filter_overlong_prompts=True
data.truncation='error' actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=3e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=1024
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_kl_loss=False
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=mse actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=8
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=True trainer.critic_warmup=0 trainer.logger='["console","wandb"]'
trainer.project_name='verl_grpo_example_gsm8k' trainer.experiment_name='qwen2_7b_function_rm'
trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=5 trainer.total_epochs=15
"""

DAPO_32B = """
data.train_files={TRAIN} data.val_files={VAL} data.prompt_key=prompt data.truncation='left' data.max_prompt_length=2048
data.max_response_length=20480 data.gen_batch_size=1536 data.train_batch_size=512 actor_rollout_ref.rollout.n=16
algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0
actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
actor_rollout_ref.actor.clip_ratio_c=10.0 algorithm.filter_groups.enable=True
algorithm.filter_groups.max_num_gen_batches=10 algorithm.filter_groups.metric=acc
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.use_dynamic_bsz=True
actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=22528 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=22528
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=22528 actor_rollout_ref.model.path={MODEL}
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.optim.lr_warmup_steps=10 actor_rollout_ref.actor.optim.weight_decay=0.1
actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.fsdp_config.param_offload=True
actor_rollout_ref.actor.fsdp_config.optimizer_offload=True actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.actor.grad_clip=1.0 actor_rollout_ref.actor.loss_agg_mode=token-mean
actor_rollout_ref.actor.ulysses_sequence_parallel_size=8 actor_rollout_ref.rollout.gpu_memory_utilization=0.80
actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.enable_chunked_prefill=True
actor_rollout_ref.rollout.max_num_batched_tokens=22528 actor_rollout_ref.rollout.temperature=1.0
actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k="-1" actor_rollout_ref.rollout.val_kwargs.temperature=1.0
actor_rollout_ref.rollout.val_kwargs.top_p=0.7 actor_rollout_ref.rollout.val_kwargs.top_k=-1
actor_rollout_ref.rollout.val_kwargs.do_sample=True actor_rollout_ref.rollout.val_kwargs.n=1
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.ref.fsdp_config.param_offload=True
actor_rollout_ref.ref.ulysses_sequence_parallel_size=8 actor_rollout_ref.actor.fsdp_config.fsdp_size=-1
reward_model.reward_manager=dapo reward_model.overlong_buffer.enable=True reward_model.overlong_buffer.len=4096
reward_model.overlong_buffer.penalty_factor=1.0 trainer.logger='["console","wandb"]' trainer.project_name="DAPO"
trainer.experiment_name="DAPO-Qwen2.5-32B" trainer.n_gpus_per_node=1 trainer.nnodes="1" trainer.val_before_train=True
trainer.test_freq=5 trainer.save_freq=5 trainer.total_epochs=1 trainer.default_local_dir="{RUN}/DAPO/DAPO-Qwen2.5-32B"
trainer.resume_mode=auto
"""

GSPO = """
algorithm.adv_estimator=grpo actor_rollout_ref.actor.policy_loss.loss_mode=gspo data.train_files="['{TRAIN}']"
data.val_files="['{VAL}']" data.shuffle=true data.prompt_key=prompt data.truncation='error'
data.filter_overlong_prompts=true data.return_raw_chat=True data.train_batch_size=512 data.max_prompt_length=2048
data.max_response_length=8192 actor_rollout_ref.rollout.n=16 algorithm.use_kl_in_reward=false
algorithm.kl_ctrl.kl_coef=0.0 actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.kl_loss_coef=0.0
actor_rollout_ref.actor.clip_ratio_low=0.0003 actor_rollout_ref.actor.clip_ratio_high=0.0004
actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.actor.use_dynamic_bsz=true
actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30720
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30720 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.mode=async actor_rollout_ref.model.path="{MODEL}"
actor_rollout_ref.model.enable_gradient_checkpointing=true actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05 actor_rollout_ref.actor.optim.weight_decay=0.1
actor_rollout_ref.actor.ppo_mini_batch_size=128 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
actor_rollout_ref.actor.fsdp_config.param_offload=true actor_rollout_ref.actor.fsdp_config.optimizer_offload=true
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.grad_clip=1.0
actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean actor_rollout_ref.actor.ulysses_sequence_parallel_size=1
actor_rollout_ref.rollout.gpu_memory_utilization=0.8 actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.enable_chunked_prefill=true actor_rollout_ref.rollout.max_num_batched_tokens=10240
actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1
actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.7
actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=true
actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.ref.fsdp_config.param_offload=true
actor_rollout_ref.ref.ulysses_sequence_parallel_size=1 actor_rollout_ref.actor.entropy_checkpointing=true
reward_model.reward_manager=dapo +reward_model.reward_kwargs.overlong_buffer_cfg.enable=false
+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096 +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
+reward_model.reward_kwargs.overlong_buffer_cfg.log=false +reward_model.reward_kwargs.max_resp_len=8192
trainer.logger='["console","wandb"]' trainer.project_name="RL-GSPO"
trainer.experiment_name="gspo-epslow-0.0003-epshigh-0.0004-Qwen2.5-3B-Instruct-RL" trainer.n_gpus_per_node="1"
trainer.nnodes="1" trainer.val_before_train=false trainer.test_freq=10 trainer.save_freq=10 trainer.total_epochs=10
trainer.total_training_steps=500 trainer.default_local_dir="{RUN}/gspo" trainer.resume_mode=auto
trainer.log_val_generations=2
"""

MULTI_TURN_GSM8K = """
--config-path=/verl/examples/sglang_multiturn/config --config-name='gsm8k_multiturn_grpo' algorithm.adv_estimator=grpo
data.train_batch_size=256 data.max_prompt_length=1024 data.max_response_length=1024 data.filter_overlong_prompts=True
data.truncation='error' data.return_raw_chat=True actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
global_profiler.tool=torch_memory global_profiler.save_path=./mem_snapshots
global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000
global_profiler.global_tool_config.torch_memory.stack_depth=32 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.name=sglang
actor_rollout_ref.rollout.gpu_memory_utilization=0.85 actor_rollout_ref.rollout.multi_stage_wake_up=True
actor_rollout_ref.rollout.n=16 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
actor_rollout_ref.ref.fsdp_config.param_offload=True actor_rollout_ref.rollout.over_sample_rate=0.1
actor_rollout_ref.rollout.mode=async algorithm.use_kl_in_reward=False trainer.critic_warmup=0
trainer.logger='["console","wandb"]' trainer.project_name='multi-turn-grpo-qwen2.5-3b-sglang'
trainer.experiment_name=qwen2.5-3b_baseline_03-06-00 trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=-1
trainer.test_freq=20 trainer.val_before_train=True data.train_files={TRAIN} data.val_files={VAL}
actor_rollout_ref.rollout.multi_turn.tool_config_path="{TOOLS}" trainer.total_epochs=15
"""

RETOOL = """
algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0
data.train_files="['{TRAIN}']" data.val_files="['{VAL}', '{VAL}']" data.return_raw_chat=True data.train_batch_size=64
data.max_prompt_length=2048 data.max_response_length=16384 data.filter_overlong_prompts=True data.truncation='error'
custom_reward_function.path={REWARD} custom_reward_function.name=compute_score actor_rollout_ref.model.path={MODEL}
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0 actor_rollout_ref.actor.clip_ratio_low=0.2
actor_rollout_ref.actor.clip_ratio_high=0.28 actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_mini_batch_size=16
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=18432 actor_rollout_ref.actor.ulysses_sequence_parallel_size=4
actor_rollout_ref.actor.fsdp_config.param_offload=True actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=73728 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.tensor_model_parallel_size=4
actor_rollout_ref.rollout.multi_turn.enable=True actor_rollout_ref.rollout.multi_turn.max_user_turns=16
actor_rollout_ref.rollout.multi_turn.max_assistant_turns=16 actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS}
actor_rollout_ref.rollout.multi_turn.format=hermes actor_rollout_ref.rollout.gpu_memory_utilization=0.9
actor_rollout_ref.rollout.n=16 actor_rollout_ref.rollout.val_kwargs.top_p=0.6 actor_rollout_ref.rollout.val_kwargs.temperature=1.0
actor_rollout_ref.rollout.val_kwargs.n=30 trainer.logger=['console','wandb'] trainer.project_name=retool
trainer.experiment_name=qwen2.5-7b_dapo trainer.n_gpus_per_node=1 trainer.val_before_train=True
trainer.log_val_generations=20 trainer.nnodes=1 trainer.save_freq=20 trainer.default_local_dir={RUN}/checkpoint/qwen2.5-7b_dapo
trainer.test_freq=10 trainer.total_epochs=1
"""

COMMANDS = {
    "grpo_7b": ("examples/grpo_trainer/run_qwen2-7b.sh", GRPO_7B),
    "grpo_lora": ("examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh", GRPO_LORA),
    "ppo_critic": ("examples/ppo_trainer/run_deepseek7b_llm.sh", PPO_CRITIC),
    "seq_balance": ("examples/grpo_trainer/run_qwen2-7b_seq_balance.sh", SEQ_BALANCE),
    "reinforce_plus_plus": ("examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh", REINFORCE_PLUS_PLUS),
    "dapo_32b": ("verl-recipe dapo/run_dapo_qwen2.5_32b.sh", DAPO_32B),
    "gspo": ("examples/gspo_trainer/test_gspo_3b_math.sh", GSPO),
    "multi_turn_gsm8k": ("examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh", MULTI_TURN_GSM8K),
    "retool": ("verl-recipe retool/run_qwen2_7b_dapo.sh", RETOOL),
}
"""name -> (the script it comes from, its words)."""


# ---- translated only: the model families and recipes people bring, as their scripts write them --------------------
# Substituted like the commands above ({REWARD_MODEL} is a reward model's path), but with the scripts' own device
# counts: they are translated and checked, not trained.

GEMMA_PPO = """
algorithm.adv_estimator=gae data.train_files={TRAIN} data.val_files={VAL} data.train_batch_size=512
data.max_prompt_length=1024 data.max_response_length=512 data.filter_overlong_prompts=True data.truncation=error
actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=False actor_rollout_ref.actor.ppo_mini_batch_size=128
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.use_kl_loss=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.4 critic.optim.lr=1e-5
critic.model.use_remove_padding=False critic.model.path={MODEL} critic.model.enable_gradient_checkpointing=False
critic.ppo_micro_batch_size_per_gpu=4 critic.model.fsdp_config.param_offload=False
critic.model.fsdp_config.optimizer_offload=False algorithm.use_kl_in_reward=False trainer.critic_warmup=0
trainer.logger='["console","wandb"]' trainer.project_name=verl_example trainer.experiment_name=gemma2b_function_rm
trainer.n_gpus_per_node=2 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=10 trainer.total_epochs=15
"""

MISTRAL_REWARD_MODEL = """
algorithm.adv_estimator=grpo data.train_files={TRAIN} data.val_files={VAL} data.train_batch_size=512
data.prompt_key=prompt data.return_raw_chat=True data.max_prompt_length=4096 data.max_response_length=2048
data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.model.path={MODEL}
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=128
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10 actor_rollout_ref.actor.use_kl_loss=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=10 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.n=5 actor_rollout_ref.rollout.gpu_memory_utilization=0.7
actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.model.enable_gradient_checkpointing=True
reward_model.enable=True reward_model.model.path={REWARD_MODEL} reward_model.use_reward_loop=True
reward_model.rollout.name=vllm reward_model.rollout.gpu_memory_utilization=0.8
reward_model.rollout.tensor_model_parallel_size=1 reward_model.rollout.prompt_length=8192
reward_model.rollout.response_length=4096 reward_model.num_workers=8 algorithm.use_kl_in_reward=False
trainer.logger='["console","wandb"]' trainer.val_before_train=False trainer.project_name=verl_full_hh_rlhf_examples
trainer.experiment_name=grpo_mistral13B-skyworkLlama8b-hhrlhf trainer.n_gpus_per_node=8 trainer.nnodes=1
trainer.save_freq=10 trainer.test_freq=-1 trainer.total_epochs=5
"""

PPO_REWARD_MODEL_SEQ_BALANCE = """
algorithm.adv_estimator=gae data.train_files="['{TRAIN}', '{TRAIN}']" data.val_files="['{VAL}', '{VAL}']"
data.train_batch_size=4096 data.max_prompt_length=4096 data.max_response_length=4096 data.filter_overlong_prompts=True
data.truncation=error data.return_raw_chat=True actor_rollout_ref.model.path={MODEL}
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.ppo_mini_batch_size=512
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.5
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24000 critic.optim.lr=1e-5
critic.model.use_remove_padding=True critic.model.path={MODEL} critic.model.enable_gradient_checkpointing=True
critic.use_dynamic_bsz=True critic.ppo_max_token_len_per_gpu=98304 critic.model.fsdp_config.param_offload=False
critic.model.fsdp_config.optimizer_offload=False reward_model.enable=True reward_model.model.path={REWARD_MODEL}
reward_model.use_reward_loop=True reward_model.rollout.name=vllm reward_model.rollout.gpu_memory_utilization=0.8
reward_model.rollout.tensor_model_parallel_size=1 reward_model.rollout.prompt_length=8192
reward_model.rollout.response_length=4096 reward_model.num_workers=8 algorithm.use_kl_in_reward=False
trainer.critic_warmup=0 trainer.logger='["console","wandb"]' trainer.project_name=verl_example_gsm8k
trainer.experiment_name=qwen2-7b_hybrid_rm_bsz8k_p4k_r4k_seq_packing trainer.n_gpus_per_node=8
trainer.val_before_train=False trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
"""

DEEPSEEK_V3_MEGATRON = """
--config-path=/verl/config --config-name=ppo_megatron_trainer algorithm.adv_estimator=grpo
algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0 data.train_files={TRAIN} data.val_files={VAL}
data.train_batch_size=512 data.max_prompt_length=2048 data.max_response_length=4096 data.filter_overlong_prompts=True
data.truncation=error actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=128 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
actor_rollout_ref.actor.use_torch_compile=False actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.8 actor_rollout_ref.rollout.n=4
actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1
actor_rollout_ref.rollout.tensor_model_parallel_size=32 trainer.logger='["console","tensorboard"]'
trainer.project_name=verl_megatron_gsm8k_examples trainer.experiment_name=dsv3-32nodes trainer.n_gpus_per_node=8
trainer.nnodes=32 trainer.save_freq=-1 trainer.test_freq=5 actor_rollout_ref.model.use_fused_kernels=True
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=6144
actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=18432
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=18432
actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=fused
+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=4
+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage=1
actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=16
actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=16
actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1
actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1
actor_rollout_ref.actor.megatron.expert_model_parallel_size=16
actor_rollout_ref.ref.megatron.expert_model_parallel_size=16
actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1
actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1 actor_rollout_ref.actor.megatron.param_offload=True
actor_rollout_ref.actor.megatron.optimizer_offload=True actor_rollout_ref.actor.megatron.grad_offload=True
actor_rollout_ref.ref.megatron.param_offload=True
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1
actor_rollout_ref.actor.megatron.use_mbridge=True trainer.default_local_dir={RUN} trainer.val_before_train=False
trainer.total_epochs=100
"""

QWEN3_MOE_MEGATRON_LORA = """
--config-path=/verl/config --config-name=ppo_megatron_trainer.yaml data.train_files={TRAIN} data.val_files={VAL}
data.train_batch_size=128 data.max_prompt_length=1024 data.max_response_length=1024 data.truncation=error
data.filter_overlong_prompts=True data.shuffle=False algorithm.adv_estimator=grpo actor_rollout_ref.model.path={MODEL}
actor_rollout_ref.model.use_fused_kernels=True actor_rollout_ref.model.lora.rank=32
actor_rollout_ref.model.lora.alpha=64 actor_rollout_ref.model.lora.lora_A_init_method=kaiming
actor_rollout_ref.rollout.tensor_model_parallel_size=8 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.25 actor_rollout_ref.rollout.enforce_eager=True
actor_rollout_ref.rollout.free_cache_engine=True actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.optim.lr=3e-6
actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
actor_rollout_ref.actor.megatron.use_mbridge=True actor_rollout_ref.actor.megatron.vanilla_mbridge=False
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
actor_rollout_ref.actor.megatron.expert_model_parallel_size=4 actor_rollout_ref.actor.megatron.context_parallel_size=2
actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1 actor_rollout_ref.actor.megatron.param_offload=True
actor_rollout_ref.actor.megatron.optimizer_offload=True actor_rollout_ref.actor.megatron.grad_offload=True
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2
actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2
actor_rollout_ref.ref.megatron.expert_model_parallel_size=4 actor_rollout_ref.ref.megatron.context_parallel_size=2
actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1 actor_rollout_ref.ref.megatron.param_offload=True
trainer.critic_warmup=0 trainer.logger='["console","wandb"]' trainer.project_name=verl_grpo_example_gsm8k_math
trainer.experiment_name=qwen3_30b_a3b_megatron_lora trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20
trainer.test_freq=5 trainer.total_epochs=15
"""

QWEN3_8B = """
algorithm.adv_estimator=grpo data.train_files={TRAIN} data.val_files={VAL} data.train_batch_size=1024
data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger='["console","wandb"]'
trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=qwen3_8b_function_rm trainer.n_gpus_per_node=8
trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
"""

GSPO_QWEN3_MOE = """
--config-path=/verl/config --config-name=ppo_megatron_trainer algorithm.adv_estimator=grpo
algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.001 algorithm.gamma=1.0 algorithm.lam=0.95
data.train_files={TRAIN} data.val_files={VAL} data.return_raw_chat=True data.train_batch_size=256
data.max_prompt_length=2048 data.max_response_length=8192 data.filter_overlong_prompts=True
data.filter_overlong_prompts_workers=64 data.truncation=error trainer.use_legacy_worker_impl=disable
trainer.critic_warmup=0 trainer.logger='[console,wandb]' trainer.project_name=wuxibin_gspo
trainer.experiment_name=qwen3-30B-base-grpo-megatron trainer.default_local_dir={RUN} trainer.n_gpus_per_node=8
trainer.nnodes=1 trainer.val_before_train=False trainer.log_val_generations=100 trainer.save_freq=-1
trainer.test_freq=10 trainer.total_epochs=10 trainer.total_training_steps=500 actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.path={MODEL} actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.clip_ratio_low=3e-4 actor_rollout_ref.actor.clip_ratio_high=4e-4
actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.actor.policy_loss.loss_mode=gspo
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_mini_batch_size=32
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30720 actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
actor_rollout_ref.actor.megatron.context_parallel_size=1
actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1
actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null
actor_rollout_ref.actor.megatron.expert_model_parallel_size=8
actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1 actor_rollout_ref.actor.megatron.param_offload=True
actor_rollout_ref.actor.megatron.grad_offload=True actor_rollout_ref.actor.megatron.optimizer_offload=True
+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32
+actor_rollout_ref.actor.megatron.override_transformer_config.moe_permute_fusion=True
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1
+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True
+actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion=True
actor_rollout_ref.actor.megatron.use_mbridge=True actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.tensor_model_parallel_size=4
actor_rollout_ref.rollout.data_parallel_size=1 actor_rollout_ref.rollout.expert_parallel_size=1
actor_rollout_ref.rollout.gpu_memory_utilization=0.8 actor_rollout_ref.rollout.n=16
actor_rollout_ref.rollout.val_kwargs.top_p=0.7 actor_rollout_ref.rollout.val_kwargs.temperature=1.0
actor_rollout_ref.rollout.val_kwargs.n=1 reward_model.reward_manager=dapo
+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True +reward_model.reward_kwargs.overlong_buffer_cfg.len=4096
+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
+reward_model.reward_kwargs.overlong_buffer_cfg.log=False +reward_model.reward_kwargs.max_resp_len=8192
"""

DAPO_QWEN3_MOE_FP8_ROLLOUT = """
--config-path=/verl/config --config-name=dapo_megatron_trainer.yaml data.train_files={TRAIN} data.val_files={VAL}
data.prompt_key=prompt data.return_raw_chat=True data.truncation=left data.max_prompt_length=2048
data.max_response_length=20480 data.train_batch_size=128 data.gen_batch_size=384 algorithm.adv_estimator=grpo
algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0 algorithm.filter_groups.enable=True
algorithm.filter_groups.max_num_gen_batches=10 algorithm.filter_groups.metric=acc
algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=2.0
algorithm.rollout_correction.rollout_is_batch_normalize=false algorithm.rollout_correction.rollout_rs=null
algorithm.rollout_correction.rollout_rs_threshold=null actor_rollout_ref.model.path={MODEL}
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.dtype=bfloat16
actor_rollout_ref.rollout.gpu_memory_utilization=0.5 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.expert_parallel_size=1 actor_rollout_ref.rollout.enable_chunked_prefill=True
actor_rollout_ref.rollout.max_num_batched_tokens=32768 actor_rollout_ref.rollout.max_num_seqs=256
actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1
actor_rollout_ref.rollout.val_kwargs.temperature=0.6 actor_rollout_ref.rollout.val_kwargs.top_p=1.0
actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=True
actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.rollout.calculate_log_probs=True
actor_rollout_ref.rollout.n=16 actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0
actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=22528
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.weight_decay=0.1
actor_rollout_ref.actor.optim.clip_grad=1.0 actor_rollout_ref.actor.ppo_mini_batch_size=128
actor_rollout_ref.actor.megatron.param_offload=True actor_rollout_ref.actor.megatron.optimizer_offload=True
actor_rollout_ref.actor.megatron.grad_offload=True actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4
actor_rollout_ref.actor.megatron.expert_model_parallel_size=8
actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1 actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.actor.loss_agg_mode=token-mean actor_rollout_ref.actor.megatron.use_mbridge=True
actor_rollout_ref.actor.megatron.vanilla_mbridge=False +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True
+reward_model.reward_kwargs.overlong_buffer_cfg.len=512
+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
+reward_model.reward_kwargs.overlong_buffer_cfg.log=False +reward_model.reward_kwargs.max_resp_len=20480
reward_model.reward_manager=dapo +actor_rollout_ref.actor.megatron.override_transformer_config.fp8=hybrid
+actor_rollout_ref.actor.megatron.override_transformer_config.fp8_recipe=blockwise
+actor_rollout_ref.actor.optim.override_optimizer_config.fp8_recipe=blockwise
+actor_rollout_ref.rollout.quantization=fp8
+actor_rollout_ref.actor.megatron.override_transformer_config.attention_dropout=0.0
+actor_rollout_ref.actor.megatron.override_transformer_config.hidden_dropout=0.0
+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True
actor_rollout_ref.model.use_fused_kernels=False
+actor_rollout_ref.actor.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=True
+actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer=True
+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=False
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full
+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1 trainer.logger='[console,wandb]'
trainer.project_name=VERL-FP8-RL trainer.experiment_name=dapo-qwen3-30b-a3b-B128-R20K-FP8E2E-TIS-4n
trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.val_before_train=False trainer.test_freq=10 trainer.save_freq=5
trainer.max_actor_ckpt_to_keep=5 trainer.total_epochs=100 trainer.default_local_dir={RUN} trainer.resume_mode=auto
trainer.log_val_generations=2 trainer.use_legacy_worker_impl=disable
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=22528
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=22528
"""

DAPO_QWEN3_8B_REWARD_SECTION = """
data.train_files={TRAIN} data.val_files={VAL} data.prompt_key=prompt data.truncation=left data.max_prompt_length=2048
data.max_response_length=20480 data.gen_batch_size=48 data.train_batch_size=16 actor_rollout_ref.rollout.n=16
algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0
actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
actor_rollout_ref.actor.clip_ratio_c=10.0 algorithm.filter_groups.enable=False
algorithm.filter_groups.max_num_gen_batches=10 algorithm.filter_groups.metric=acc
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.use_dynamic_bsz=True
actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=11264 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=11264
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=11264 actor_rollout_ref.model.path={MODEL}
+actor_rollout_ref.model.override_config.attention_dropout=0. +actor_rollout_ref.model.override_config.embd_pdrop=0.
+actor_rollout_ref.model.override_config.resid_pdrop=0. actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps=10
actor_rollout_ref.actor.optim.weight_decay=0.1 actor_rollout_ref.actor.ppo_mini_batch_size=1
actor_rollout_ref.actor.fsdp_config.param_offload=True actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.grad_clip=1.0
actor_rollout_ref.actor.loss_agg_mode=token-mean actor_rollout_ref.actor.ulysses_sequence_parallel_size=2
actor_rollout_ref.rollout.gpu_memory_utilization=0.90 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.enable_chunked_prefill=False actor_rollout_ref.rollout.max_num_batched_tokens=22528
actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1
actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=1.0
actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=True
actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.ref.fsdp_config.param_offload=True actor_rollout_ref.ref.ulysses_sequence_parallel_size=2
actor_rollout_ref.actor.fsdp_config.fsdp_size=-1 reward.reward_manager.name=dapo
reward.reward_kwargs.overlong_buffer_cfg.enable=True reward.reward_kwargs.overlong_buffer_cfg.len=4096
reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 reward.reward_kwargs.max_resp_len=20480
trainer.logger='[console]' trainer.project_name=DAPO trainer.experiment_name=DAPO-Qwen3-8B-Base
trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.val_before_train=False trainer.test_freq=10 trainer.save_freq=20
trainer.total_epochs=1 trainer.total_training_steps=100 trainer.default_local_dir={RUN} trainer.resume_mode=auto
data.shuffle=False actor_rollout_ref.actor.use_torch_compile=False actor_rollout_ref.ref.use_torch_compile=False
actor_rollout_ref.actor.entropy_checkpointing=True actor_rollout_ref.ref.entropy_checkpointing=True
actor_rollout_ref.actor.fsdp_config.forward_prefetch=True actor_rollout_ref.ref.fsdp_config.forward_prefetch=True
"""

QWEN2_5_VL_LORA = """
algorithm.adv_estimator=grpo data.train_files={TRAIN} data.val_files={VAL} data.train_batch_size=512
data.max_prompt_length=1024 data.max_response_length=2048 data.filter_overlong_prompts=True data.truncation=error
data.image_key=images actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=3e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=128
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10 actor_rollout_ref.model.lora_rank=64
actor_rollout_ref.model.lora_alpha=32 actor_rollout_ref.model.target_modules=all-linear
actor_rollout_ref.model.exclude_modules=.*visual.* actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.01 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm +actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.enable_chunked_prefill=False
actor_rollout_ref.rollout.enforce_eager=False actor_rollout_ref.rollout.free_cache_engine=False
actor_rollout_ref.rollout.n=5 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20
actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False trainer.critic_warmup=0
trainer.logger='["console","wandb"]' trainer.project_name=verl_grpo_example_geo3k
trainer.experiment_name=qwen2_5_vl_7b_function_rm trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20
trainer.test_freq=5 trainer.total_epochs=15
"""

LORA_FROM_ADAPTER = """
algorithm.adv_estimator=grpo data.train_files={TRAIN} data.val_files={VAL} data.train_batch_size=1024
data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
data.shuffle=False actor_rollout_ref.model.path={MODEL} actor_rollout_ref.model.use_shm=True
actor_rollout_ref.model.lora_adapter_path={RUN}/lora_adapter actor_rollout_ref.actor.optim.lr=3e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.rollout.load_format=safetensors actor_rollout_ref.rollout.layered_summon=True
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger='["console","wandb"]'
trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=qwen2.5_3b_grpo_lora trainer.n_gpus_per_node=8
trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
"""

MULTI_TURN_QWEN3 = """
--config-path=/verl/config --config-name=gsm8k_multiturn_grpo algorithm.adv_estimator=grpo data.train_batch_size=256
data.max_prompt_length=1024 data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
data.return_raw_chat=True actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.gpu_memory_utilization=0.5
actor_rollout_ref.rollout.n=16 actor_rollout_ref.rollout.over_sample_rate=0.1 actor_rollout_ref.rollout.mode=async
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger='["console","wandb"]'
trainer.project_name=gsm8k_async_rl trainer.experiment_name=qwen3-4b_function_rm-gsm8k-sgl-multi-w-tool-verify-n16
trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=20 data.train_files={TRAIN}
data.val_files={VAL} actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS} trainer.total_epochs=15
"""


QWEN3_8B_MEGATRON_ENGINE = """
algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False data.train_files="['{TRAIN}', '{TRAIN}']"
data.val_files="['{VAL}', '{VAL}']" data.train_batch_size=1024 data.max_prompt_length=1024
data.max_response_length=2048 data.filter_overlong_prompts=True data.truncation='error'
actor_rollout_ref.model.path="{MODEL}" actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576
actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576
actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2 actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2
trainer.balance_batch=True trainer.logger='["console","wandb"]' trainer.project_name=verl_grpo_gsm8k_math
trainer.experiment_name=qwen3_8b_vllm_megatron trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20
trainer.test_freq=5 trainer.total_epochs=15 model_engine=megatron
ray_kwargs.ray_init.runtime_env.py_executable="uv -v run --frozen --all-packages --extra vllm --extra megatron"
"""

QWEN3_30B_VEOMNI = """
algorithm.use_kl_in_reward=False algorithm.adv_estimator=grpo data.train_files={TRAIN} data.val_files={VAL}
data.train_batch_size=16 data.max_prompt_length=2048 data.max_response_length=8192 data.filter_overlong_prompts=False
data.truncation='error' actor_rollout_ref.model.path={MODEL} actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.veomni.param_offload=True actor_rollout_ref.actor.veomni.optimizer_offload=True
actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.actor.use_torch_compile=False actor_rollout_ref.actor.veomni.fsdp_size=-1
actor_rollout_ref.actor.veomni.expert_parallel_size=1 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10240
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 actor_rollout_ref.rollout.data_parallel_size=8
actor_rollout_ref.rollout.expert_parallel_size=8 actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30720
actor_rollout_ref.rollout.gpu_memory_utilization=0.7 actor_rollout_ref.rollout.enable_chunked_prefill=True
actor_rollout_ref.rollout.enable_prefix_caching=True actor_rollout_ref.rollout.max_model_len=10240
actor_rollout_ref.rollout.max_num_batched_tokens=1024 actor_rollout_ref.rollout.max_num_seqs=128
actor_rollout_ref.rollout.enforce_eager=False actor_rollout_ref.rollout.free_cache_engine=True
actor_rollout_ref.rollout.n=4
+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_capture_sizes="[1, 8, 16, 32, 40, 48, 64, 96, 128, 256]"
+actor_rollout_ref.rollout.engine_kwargs.vllm.mm_processor_cache_gb=0 actor_rollout_ref.ref.veomni.param_offload=True
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1 actor_rollout_ref.ref.veomni.param_offload=True
actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30720 +trainer.use_legacy_worker_impl=disable
trainer.critic_warmup=0 trainer.logger=console trainer.project_name=verl_qwen3_veomni
trainer.experiment_name=qwen3_30b_veomni trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=100
trainer.default_local_dir={RUN} trainer.test_freq=-1 trainer.total_training_steps=100 model_engine=veomni
"""

CISPO_QWEN3_8B = """
algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False data.train_files="['{TRAIN}', '{TRAIN}']"
data.val_files="['{VAL}', '{VAL}']" data.train_batch_size=1024 data.max_prompt_length=1024
data.max_response_length=2048 data.filter_overlong_prompts=True data.truncation='error'
actor_rollout_ref.model.path="{MODEL}" actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.policy_loss.loss_mode=cispo
actor_rollout_ref.actor.clip_ratio_low=10 actor_rollout_ref.actor.clip_ratio_high=0.2 actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.use_dynamic_bsz=True
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.gpu_memory_utilization=0.6
actor_rollout_ref.rollout.n=5 actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576 actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576 actor_rollout_ref.ref.fsdp_config.param_offload=True
trainer.balance_batch=True trainer.critic_warmup=0 trainer.logger='["console","wandb"]'
trainer.project_name=verl_cispo_gsm8k_math trainer.experiment_name=qwen3_8b_vllm_fsdp trainer.n_gpus_per_node=8
trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
ray_kwargs.ray_init.runtime_env.py_executable="uv -v run --frozen --all-packages --extra vllm --extra fsdp"
"""

OPD_QWEN3_8B = """
algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False data.train_files="['{TRAIN}', '{TRAIN}']"
data.val_files="['{VAL}', '{VAL}']" data.train_batch_size=128 data.max_prompt_length=1024
data.max_response_length=2048 data.filter_overlong_prompts=True data.truncation='error' data.shuffle=False
actor_rollout_ref.model.path="{MODEL}" actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.use_torch_compile=True
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=128
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576
actor_rollout_ref.actor.fsdp_config.param_offload=True actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.rollout.n=1
actor_rollout_ref.rollout.max_model_len=3073 actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576 trainer.balance_batch=True
trainer.logger='["console","wandb"]' trainer.project_name=verl_distill_gsm8k_math
trainer.experiment_name=qwen3_8b_from_qwen3_32b_vllm_fsdp trainer.n_gpus_per_node=8 trainer.nnodes=1
trainer.val_before_train=False trainer.save_freq=200 trainer.test_freq=5 trainer.total_epochs=15 distillation.enabled=True
distillation.n_gpus_per_node=4 distillation.nnodes=1 distillation.teacher_models.teacher_model.model_path=Qwen/Qwen3-32B
distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2
distillation.teacher_models.teacher_model.inference.name=vllm
distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=0.4
distillation.teacher_models.teacher_model.inference.max_model_len=3073 distillation.distillation_loss.loss_mode=k1
distillation.distillation_loss.topk=64 distillation.distillation_loss.use_task_rewards=False
distillation.distillation_loss.use_policy_gradient=True distillation.distillation_loss.loss_max_clamp=10.0
distillation.distillation_loss.log_prob_min_clamp=-10.0
"""

SAPO_QWEN3_8B = """
algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False data.train_files="['{TRAIN}', '{TRAIN}']"
data.val_files="['{VAL}', '{VAL}']" data.train_batch_size=256 data.max_prompt_length=2048
data.max_response_length=8192 data.filter_overlong_prompts=True data.truncation='error'
actor_rollout_ref.model.path="{MODEL}" actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.policy_loss.loss_mode=sapo
+actor_rollout_ref.actor.policy_loss.tau_pos=1.0 +actor_rollout_ref.actor.policy_loss.tau_neg=1.05
actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=64
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.actor.fsdp_config.param_offload=True actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.gpu_memory_utilization=0.7 actor_rollout_ref.rollout.n=16
trainer.logger='["console","wandb"]' trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.total_epochs=10
"""

GPT_OSS_20B = """
algorithm.adv_estimator=grpo data.train_files={TRAIN} data.val_files={VAL} data.train_batch_size=256
data.max_prompt_length=512 data.max_response_length=8192 data.filter_overlong_prompts=True data.truncation='error'
+data.apply_chat_template_kwargs.reasoning_effort=medium algorithm.use_kl_in_reward=False
actor_rollout_ref.model.path={MODEL} actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.n=5 trainer.n_gpus_per_node=8 trainer.nnodes=1
"""

QWEN3_5_MEGATRON_LITE = """
hydra.searchpath=[pkg://verl_mlite.config] algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
data.train_files={TRAIN} data.val_files={VAL} data.train_batch_size=32 data.max_prompt_length=1024
data.max_response_length=2048 actor_rollout_ref.model.path={MODEL} actor@actor_rollout_ref.actor=mlite_actor
actor_rollout_ref.actor.engine.tp=1 actor_rollout_ref.actor.engine.ep=8 actor_rollout_ref.actor.engine.cp=8
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=5 trainer.n_gpus_per_node=8 trainer.nnodes=1
"""

QWEN3_NEXT_80B_NPU = """
data.train_files={TRAIN} data.val_files={VAL} data.train_batch_size=16 data.max_prompt_length=2048
data.max_response_length=20480 data.truncation='error' actor_rollout_ref.actor.strategy=fsdp2
actor_rollout_ref.nccl_timeout=14400 actor_rollout_ref.actor.fsdp_config.param_offload=True
actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2816
actor_rollout_ref.actor.ulysses_sequence_parallel_size=8 actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=16
trainer.logger='["console"]' trainer.n_gpus_per_node=16 trainer.nnodes=4 trainer.total_epochs=1 trainer.device=npu
algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False actor_rollout_ref.model.path={MODEL}
"""

ROUTER_REPLAY_MEGATRON = """
algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False data.train_files={TRAIN} data.val_files={VAL}
data.train_batch_size=3 data.max_prompt_length=512 data.max_response_length=512 actor_rollout_ref.model.path={MODEL}
actor_rollout_ref.actor.strategy=megatron actor_rollout_ref.actor.model_engine=megatron
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=3 actor_rollout_ref.rollout.n=8
actor_rollout_ref.actor.megatron.router_replay.mode=R3 trainer.n_gpus_per_node=8 trainer.nnodes=6
"""

ONE_STEP_OFF_GRPO = """
python3 -m verl.experimental.one_step_off_policy.main_ppo algorithm.adv_estimator=grpo data.train_files={TRAIN}
data.val_files={VAL} data.train_batch_size=1152 data.max_prompt_length=512 data.max_response_length=1024
data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.actor.strategy=fsdp2 critic.strategy=fsdp2
actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.hybrid_engine=False
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=192
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.rollout.load_format=safetensors actor_rollout_ref.rollout.layered_summon=True
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.val_before_train=True
'trainer.logger=[console,tensorboard]' trainer.project_name=GRPO
trainer.experiment_name=GRPO-Qwen3-0.6b-gsm8k-fsdp2-one-step-off-2-6 trainer.save_freq=-1 trainer.test_freq=5
trainer.total_epochs=2 trainer.nnodes=1 trainer.n_gpus_per_node=6 rollout.nnodes=1 rollout.n_gpus_per_node=2
"""

ONE_STEP_OFF_DAPO_RIS = """
python3 -m verl.experimental.one_step_off_policy.main_ppo data.train_files={TRAIN} data.val_files={VAL}
data.prompt_key=prompt data.truncation=left data.max_prompt_length=2048 data.max_response_length=28672
data.train_batch_size=512 actor_rollout_ref.rollout.n=16 algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
algorithm.kl_ctrl.kl_coef=0.0 actor_rollout_ref.actor.strategy=fsdp2 critic.strategy=fsdp2
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0
actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.hybrid_engine=False +actor_rollout_ref.model.override_config.max_position_embeddings=32768
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=61440
actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=92160
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=92160 actor_rollout_ref.model.path={MODEL}
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps=10
actor_rollout_ref.actor.optim.weight_decay=0.1 actor_rollout_ref.actor.ppo_mini_batch_size=32
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.grad_clip=1.0
actor_rollout_ref.actor.loss_agg_mode=token-mean actor_rollout_ref.actor.ulysses_sequence_parallel_size=4
actor_rollout_ref.rollout.gpu_memory_utilization=0.80 actor_rollout_ref.rollout.tensor_model_parallel_size=4
actor_rollout_ref.rollout.enable_chunked_prefill=True actor_rollout_ref.rollout.max_num_batched_tokens=30720
actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1
actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.7
actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=True
actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.ref.fsdp_config.param_offload=True actor_rollout_ref.ref.ulysses_sequence_parallel_size=4
actor_rollout_ref.actor.fsdp_config.fsdp_size=8 reward_model.reward_manager=dapo
+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True +reward_model.reward_kwargs.overlong_buffer_cfg.len=4096
+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
+reward_model.reward_kwargs.overlong_buffer_cfg.log=False +reward_model.reward_kwargs.max_resp_len=28672
'trainer.logger=[console,tensorboard]' trainer.project_name=DAPO
trainer.experiment_name=dapo_qwen2-7B-math_28k_fsdp2_one_step_off_64-64-ris trainer.val_before_train=True
trainer.test_freq=10 trainer.save_freq=-1 trainer.total_epochs=10 trainer.total_training_steps=400
trainer.default_local_dir={RUN} trainer.resume_mode=auto trainer.nnodes=8 trainer.n_gpus_per_node=8 rollout.nnodes=8
rollout.n_gpus_per_node=8 algorithm.rollout_correction.rollout_is=null
algorithm.rollout_correction.rollout_is_threshold=null algorithm.rollout_correction.rollout_rs=seq_mean_k1
algorithm.rollout_correction.rollout_rs_threshold=0.999_1.001 algorithm.rollout_correction.bypass_mode=false
"""

FULLY_ASYNC_DAPO = """
python3 -m verl.experimental.fully_async_policy.fully_async_main data.train_files={TRAIN} data.val_files={VAL}
data.prompt_key=prompt data.truncation=left data.max_prompt_length=2048 data.max_response_length=8192
data.train_batch_size=0 data.gen_batch_size=1 data.return_raw_chat=True actor_rollout_ref.rollout.n=16
algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0
actor_rollout_ref.actor.strategy=fsdp2 critic.strategy=fsdp2 actor_rollout_ref.actor.use_kl_loss=False
actor_rollout_ref.actor.kl_loss_coef=0.0 actor_rollout_ref.actor.clip_ratio_low=0.2
actor_rollout_ref.actor.clip_ratio_high=0.28 actor_rollout_ref.actor.clip_ratio_c=10.0
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.hybrid_engine=False
+actor_rollout_ref.model.override_config.max_position_embeddings=32768 actor_rollout_ref.actor.use_dynamic_bsz=True
actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30720
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30720 actor_rollout_ref.model.path={MODEL}
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps=10
actor_rollout_ref.actor.optim.weight_decay=0.1 actor_rollout_ref.actor.ppo_mini_batch_size=32
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.grad_clip=1.0
actor_rollout_ref.actor.loss_agg_mode=token-mean actor_rollout_ref.actor.ulysses_sequence_parallel_size=1
actor_rollout_ref.rollout.gpu_memory_utilization=0.80 actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.enable_chunked_prefill=True actor_rollout_ref.rollout.max_num_batched_tokens=10240
actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1
actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.7
actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=True
actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.ref.fsdp_config.param_offload=True
actor_rollout_ref.ref.ulysses_sequence_parallel_size=1 actor_rollout_ref.actor.fsdp_config.fsdp_size=2
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async
actor_rollout_ref.rollout.calculate_log_probs=True reward_model.reward_manager=dapo
+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True +reward_model.reward_kwargs.overlong_buffer_cfg.len=4096
+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
+reward_model.reward_kwargs.overlong_buffer_cfg.log=False +reward_model.reward_kwargs.max_resp_len=8192
'trainer.logger=[console,tensorboard]' trainer.project_name=DAPO
trainer.experiment_name=DAPO-Qwen2.5-7b-MATH-0527a1-fsdp2-fully-async-8-8 trainer.val_before_train=True
trainer.save_freq=-1 trainer.default_local_dir={RUN} trainer.resume_mode=auto trainer.nnodes=1
trainer.n_gpus_per_node=8 rollout.nnodes=1 rollout.n_gpus_per_node=8 rollout.total_rollout_steps=51200
rollout.total_epochs=10 rollout.test_freq=10 async_training.staleness_threshold=0.1
async_training.trigger_parameter_sync_step=4 async_training.require_batches=4 async_training.partial_rollout=True
async_training.use_rollout_log_probs=True
"""

SFT_QWEN_05_SP2 = """
torchrun --standalone --nnodes=1 --nproc_per_node=2 -m verl.trainer.fsdp_sft_trainer data.train_files={TRAIN}
data.val_files={VAL} data.prompt_key=extra_info data.response_key=extra_info optim.lr=1e-4
"data.prompt_dict_keys=['question']" "+data.response_dict_keys=['answer']" data.micro_batch_size=4
model.partial_pretrain={MODEL} trainer.default_local_dir={RUN} trainer.project_name=gsm8k-sft
trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct-sp2 trainer.logger=console trainer.total_training_steps=1
ulysses_sequence_parallel_size=2 use_remove_padding=true
"""

TRANSLATED = {
    "gemma_ppo": ("examples/ppo_trainer/run_gemma.sh", GEMMA_PPO),
    "mistral_reward_model": ("examples/grpo_trainer/run_mistral13b_skyworkrm_hhrlhf.sh", MISTRAL_REWARD_MODEL),
    "ppo_reward_model_seq_balance": ("examples/ppo_trainer/run_qwen2-7b_rm_seq_balance.sh",
                                     PPO_REWARD_MODEL_SEQ_BALANCE),
    "deepseek_v3_megatron": ("examples/grpo_trainer/run_deepseek671b_math_megatron_80gb.sh", DEEPSEEK_V3_MEGATRON),
    "qwen3_moe_megatron_lora": ("examples/grpo_trainer/run_qwen3moe-30b_megatron_lora.sh", QWEN3_MOE_MEGATRON_LORA),
    "qwen3_8b": ("examples/grpo_trainer/run_qwen3-8b.sh", QWEN3_8B),
    "gspo_qwen3_moe": ("examples/gspo_trainer/run_qwen30b_gspo.sh", GSPO_QWEN3_MOE),
    "dapo_qwen3_moe_fp8_rollout": ("verl-recipe low_precision/run_dapo_qwen3_moe_30b_megatron_fp8e2e.sh",
                                   DAPO_QWEN3_MOE_FP8_ROLLOUT),
    "dapo_qwen3_8b_reward_section": ("verl-recipe dapo/run_dapo_qwen3_8b_base_npu.sh", DAPO_QWEN3_8B_REWARD_SECTION),
    "qwen2_5_vl_lora": ("examples/grpo_trainer/run_qwen2_5_vl-7b_lora.sh", QWEN2_5_VL_LORA),
    "multi_turn_qwen3": ("examples/sglang_multiturn/run_qwen3-4b_gsm8k_multiturn.sh", MULTI_TURN_QWEN3),
    "qwen3_8b_megatron_engine": ("examples/grpo_trainer/run_qwen3_8b_megatron.sh", QWEN3_8B_MEGATRON_ENGINE),
    "qwen3_30b_veomni": ("examples/grpo_trainer/run_qwen3_30b_veomni.sh", QWEN3_30B_VEOMNI),
    "cispo_qwen3_8b": ("examples/cispo_trainer/run_qwen3_8b_fsdp.sh", CISPO_QWEN3_8B),
    "one_step_off_grpo": ("verl/experimental/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_2_6.sh", ONE_STEP_OFF_GRPO),
    "one_step_off_dapo_ris": ("verl/experimental/one_step_off_policy/shell/dapo_7b_math_fsdp2_64_64_ris.sh",
                              ONE_STEP_OFF_DAPO_RIS),
    "fully_async_dapo": ("verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_8_8.sh", FULLY_ASYNC_DAPO),
}
"""name -> (the script it comes from, its words): commands that translate."""

REFUSED = {
    "lora_from_adapter": ("examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora_from_adapter.sh", LORA_FROM_ADAPTER,
                          "actor_rollout_ref.model.lora_adapter_path"),
    "on_policy_distillation": ("examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh", OPD_QWEN3_8B,
                               "distillation.enabled"),
    "sapo_tau_under_policy_loss": ("examples/sapo_trainer/run_qwen3_8b_fsdp.sh", SAPO_QWEN3_8B,
                                   "actor_rollout_ref.actor.policy_loss.tau_pos"),
    "gpt_oss_reasoning_effort": ("examples/grpo_trainer/run_gpt_oss_20b_fsdp.sh", GPT_OSS_20B,
                                 "data.apply_chat_template_kwargs.reasoning_effort"),
    "megatron_lite": ("examples/grpo_trainer/run_qwen3_5_35b_megatron_lite.sh", QWEN3_5_MEGATRON_LITE,
                      "hydra.searchpath"),
    "ascend_npu": ("examples/ascend_extras/grpo_trainer/run_qwen3_next_80b_fsdp.sh", QWEN3_NEXT_80B_NPU,
                   "trainer.device"),
    "model_engine_under_actor": ("examples/router_replay/run_qwen3_30b_a3b_megatron.sh", ROUTER_REPLAY_MEGATRON,
                                 "actor_rollout_ref.actor.model_engine"),
    "sft_trainer": ("examples/sft/gsm8k/run_qwen_05_sp2.sh", SFT_QWEN_05_SP2, "-m verl.trainer.fsdp_sft_trainer"),
}
"""name -> (the script, its words, the key the translation stops at in one line). All but the first two and the last
one are shortened to the words that matter beside the refused one."""
