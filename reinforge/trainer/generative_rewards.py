"""Scores from a judge model or a remote endpoint, as the trainer asks for them each step.

``JudgeScorer`` drives a judge through the two calls every judge answers (``workers/judge.py``): the
judge worker's, or the actor's when the policy judges itself. It builds the judge's prompts, calls
``generate`` (or ``compute_log_prob`` for ``parse=yes_no``) with the deadline ``reward.judge.timeout_s``,
and reads the answers (``reward/judge.py``). ``RemoteScorer`` posts the samples to ``reward.remote.url``
(``reward/remote.py``). Each returns one score per sample and its ``reward/judge/*`` or
``reward/remote/*`` metrics; ``RLTrainer.score`` meets them with the rule's score (``reward.combine``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import Tensor

from reinforge.config import Config
from reinforge.config.validate import policy_judge_sequence
from reinforge.controller import WorkerGroup, WorkerTimeoutError
from reinforge.models import load_tokenizer
from reinforge.protocol import Batch
from reinforge.reward.judge import (
    Judgements,
    answer_token_id,
    check_template,
    judge_prompts,
    read_template,
    scores_from_texts,
    unreadable,
    yes_no_batch,
    yes_no_scores,
)
from reinforge.reward.remote import RemoteReward, RemoteSample, authorization_headers
from reinforge.workers.judge import judge_sampling

logger = logging.getLogger(__name__)


MAX_TIMEOUTS_IN_A_ROW = 3
"""Steps in a row of a judge timing out on every sample after which the run stops (each scored only fallbacks)."""


class JudgeScorer:
    name = "judge"

    def __init__(self, config: Config, judge: WorkerGroup, policy_tokenizer: Any):
        self.settings = settings = config.reward.judge
        self.judge, self.policy_tokenizer = judge, policy_tokenizer
        self.template = read_template(settings.template)
        check_template(self.template, "reward.judge.template")
        self.tokenizer = (policy_tokenizer if settings.model_path == "policy"
                          else load_tokenizer(settings.model_path, trust_remote_code=settings.trust_remote_code))
        self.sampling = judge_sampling(config)
        self.max_prompt_length = judge_prompt_length(config)
        self.temperature = config.rollout.temperature
        """compute_log_prob divides the logits by the rollout temperature (the judge worker's and the actor's)."""
        self.seed = config.trainer.seed
        self.timeouts_in_a_row = 0
        """Steps in a row whose judging ran out of reward.judge.timeout_s on every sample."""
        self.answered = False
        """Whether any judge call of the run answered (until then, timeouts_in_a_row counts every call)."""
        self.yes_no = None
        if settings.parse == "yes_no":
            self.yes_no = (answer_token_id(self.tokenizer, settings.yes_token, "reward.judge.yes_token"),
                           answer_token_id(self.tokenizer, settings.no_token, "reward.judge.no_token"))

    def __call__(self, batch: Batch, step: int) -> tuple[Tensor, dict[str, float]]:
        settings = self.settings
        start = time.perf_counter()
        prompts, cut = judge_prompts(batch, self.policy_tokenizer, self.tokenizer, self.template,
                                     settings.chat_template, self.max_prompt_length)
        try:
            if self.yes_no is not None:
                scored = self.judge.compute_log_prob.with_timeout(settings.timeout_s)(yes_no_batch(prompts, *self.yes_no))
                judgements = Judgements(yes_no_scores(scored["old_log_probs"], self.temperature), 0)
            else:
                answers = self.judge.generate.with_timeout(settings.timeout_s)(prompts, self.sampling, self.seed + step)
                texts = [self.tokenizer.decode(answers["responses"][row][answers["response_mask"][row].bool()].tolist(),
                                               skip_special_tokens=True) for row in range(len(answers))]
                judgements = scores_from_texts(texts, settings.parse, settings.marker, settings.scale,
                                               settings.fallback_score)
                problem = unreadable(judgements, texts, settings.parse, settings.marker)
                if problem is not None:
                    raise RuntimeError(problem)
        except WorkerTimeoutError:
            self.timeouts_in_a_row += 1
            if self.timeouts_in_a_row >= MAX_TIMEOUTS_IN_A_ROW:  # every score a fallback: nothing left to learn from
                raise RuntimeError(f"the judge took more than reward.judge.timeout_s={settings.timeout_s:g}s on every "
                                   f"sample of {self.timeouts_in_a_row} steps in a row, so each scored the fallback "
                                   f"{settings.fallback_score:g}; raise reward.judge.timeout_s or make the judge "
                                   "faster (a smaller judge, a shorter reward.judge.max_tokens)") from None
            logger.warning("the judge took more than reward.judge.timeout_s=%gs on %d samples; they score %g "
                           "(reward/judge/timeouts)", settings.timeout_s, len(batch), settings.fallback_score)
            judgements = Judgements([settings.fallback_score] * len(batch), 0, timed_out=len(batch))
        else:
            self.timeouts_in_a_row = 0
            self.answered = True
        if judgements.malformed:
            logger.warning("%d of %d judgements had no score the rule parse=%s reads; they score %g "
                           "(reward/judge/malformed)", judgements.malformed, len(batch), settings.parse,
                           settings.fallback_score)
        metrics = judgements.metrics(time.perf_counter() - start) | {"reward/judge/prompts_cut": float(cut)}
        return torch.tensor(judgements.scores, dtype=torch.float32), metrics


    def check_the_run_was_judged(self) -> None:
        """One line at the end of a run whose every judge call timed out (fewer than ``MAX_TIMEOUTS_IN_A_ROW``, which
        stop it earlier): every sample scored the fallback, so the run learned nothing from its rewards."""
        if self.timeouts_in_a_row and not self.answered:
            settings = self.settings
            raise RuntimeError(f"the judge timed out on every sample of each of the run's {self.timeouts_in_a_row} "
                               f"judge calls (reward.judge.timeout_s={settings.timeout_s:g}s), so every sample scored "
                               f"the fallback {settings.fallback_score:g} and the run learned nothing from its rewards; "
                               "raise reward.judge.timeout_s or make the judge faster (a smaller judge, a shorter "
                               "reward.judge.max_tokens)")


def judge_prompt_length(config: Config) -> int:
    """The tokens a judge prompt keeps: reward.judge.max_prompt_length, or where the policy judges itself on the native
    engine, whose sequences hold data.max_prompt_length + data.max_response_length tokens and which refuses a longer
    prompt, what leaves reward.judge.max_tokens of them for the answer (one warning line)."""
    settings, sequence = config.reward.judge, policy_judge_sequence(config)
    if sequence is None:
        return settings.max_prompt_length
    room = sequence - settings.max_tokens
    if room >= settings.max_prompt_length:
        return settings.max_prompt_length
    logger.warning("reward.judge.max_prompt_length=%d is cut to %d tokens: the policy judges itself on its native "
                   "engine, whose sequences hold data.max_prompt_length + data.max_response_length = %d tokens, "
                   "reward.judge.max_tokens=%d of them for the answer; a longer judge prompt keeps its last tokens "
                   "(reward/judge/prompts_cut)", settings.max_prompt_length, room, sequence, settings.max_tokens)
    return room


class RemoteScorer:
    name = "remote"

    def __init__(self, config: Config, policy_tokenizer: Any):
        settings = config.reward.remote
        self.tokenizer = policy_tokenizer
        self.client = RemoteReward(settings.url, protocol=settings.protocol, batch_size=settings.batch_size,
                                   max_concurrency=settings.max_concurrency, timeout_s=settings.timeout_s,
                                   max_retries=settings.max_retries, fallback_score=settings.fallback_score,
                                   headers=authorization_headers(settings.api_key_env))

    def samples(self, batch: Batch) -> list[RemoteSample]:
        """Prompt and response texts, special tokens kept (OpenRLHF decodes its queries so), and the row's columns."""
        width = batch["prompts"].shape[1]
        columns = batch.non_tensors
        samples = []
        for row in range(len(batch)):
            mask = batch["attention_mask"][row].bool()
            prompt = self.tokenizer.decode(batch["input_ids"][row, :width][mask[:width]].tolist())
            response = self.tokenizer.decode(batch["input_ids"][row, width:][mask[width:]].tolist())
            samples.append(RemoteSample(
                prompt, response, columns["ground_truth"][row] if "ground_truth" in columns else None,
                columns["data_source"][row] if "data_source" in columns else None,
                dict(columns["extra_info"][row] or {}) if "extra_info" in columns else {}))
        return samples

    def __call__(self, batch: Batch, step: int) -> tuple[Tensor, dict[str, float]]:
        start = time.perf_counter()
        result = self.client.score(self.samples(batch))
        if result.failed:
            logger.warning("%d of %d samples got no score from %s; they score the fallback (reward/remote/failed)",
                           result.failed, len(batch), ",".join(self.client.urls))
        return torch.tensor(result.scores, dtype=torch.float32), result.metrics(time.perf_counter() - start)

    def close(self) -> None:
        self.client.close()
