"""The judge worker: a second causal LM that reads each sample and answers with a score (``reward.judge``).

A role like the reward model: frozen, in the compute dtype, on the actor's devices, its generation
served by the rollout engine (``rollout.name``; the native engine where it runs the model) in this
process. It answers the two calls the trainer makes of a judge, the same two the actor answers when
the policy judges itself (``reward.judge.model_path=policy``):

- ``generate(batch, sampling, seed)``: the judgement text of each judge prompt (``parse`` marker, boxed);
- ``compute_log_prob(batch)``: log-probs of given answers (``parse=yes_no``: the yes and the no token).

The prompts are built and the answers read by the trainer (``reward.judge``'s functions), so both
judges are driven by one piece of code. With the native engine the KV cache is freed between calls
and the weights live in the engine's own copy while it is awake.
"""

from __future__ import annotations

import dataclasses
import logging

from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.engine.device import compute_dtype, resolve_device
from reinforge.engine.forward import ScoringPass, response_log_probs
from reinforge.engine.fused import prepare_for_training
from reinforge.models import load_causal_lm, load_tokenizer
from reinforge.protocol import Batch
from reinforge.rollout.base import SamplingParams
from reinforge.workers.memory_settings import apply_memory_plan
from reinforge.workers.rollout_side import RolloutSide

logger = logging.getLogger(__name__)


def judge_config(config: Config) -> Config:
    """The run's config as the judge's rollout engine reads it: its prompt and answer lengths, one sample per prompt,
    no agent loops, the prefix cache on (every judge prompt begins alike)."""
    judge = config.reward.judge
    data = dataclasses.replace(config.data, max_prompt_length=judge.max_prompt_length,
                               max_response_length=judge.max_tokens, chat_template=None)
    multi_turn = dataclasses.replace(config.rollout.multi_turn, tool_config_path=None)
    rollout = dataclasses.replace(config.rollout, n=1, stop_token_ids=[], multi_turn=multi_turn,
                                  enable_prefix_caching=True, free_cache_engine=True)
    return dataclasses.replace(config, data=data, rollout=rollout)


class JudgeWorker(Worker):
    def __init__(self, config: Config):
        super().__init__()
        apply_memory_plan(config)  # a no-op when the trainer or this process planned already
        settings = config.reward.judge
        self.config = judge_config(config)
        self.device = resolve_device(config.trainer.device)
        self.tokenizer = load_tokenizer(settings.model_path, trust_remote_code=settings.trust_remote_code)
        self.model = load_causal_lm(settings.model_path, dtype=compute_dtype(self.device, config.model.dtype),
                                    device=self.device, trust_remote_code=settings.trust_remote_code)
        self.model.eval().requires_grad_(False)
        self.rollout = RolloutSide.on_rollout_copy(self.config, self.device, self.tokenizer, self.model)
        prepare_for_training(self.model, self.device)  # varlen attention for compute_log_prob's packed rows
        self.max_tokens = int(config.actor.max_tokens_per_micro_batch)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate(self, batch: Batch, sampling: SamplingParams, seed: int = 0) -> Batch:
        """The judge's answer to each prompt row (responses, response_mask, ...), as the actor's generate."""
        return self.rollout.generate(batch, sampling, seed)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """old_log_probs (B, R): the judge's log-probs of the given responses, at the rollout temperature."""
        with ScoringPass(self.model, batch, self.max_tokens, self.device) as scoring:
            for micro in scoring:
                scoring.add(response_log_probs(self.model, micro, self.config.rollout.temperature)[0])
        (log_probs,) = scoring.outputs()
        return Batch.from_dict(tensors={"old_log_probs": log_probs})


def judge_sampling(config: Config) -> SamplingParams:
    judge = config.reward.judge
    return SamplingParams(max_tokens=judge.max_tokens, temperature=judge.temperature, n=1)

