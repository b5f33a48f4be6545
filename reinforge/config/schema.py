"""The typed configuration schema: the one place where every default lives.

Each section is a dataclass; the docstring under a field says what it does. YAML files and
``a.b=c`` overrides only state what differs (see ``reinforge.config.loader``). The schema's own
cross-field rules live in ``reinforge.config.validate`` (run as a config loads); the rules naming
registry entries, and every other check before a model loads, in ``reinforge.trainer.preflight``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

TRUNCATION_MODES = ("error", "left", "right")
"""The values of data.truncation (RL prompts)."""

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
"""The values of algorithm.filter_groups.metric."""

DECODE_PRODUCTS = ("cublas", "timed")
"""The values of rollout.decode_products: what runs a native decode step's products (see RolloutConfig)."""

DECLARED_ROUTER_AUX_LOSS = "declared"
"""The word value of actor.router_aux_loss_coef and trainer.router_aux_loss_coef (SFT, rm, dpo): the model config's
declared router_aux_loss_coef for any mixture of experts, whatever its output_router_logits says (0 where it declares
none): TRL's rule for its router_aux_loss_coef=None, which reinforge's TRL-style API classes pass."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet or JSONL files, or folders saved with ``datasets.save_to_disk``; rows in verl's schema."""
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    """Column of the prompt: a list of chat messages, or a string (fed as it is unless apply_chat_template=true)."""
    image_key: Optional[str] = None
    """Column of a row's images (a list, or one image); None reads ``images``, else ``image``."""
    min_pixels: Optional[int] = None
    """A vision-language model's image, in pixels, at least: the processor scales a smaller one up (its
    ``size.shortest_edge``, Qwen2-VL's min_pixels). None keeps the model folder's preprocessor_config.json."""
    max_pixels: Optional[int] = None
    """A vision-language model's image, in pixels, at most: the processor scales a larger one down (its
    ``size.longest_edge``, Qwen2-VL's max_pixels; an image's tokens are its pixels over (patch_size * merge_size)^2).
    None keeps the model folder's. Prompts, rollouts, tool images and training all see the image resized so."""
    train_batch_size: int = 8
    """Prompts per step. Each is sampled rollout.n times."""
    val_batch_size: Optional[int] = None
    """Prompts per validation generation call; None takes the whole validation set at once."""
    max_prompt_length: int = 512
    """Prompt tokens after the chat template."""
    max_response_length: int = 256
    """Generated tokens per sample."""
    max_image_tokens: Optional[int] = None
    """A vision-language model's image tokens in one prompt at most (each image's patches over merge_size^2,
    summed: 256 for one 448 x 448 image at Qwen2.5-VL's 14-pixel patches merged 2 x 2). The memory planner counts
    the vision tower's patches from it, and a prompt with more is refused as it loads. None: a run counts the most
    its prompts hold once they are read (``reinforge plan``, which reads no data, every prompt token)."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than max_prompt_length (and report how many) instead of truncating."""
    truncation: str = "error"
    """What to do with an overlong prompt that was not filtered: error, left or right."""
    chat_template: Optional[str] = None
    """A Jinja chat template that overrides the tokenizer's own: its text, or the path of a file holding it (read when
    the config loads)."""
    apply_chat_template: Optional[bool] = None
    """None: chat messages get the chat template and a string prompt is fed as it is (TRL's behaviour); true: a
    string prompt is templated too, as one user message; false: every prompt must be a string, fed as it is."""
    shuffle: bool = True
    """Visit the prompts in a new order each epoch, drawn from (seed, epoch) alone, so a resumed run continues it."""
    seed: int = 1
    """Seed of the data order (reproducible and resumable)."""
    max_train_samples: Optional[int] = None
    """Read only the first this many training rows (a quick run on a large file); None reads all."""
    max_val_samples: Optional[int] = None
    """Read only the first this many validation rows; None reads all."""
    gen_batch_size: Optional[int] = None
    """Prompts per generation batch under algorithm.filter_groups (DAPO's dynamic sampling); None is
    train_batch_size. The data loader hands out batches of this size."""


@dataclass
class LoraConfig:
    rank: int = 0
    """Rank of the actor's LoRA adapters (peft); 0 trains every parameter. With LoRA only the adapters train,
    the reference policy is the same model with its adapters off (no second copy), and checkpoints hold the
    adapters. Small models need rank 32 or more; use about 10x the full fine-tuning actor.optim.lr."""
    alpha: float = 64.0
    """Scale of the adapter's output: W + (alpha / rank) * B A."""
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Names of the linear layers that get an adapter."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0 keeps the update deterministic)."""


@dataclass
class ModelConfig:
    path: str = ""
    """Local folder or hub id of an AutoModelForCausalLM."""
    tokenizer_path: Optional[str] = None
    """Defaults to model.path."""
    dtype: str = "auto"
    """auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16."""
    trust_remote_code: bool = False
    """Let transformers run the Python code of the model's repository (architectures it does not ship); off
    because that code runs with this process's rights."""
    gradient_checkpointing: Union[bool, int, str] = "auto"
    """Recompute activations in the backward: true (every decoder layer), false, a number of layers (the
    first k), or auto (the memory planner checkpoints only as many layers as memory requires)."""
    attn_implementation: str = "sdpa"
    """transformers' attention for SFT's padded forwards (e.g. eager for a model sdpa cannot run). The RL
    workers replace it: packed passes use reinforge's varlen attention and generation sdpa."""
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Learning rate after warmup (the schedule's peak)."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    """AdamW's epsilon, added to the root of the second moment."""
    warmup_steps: int = 0
    """Linear warmup over this many optimizer steps: step k (from 0) runs at (k + 1) / warmup_steps of lr, so the
    first already trains (transformers' and verl's schedules run it at 0, one step behind)."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of all optimizer steps; used when warmup_steps is 0."""
    schedule: str = "constant"
    """constant, cosine, or linear (down to 0 at the last step, transformers' and so TRL's default), after
    warmup."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr."""


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """A name in reinforge.algorithms.POLICY_LOSSES (vanilla, dppo_tv, dppo_kl, gspo, gpg, clip_cov, kl_cov,
    geo_mean, cispo, sapo, dro)."""
    clip_ratio: float = 0.2
    """PPO's clip range of the ratio; for dppo_tv a bound on pi - pi_old, for dppo_kl on the binary KL."""
    clip_ratio_low: Optional[float] = None
    """Defaults to clip_ratio."""
    clip_ratio_high: Optional[float] = None
    """Defaults to clip_ratio; DAPO's clip-higher uses 0.28."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1; .inf: none, as TRL's GRPO without delta); dppo_* truncate the
    ratio there (the DPPO paper suggests a large value, e.g. 20)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: the share of valid tokens whose gradient is detached, drawn from those whose covariance
    (A - mean A)(log pi - mean log pi) lies between clip_cov_lb and clip_cov_ub."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance of a token that may be detached."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of that covariance."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: the share of valid tokens, those of largest covariance, that get the |log ratio| penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: weight of that penalty."""
    tau_pos: float = 1.0
    """SAPO gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """SAPO gate temperature for negative advantages."""
    dro_beta: Optional[float] = None
    """DRO's weight of the quadratic log-ratio penalty; required (> 0) for loss_mode=dro."""


@dataclass
class UpdateConfig:
    """The two settings of a trained model's update that the engine reads (``engine.train_step.UpdateSettings``),
    declared once: the actor's and the critic's sections and the SFT trainer's inherit them, so the keys stay
    in those sections (actor.grad_clip, critic.grad_clip, trainer.grad_clip of an SFT run)."""

    max_tokens_per_micro_batch: Union[int, str] = "auto"
    """Token budget of one forward/backward; micro-batches are formed from it and gradients are accumulated
    over them. auto: the largest budget (up to 65536) that the memory planner fits on the device."""
    grad_clip: float = 1.0
    """Largest norm of the whole gradient (all ranks' shards together); a larger one is scaled down to it. Must be
    positive; a large value such as 1e9 turns clipping off."""


@dataclass
class ActorConfig(UpdateConfig):
    optim: OptimConfig = field(default_factory=OptimConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    loss_scale_factor: Optional[float] = None
    """The constant that seq-mean-token-sum-norm divides each sequence's token sum by; None is
    data.max_response_length."""
    ppo_epochs: int = 1
    """Passes over the batch per training step; past the first the update is off-policy, so the old
    log-probs are computed before it."""
    mini_batch_size: Optional[int] = None
    """Prompts per optimizer step; None is the whole batch (one on-policy step per training step)."""
    logits_buffer_gib: Union[float, str] = "auto"
    """A micro-batch's logits (response tokens x vocabulary) are kept for the backward when they take at
    most this many GiB, which saves recomputing them; larger ones are computed in chunks. 0 always chunks.
    auto: the memory planner's choice (24 GiB when memory allows)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0: none."""
    use_kl_loss: bool = False
    """Add kl_loss_coef x the KL to the reference policy to the loss (GRPO's way); loads the reference model."""
    kl_loss_coef: float = 0.001
    """Weight of that KL term."""
    kl_loss_type: str = "low_var_kl"
    """Its estimator: k1, abs, k2, k3 (reinforge.algorithms.KL_ESTIMATORS) or verl's kl, mse, low_var_kl for k1,
    k2, k3; a trailing + keeps the estimator's value and takes the gradient of k2."""
    router_aux_loss_coef: Optional[Union[float, str]] = None
    """Mixture-of-experts models: weight of the routers' load-balancing loss (transformers' Switch-style aux
    loss over all MoE layers, a shared prompt's tokens counted once per sample as in a padded forward) added to the
    actor's loss; a finite number >= 0, 0: none. None: the model config's router_aux_loss_coef when its
    output_router_logits is true, else 0 (DeepSeek V2/V3 configs never ask for one; set here, theirs counts the
    experts their routers chose, V3's sigmoid scores normalised per token as its probabilities). declared: the model
    config's router_aux_loss_coef whatever its output_router_logits says, as TRL's GRPOTrainer takes it (what
    reinforge.api.GRPOConfig passes for TRL's default). A number above 0 on a model without experts is refused before
    it loads. The loss is logged as actor/moe/aux_loss either way, beside actor/moe/load_imbalance and
    actor/moe/unused_experts."""
    shuffle: bool = False
    """Shuffle samples between mini-batches."""
    freeze_vision_tower: bool = True
    """Vision-language models: keep the vision encoder's weights fixed (the usual choice); false trains it with the
    language model. No effect on text-only models."""
    skip_zero_advantage_backward: bool = True
    """Samples whose every advantage is 0 (a GRPO group whose samples all scored the same) get no gradient
    from a policy loss linear in the advantage: run only their forward (for the metrics) and skip their
    backward, which is about two thirds of their update cost. The update is the same either way (up to
    floating-point order). Applies only where that holds exactly: no KL loss, no entropy bonus, and
    policy_loss.loss_mode one of vanilla, gspo, geo_mean, gpg, cispo, sapo, dppo_tv, dppo_kl."""
    param_offload: Union[bool, str] = "auto"
    """Keep the FSDP-sharded parameters, gradients and optimizer state on the CPU (the step runs there); each
    layer's parameters are copied to the device for its forward and backward. Needs about 16 bytes of host
    memory per parameter, and on a GPU up to twice that for the gradients, which FSDP pins rounded up to a
    power of two each (the weights are pinned at their size; a full 7B model needs about 139 GiB);
    optimizer_offload needs 12. auto: only when the memory planner finds no plan that fits without it."""
    optimizer_offload: Union[bool, str] = "auto"
    """Keep the AdamW moments and a float32 master copy on the CPU, where the step runs (engine.offload), while
    parameters and gradients stay on the device: 12 bytes per parameter leave the device for 12 of host memory.
    Implied by param_offload. auto: only when the memory planner needs the room."""
    keep_gathered: Union[bool, str] = "auto"
    """One device only: the update gathers each layer's parameters (in the compute dtype) once a mini-batch and keeps
    them from the first micro-batch's forward to the last one's backward, and accumulates the gradients unreduced
    (float32) until then, instead of gathering for every forward and backward and reducing after each. Saves those
    copies (about 6% of a 2.6B model's update in 14 micro-batches) for the model's compute-dtype copy in memory.
    auto: when the memory planner finds the room; false with several devices or param_offload."""


@dataclass
class ValSamplingConfig:
    n: int = 1
    """Samples per validation prompt (mean@n, best@n, maj@n)."""
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    """Sample from the most likely tokens whose probabilities add up to top_p; 1.0: all."""
    top_k: int = -1
    """Sample from the k most likely tokens; -1: all."""


@dataclass
class MultiTurnConfig:
    """Multi-turn agent loops (reinforge.agent); used by rows whose agent_name is not single_turn."""

    tool_config_path: Optional[str] = None
    """YAML tool config (a 'tools' list of class_name / config / tool_schema, as verl's); needed by tool_agent rows."""
    format: str = "hermes"
    """Tool-call format the parser reads (a name in reinforge.agent.TOOL_PARSERS: hermes, llama3_json, mistral, deepseek_v3)."""
    max_assistant_turns: Optional[int] = None
    """Stop a trajectory after this many assistant turns; None: no limit but the response budget."""
    max_user_turns: Optional[int] = None
    """Stop a trajectory after this many tool (user) turns; None: no limit."""
    max_parallel_calls: int = 1
    """Tool calls of one assistant turn that run (concurrently); later ones are answered 'not run' and counted."""
    max_tool_response_length: int = 256
    """Tool output is cut to this many tokens (verl counts characters)."""
    tool_response_truncate_side: str = "middle"
    """Which part of an overlong tool output goes: middle (keep both ends), left (keep the end), right (keep the start)."""
    tool_timeout_s: Optional[float] = 300.0
    """A tool's execute that takes longer is answered 'did not answer within N s' (reward 0) and counted as a tool
    error, and the trajectory goes on; None: wait for ever. A plain function tool runs in a thread of its own, which
    is left behind. Tools whose every call raises or times out for ``TOOL_FAILURE_STEPS`` steps in a row stop the run."""
    openai_agents: dict[str, str] = field(default_factory=dict)
    """agent_name -> an agent written against the OpenAI API, trained through an endpoint on the rollout engine
    (reinforge.serve, docs/openai_agents.md): 'file.py:function' or 'package.module.function' (an async
    agent(base_url, row) returning a reward or a final answer), or 'cmd:COMMAND ARGS' (run with OPENAI_BASE_URL set)."""
    openai_agent_timeout_s: Optional[float] = None
    """Wall-clock budget of one openai_agents trajectory; past it the trajectory ends with the calls made. None: none."""


@dataclass
class RolloutConfig:
    name: str = "hf"
    """Engine backend: hf (transformers generate) or native."""
    n: int = 8
    """Samples per prompt. Group estimators (grpo, rloo, ...) need n >= 2."""
    temperature: float = 1.0
    """Sampling temperature; the actor scores its tokens (old, reference and current log-probs) at the same one.
    0 is greedy (with n = 1)."""
    top_p: float = 1.0
    """Sample from the most likely tokens whose probabilities add up to top_p; 1.0: all."""
    top_k: int = -1
    """Sample from the k most likely tokens; -1: all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p x the most likely one; 0: none."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop tokens; the tokenizer's EOS always stops."""
    gpu_memory_utilization: Optional[float] = None
    """Native engine: size the KV cache so the process holds at most this fraction of the device's memory
    (verl's key). None lets the memory planner size it (rollout.kv_cache_gib)."""
    kv_cache_gib: Union[float, str] = "auto"
    """Native engine: KV cache size in GiB. auto: room for every sequence of a step at full length, or
    less when memory is short (the memory planner)."""
    free_cache_engine: Union[bool, str] = "auto"
    """Native engine: free its KV cache, weight copy and CUDA graphs after each rollout, for the update.
    false keeps them (the update has that much less memory; the next rollout captures no graphs).
    auto: keep them when the memory planner finds room (faster)."""
    enable_prefix_caching: bool = True
    """Native engine: keep finished sequences' full KV blocks while awake, so a request starting with the same
    tokens (a multi-turn trajectory's next turn) prefills only the rest (verl's key). Dropped at every weight change."""
    max_prefill_chunk_tokens: Optional[int] = None
    """Native engine: the most new tokens one prefill forward runs. A longer prefill (a long prompt, or a preempted
    long sample recomputed) runs in chunks, each attending to the ones before through the KV cache, so its
    activation memory stays bounded. None: 16384, the prefill step size the engine reserves memory for."""
    kv_cache_dtype: str = "auto"
    """Native engine: auto (or bf16, for a bfloat16 model) keeps the KV cache in the model dtype; fp8 (or fp8_e4m3)
    stores e4m3 keys and values with a float32 scale per token and KV head (about twice the tokens in the same memory
    and half the bytes read per decode step, though on an H200 its decode is slower than bf16's; at some log-prob
    mismatch against the trainer: see docs/long_responses.md). Not for MLA models."""
    shared_prefix_decode: bool = False
    """Native engine on a GPU: true: a decode step reads the cache blocks several sequences share (the prompt's whole
    blocks of its n samples) once for all of them, and each sample's attention goes on over its own blocks; false (the
    default): each sample reads them itself. The unsplit decode kernel only (a batch that splits long contexts reads
    them apart). On an H200 at the standard workload it made the decode between 4% shorter and 1% longer
    (docs/long_responses.md)."""
    decode_products: str = "cublas"
    """Native engine on a GPU: what runs a decode step's q|k|v, o and MLP products (up to 256 sequences). cublas:
    torch's products. timed: at each decode batch size's first step the engine times swapped Triton kernels
    (``rollout/native/dense_kernels.py``) against cuBLAS for each product and keeps the faster; a kernel that fails
    or disagrees is dropped in one line. Prefill keeps cuBLAS."""
    segment_tokens: Optional[int] = None
    """trainer.mode=async: generate in segments of this many tokens (a divisor of data.max_response_length);
    a weight sync lands between segments, where unfinished samples are interrupted and resumed under the new
    weights (partial rollouts). None generates each sample whole, under one version."""
    val_kwargs: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class RefConfig:
    max_tokens_per_micro_batch: Optional[int] = None
    """Defaults to actor.max_tokens_per_micro_batch."""
    param_offload: Union[bool, str] = "auto"
    """Keep the reference weights on the CPU and copy each layer's to the device for its forward.
    auto: only when the memory planner needs the room."""


@dataclass
class CriticConfig(UpdateConfig):
    enable: Optional[bool] = None
    """None enables the critic exactly when algorithm.adv_estimator is gae. true beside an estimator that reads no
    values (grpo, rloo, ...) trains the critic as verl does, for its critic/* metrics alone (a warning at start)."""
    model_path: Optional[str] = None
    """Defaults to model.path (a value head is added). The critic reads the policy's token ids, so its model must
    share the policy's tokenizer (a run refuses another before any model loads)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    cliprange_value: float = 0.5
    """PPO's value clipping: the loss takes the larger error of the new value and of the new value clipped to
    within this of the value before the update."""
    loss_agg_mode: str = "token-mean"
    """How the value loss is reduced (the modes of actor.loss_agg_mode)."""
    loss_scale_factor: Optional[float] = None
    """seq-mean-token-sum-norm's constant for the value loss; None is actor.loss_scale_factor (then
    data.max_response_length)."""
    ppo_epochs: Optional[int] = None
    """Defaults to actor.ppo_epochs."""
    max_tokens_per_micro_batch: Optional[int] = None
    """None: actor.max_tokens_per_micro_batch (UpdateConfig has the setting)."""
    warmup_steps: int = 0
    """Steps that train only the critic before the actor starts updating."""
    param_offload: bool = False
    """Keep the FSDP-sharded parameters, gradients and optimizer state on the CPU (the step runs there)."""
    optimizer_offload: bool = False
    """Keep the AdamW moments and a float32 master copy on the CPU, where the step runs (as actor.optimizer_offload)."""


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's soft overlong punishment: add min(-(L - (max_len - len)) / len * penalty_factor, 0) to the
    score of a response of L tokens (max_len = data.max_response_length)."""
    len: int = 0
    """The buffer: the penalty grows linearly over the last this many tokens of data.max_response_length."""
    penalty_factor: float = 1.0
    """The penalty of a response that fills data.max_response_length."""


COMBINE_MODES = ("replace", "sum", "gate")
"""The values of reward.combine.mode."""


@dataclass
class RewardModelConfig:
    """A sequence- or token-classification model (num_labels=1) scoring each response at its last token (verl's
    reward_model); its worker shares the devices with the actor and keeps its weights on the host between calls."""

    enable: bool = False
    """Score the responses with the model at model_path (reward.combine says how its score meets the rule's)."""
    model_path: Optional[str] = None
    """Folder or hub id of an AutoModelForSequenceClassification or AutoModelForTokenClassification with num_labels=1
    (a folder written by ``reinforge rm`` is one)."""
    input_tokenizer: Optional[str] = "auto"
    """The tokenizer the policy's responses are decoded with when the reward model's tokenizer or chat template
    differs from it: the response is re-rendered in the reward model's chat template. auto: the policy's
    (model.tokenizer_path or model.path); null: never re-render, the reward model reads the policy's token ids."""
    max_length: Optional[int] = None
    """Tokens the reward model reads per sample (prompt and response); longer inputs are cut on the right and
    counted in reward_model/truncated. None: data.max_prompt_length + data.max_response_length, and the tokens the
    chat template writes after a turn the response ended (ChatML's newline)."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Token budget of one scoring forward (packed, no padding); None: actor.max_tokens_per_micro_batch."""
    offload: bool = True
    """Keep the weights on the host between scoring calls (they are copied to the device for each call), so the
    rollout and the update have the device without them; false keeps them on the device."""
    trust_remote_code: bool = False
    """Let transformers run the Python code of the reward model's repository."""
    enable_resource_pool: bool = False
    """trainer.backend=ray: run the reward model on a pool of its own (nnodes x n_gpus_per_node devices) instead of
    the actor's devices."""
    n_gpus_per_node: int = 1
    """Devices per node of the reward model's own pool (with enable_resource_pool)."""
    nnodes: int = 1
    """Nodes of the reward model's own pool (with enable_resource_pool)."""


@dataclass
class RewardCombineConfig:
    """How the reward model's score and the rule-based score make the training score."""

    mode: str = "replace"
    """replace: the reward model's score alone (verl's behaviour; the rule-based scorer is not run in training);
    sum: rm_weight x the reward model's score + rule_weight x the rule's; gate: the reward model's score where the
    rule's score exceeds gate_threshold, else the rule's score. Validation scores with the rule-based scorer (the
    task's accuracy) in every mode."""
    rm_weight: float = 1.0
    """sum: weight of the reward model's score."""
    rule_weight: float = 1.0
    """sum: weight of the rule-based score."""
    gate_threshold: float = 0.0
    """gate: a sample passes when its rule-based score is above this (the built-in scorers give 1 for a correct
    answer and 0 otherwise)."""


JUDGE_PARSE_RULES = ("marker", "boxed", "yes_no")
"""The values of reward.judge.parse (``reward/judge.py`` reads them)."""
REMOTE_PROTOCOLS = ("openrlhf", "json")
"""The values of reward.remote.protocol (``reward/remote.py`` speaks them)."""


@dataclass
class JudgeConfig:
    """An LLM as judge (verl's generative reward model): a causal LM reads a prompt built from ``template`` and its
    answer becomes the sample's score (``reward/judge.py``). reward.combine says how it meets the rule's score."""

    enable: bool = False
    """Score the responses with the judge."""
    model_path: Optional[str] = None
    """Folder or hub id of the judge, a causal LM served by the rollout engine in the trainer's process; ``policy``:
    the policy itself, as it is at each step."""
    template: Optional[str] = None
    """The judge's prompt, with {prompt} (the problem: the row's user turns), {response} and {ground_truth}; or the
    path of a file holding it. A literal brace is written {{ or }}."""
    chat_template: bool = True
    """Render the prompt as the user turn of the judge's chat template (with the generation prompt)."""
    parse: str = "marker"
    """marker: the number after the last ``marker``; boxed: the number in the last \\boxed{}; yes_no: no text is
    generated, the score is p(yes_token) / (p(yes_token) + p(no_token)) as the judge's first token."""
    marker: str = "Score:"
    """parse=marker: the text the score follows."""
    yes_token: str = "Yes"
    """parse=yes_no: the answer that scores 1 (one token of the judge's vocabulary)."""
    no_token: str = "No"
    """parse=yes_no: the answer that scores 0 (one token of the judge's vocabulary)."""
    scale: float = 1.0
    """The parsed number is divided by this (10 for a judge asked for 0-10)."""
    max_tokens: int = 256
    """Tokens the judge may write (marker and boxed)."""
    temperature: float = 0.0
    """The judge's sampling temperature (0: greedy, the same judgement for the same input)."""
    max_prompt_length: int = 2048
    """Tokens of the judge's prompt; a longer one keeps its last tokens (where the judge is asked; its start, with
    the beginning of the problem, is cut) and is counted in reward/judge/prompts_cut."""
    timeout_s: float = 600.0
    """Seconds the judging of one batch may take; past it every sample of the batch gets fallback_score (counted in
    reward/judge/timeouts), and three such steps in a row stop the run (as does the end of a run whose every judge
    call timed out)."""
    fallback_score: float = 0.0
    """Score of a sample whose judgement could not be read (counted in reward/judge/malformed) or timed out."""
    trust_remote_code: bool = False
    """Let transformers run the Python code of the judge's repository."""


@dataclass
class RemoteRewardConfig:
    """A reward from a user's HTTP endpoint (``reward/remote.py``); reward.combine says how it meets the rule's."""

    enable: bool = False
    """POST the samples to url and take its scores."""
    url: Optional[str] = None
    """The endpoint, e.g. http://host:5000/get_reward; several, comma-separated, share the requests in turn."""
    protocol: str = "openrlhf"
    """openrlhf: OpenRLHF's /get_reward ({"query", "prompts", "labels"} -> {"scores"} or {"rewards"}); json:
    {"samples": [{"prompt", "response", "ground_truth", "data_source", "extra_info"}]} -> {"scores"}."""
    batch_size: int = 32
    """Samples per request."""
    max_concurrency: int = 8
    """Requests in flight at once, over all URLs."""
    timeout_s: float = 180.0
    """Seconds one request may take in all: to connect, send, and read the whole answer (a server that trickles its
    answer is cut off there too). A request past it is retried as a timeout."""
    max_retries: int = 5
    """Retries of a request after a connection error, a timeout or a 408/429/5xx answer (exponential backoff,
    Retry-After honoured); then its samples get fallback_score (counted in reward/remote/failed)."""
    fallback_score: float = 0.0
    """Score of a sample whose request failed for good."""
    api_key_env: Optional[str] = None
    """The name of an environment variable whose value every request sends as ``Authorization: Bearer <value>`` (the
    key stays in the environment, out of the run folder's config); None: no Authorization header."""


@dataclass
class RewardConfig:
    custom_function: Optional[str] = None
    """path/to/file.py:function, called for every sample instead of the built-in scorer."""
    functions: list[str] = field(default_factory=list)
    """Several reward functions, path/to/file.py:function each, scoring every sample together (TRL's list of
    reward_funcs): the total is their reward.weights-weighted sum. Set this or custom_function, not both."""
    weights: Optional[list[float]] = None
    """One weight per reward function (TRL's reward_weights), in their order; the total is the weighted sum
    over the functions that apply (a function returning None for a sample is left out). None: each weighs 1."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the scorer."""
    fallback_score: float = 0.0
    """Score of a sample whose scorer raised or timed out."""
    timeout_s: float = 10.0
    """Seconds a scorer may take on one sample; a slower one gets fallback_score (and is counted)."""
    num_workers: int = 4
    """Scoring processes; 0 scores in this process."""
    max_memory_mb: Optional[int] = 4096
    """Heap cap of each scoring process (RLIMIT_DATA); a scorer that allocates past it gets fallback_score
    (counted in reward/memory_exceeded) and its process is replaced. Built-in scorers use under 100 MB, so
    4096 stops only a leak, and bounds the scorers at num_workers x 4 GiB; null: no cap. Not applied when
    num_workers=0."""
    max_abs_score: float = 1e6
    """A score whose magnitude exceeds this is warned about once (a scorer on the wrong scale)."""
    retool_wrong_answer: bool = False
    """ReTool's shaping for tool use: a wrong answer (acc false, or a score <= 0 without acc) scores
    min(-0.6, -1 + 0.05 * (num_turns - 2)), so each tool call (two turns) adds 0.1 up to -0.6."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    combine: RewardCombineConfig = field(default_factory=RewardCombineConfig)


@dataclass
class KLControlConfig:
    type: str = "fixed"
    """fixed or adaptive."""
    kl_coef: float = 0.001
    """Weight of the KL-in-reward penalty (fixed), or its start (adaptive)."""
    target_kl: float = 0.1
    """adaptive: the KL the coefficient steers towards."""
    horizon: int = 10000
    """adaptive: each step multiplies the coefficient by 1 + clip(kl / target_kl - 1, +-0.2) x samples / horizon."""


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Optional[str] = None
    """None, token or sequence: importance weights pi_train / pi_rollout per token, or their product per row."""
    rollout_is_threshold: str = "2.0"
    """One number truncates the weights above it (TIS); "lo_hi" (e.g. "0.5_5.0") sets weights outside
    [lo, hi] to 0 (IcePop). A number in YAML or on the command line is read as its text."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their batch mean (over valid tokens, or over sequences at sequence level)."""
    rollout_rs: Optional[str] = None
    """Comma list of rejection rules (token_k1, seq_mean_k3, ...); None disables."""
    rollout_rs_threshold: str = "2.0"
    """One threshold for every rule, or one per rule in rollout_rs's order ("0.3,0.8_1.25"). k1 rules bound
    pi_rollout / pi_train: "hi" keeps [1/hi, hi], "lo_hi" keeps [lo, hi]; k2 and k3 rules take an upper bound."""
    bypass_mode: bool = False
    """Use the rollout log-probs as old log-probs (skip the recomputation); the correction then runs inside
    the loss, with the current log-probs (see loss_type)."""
    loss_type: str = "ppo_clip"
    """Loss of bypass mode: ppo_clip (PPO's clip of pi / pi_rollout, no extra weights; actor.policy_loss.loss_mode
    must be vanilla) or reinforce (-w A log pi with w the rollout_is weights, 1 when rollout_is is null)."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO's dynamic sampling: keep only prompt groups whose metric varies across their samples, generating
    batches of data.gen_batch_size prompts until data.train_batch_size groups are kept."""
    metric: str = "acc"
    """acc (the scorer's acc extra; where a sample has none, its score, as verl's DAPO reward manager records
    acc = score for a scorer returning a float), score (the scorer's score), seq_reward (score plus overlong
    shaping) or seq_final_reward (seq_reward minus the in-reward KL penalty)."""
    max_num_gen_batches: int = 10
    """Generation batches one step may use before it fails; 0 means no limit."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """A name in reinforge.algorithms.ADVANTAGE_ESTIMATORS."""
    gamma: float = 1.0
    """Discount factor of GAE and of the REINFORCE++ returns."""
    lam: float = 1.0
    """GAE's lambda: 1 is the Monte Carlo return minus the value, 0 the one-step TD error."""
    norm_adv_by_std: bool = True
    """GRPO divides by the group std; False gives Dr. GRPO."""
    grpo_epsilon: float = 1e-6
    """Added to the group std before dividing (grpo, grpo_passk, gdpo)."""
    gdpo_reward_keys: list[str] = field(default_factory=list)
    """gdpo: the scorer's extra outputs (its returned dict's keys) normalised one by one, e.g. [format, acc]."""
    gdpo_reward_weights: Optional[list[float]] = None
    """gdpo: one weight per key of gdpo_reward_keys; None weighs them all 1."""
    use_kl_in_reward: bool = False
    """Subtract the kl_ctrl coefficient x the KL to the reference policy from each token's reward (PPO's way);
    loads the reference model."""
    kl_penalty: str = "kl"
    """KL estimator of the in-reward penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class RunConfig:
    """What every run (RL or SFT) is told about its folder, length, cadence and logging."""

    output_dir: str = "runs/default"
    """The run folder: resolved config, metrics.jsonl, checkpoints, samples, plots."""
    total_epochs: int = 1
    """Passes over the training data when total_steps is unset."""
    total_steps: Optional[int] = None
    """Steps to run (epochs repeat as needed); None runs total_epochs over the data."""
    seed: int = 1
    """Seed of the run: initial weights' random parts (a value head), sampling and mini-batch shuffling."""
    device: str = "auto"
    """auto (cuda when available), cuda or cpu."""
    test_every: int = 0
    """Validate every this many steps (and at the end); 0 validates only before and after."""
    save_every: int = 0
    """Checkpoint every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int = 2
    """Checkpoints to keep."""
    resume: str = "auto"
    """auto (latest checkpoint in output_dir), never, or a checkpoint path."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "plots"])
    """Any of console, jsonl, plots (PNG charts in RUN/plots when the run ends), tensorboard, wandb, mlflow;
    RUN/metrics.jsonl is written whatever the list says."""
    project_name: str = "reinforge"
    """Project of the run in W&B and MLflow."""
    experiment_name: str = "default"
    """Name of the run in W&B and MLflow."""
    val_before_train: bool = True
    """Validate the starting model before the first step (the 'before' of a before/after comparison), when the
    run has validation data."""


@dataclass
class TrainerConfig(RunConfig):
    backend: str = "local"
    """local (workers in this process, one device) or ray (one process per device; see docs/ray.md)."""
    nnodes: int = 1
    """Machines of the run (ray backend): every role is placed on nnodes x devices_per_node devices."""
    devices_per_node: int = 1
    """GPUs per machine (CPU slots with trainer.device=cpu) used by the run; one worker process each."""
    ray_address: Optional[str] = None
    """Ray cluster to join (e.g. 10.0.0.1:6379); None uses RAY_ADDRESS, or starts a local Ray instance."""
    num_logged_samples: int = 4
    """Generations written to samples.jsonl per step."""
    call_timeout_s: float = 3600.0
    """Deadline of one worker-group call."""
    gpu_memory_gib: Optional[float] = None
    """Plan for, and cap each process at, this much device memory (e.g. 80 or 40 to stand in for smaller
    cards); None uses the whole device."""
    host_memory_gib: Optional[float] = None
    """Plan for this much host memory; None reads what the machine has available."""
    mode: str = "sync"
    """sync (generate, then train, every step), one_step_off (batch k+1 is generated with the weights before
    update k, overlapping it) or async (a rollouter streams samples under a staleness bound; docs/internals.md)."""
    max_staleness: float = 1
    """async: how many weight versions the rollouter may run ahead of the trainer (a fraction too: 0.5 lets half a
    version's groups start under the weights before). A prompt group is admitted only while admitted groups <
    (version + 1) x G + floor(max_staleness x G), G = trigger_sync_steps x data.train_batch_size."""
    trigger_sync_steps: int = 1
    """async: updates between weight syncs to the rollouter (each update takes data.train_batch_size groups)."""
    max_in_flight_groups: Optional[int] = None
    """async: the most prompt groups admitted and not yet taken by the trainer (generating, or finished and waiting),
    rollout.n samples each, whatever max_staleness allows. None: G + floor(min(max_staleness, 2) x G), the staleness
    bound's own up to max_staleness=2, so a larger max_staleness does not let the rollouter hold ever more samples.
    At least data.train_batch_size; with async_deterministic at least G, as it counts the groups of the updates before
    its version as taken (its admissions then do not depend on the trainer's timing)."""
    async_deterministic: bool = False
    """async: the weight syncs happen at fixed points of the rollouter's work, so two runs with the same seed
    train on the same groups with the same weight versions, to the same metrics and weights (a killed and
    resumed run too). The rollouter waits at each such point: once the groups of the updates before the sync
    are ready (with separate_rollout, once the next update's are too). false: it runs as fast as it can, and
    with max_staleness >= 1 which weights sample which tokens depends on timing, so runs differ slightly;
    max_staleness=0 is reproducible either way."""
    separate_rollout: bool = False
    """one_step_off/async: generate on a second worker group (role rollout, the model without optimizer)
    instead of the training worker, so generation overlaps the update: on the local backend on its own thread
    (the two share the device), on Ray on the pool a placement gives role rollout. Weights are copied from the
    actor at each sync. false: the training worker generates from its rollout copy (they take turns)."""
    proximal: str = "recompute"
    """one_step_off/async, on a batch with stale tokens: the proximal policy of the decoupled PPO loss is
    recompute (log-probs under the weights before the update, one extra forward) or loglinear (interpolated
    per token between the behaviour and the current policy by versions, no forward)."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
