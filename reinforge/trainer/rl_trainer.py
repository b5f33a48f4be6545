"""The RL trainer: the loop of DESIGN.md on worker groups, plus validation, metrics and checkpoints.

``train_step`` reads like the algorithm: generate n samples per prompt, score them, compute
old/reference log-probs and values where needed, KL-in-reward, advantages on the controller,
then critic and actor updates. Everything heavy happens inside worker-group calls; the
controller holds only the Batch and pure functions from ``reinforge.algorithms``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reinforge.agent.runner import TOOL_CHECK_BY_CALLER, ToolFailureCheck, failed_tools
from reinforge.algorithms import (
    ADVANTAGE_ESTIMATORS,
    apply_kl_penalty,
    build_kl_controller,
    compute_advantages,
    compute_rollout_correction,
)
from reinforge.algorithms.roles import reference_needed
from reinforge.config import Config, config_to_dict
from reinforge.controller import RolePlacement, WorkerGroup
from reinforge.data import PromptLoader, RLDataset, get_pad_token_id
from reinforge.data.loader_state import check_loader_resumes
from reinforge.protocol import Batch, samples_of
from reinforge.reward.combine import combine_scores
from reinforge.reward.manager import place_on_last_token
from reinforge.reward.reward_functions import function_metrics
from reinforge.rollout.base import SamplingParams
from reinforge.stop_signals import note_abandoned
from reinforge.tracking import Tracker
from reinforge.tracking.jsonl import METRICS_FILE
from reinforge.trainer.dynamic_sampling import collect_kept_groups
from reinforge.trainer.generative_rewards import JudgeScorer, RemoteScorer
from reinforge.trainer.metrics import compute_data_metrics, compute_throughput_metrics, mean_of_extras
from reinforge.trainer.modes import TrainerCalls, build_mode
from reinforge.trainer.placement import default_placement, roles_with_groups
from reinforge.trainer.preflight import preflight
from reinforge.trainer.run_loop import DataExhausted, StepSkipped, TrainingRun
from reinforge.trainer.seeds import step_seed
from reinforge.trainer.validation import reward_extras, run_validation, without_prompt_tensors
from reinforge.workers.actor_rollout import ActorRolloutWorker
from reinforge.workers.critic import CriticWorker
from reinforge.workers.judge import JudgeWorker
from reinforge.workers.reference import ReferenceWorker
from reinforge.workers.reward import RewardWorker, raise_if_every_row_failed
from reinforge.workers.reward_model import RewardModelWorker

logger = logging.getLogger(__name__)


def optimizer_steps_per_step(config: Config) -> int:
    """The actor's optimizer steps in one training step: its mini-batches, actor.ppo_epochs times over."""
    num_mini_batches = config.data.train_batch_size // (config.actor.mini_batch_size or config.data.train_batch_size)
    return num_mini_batches * config.actor.ppo_epochs


class RLTrainer(TrainingRun):
    def __init__(self, config: Config, placement: RolePlacement | None = None,
                 reward_functions: Sequence[Callable[..., Any]] | None = None,
                 prompt_sets: Mapping[str, RLDataset] | None = None):
        """``placement`` maps each role to a resource pool; by default every role shares one pool.
        ``reward_functions``: function objects (TRL's or verl's kind) that score every sample, weighted by
        reward.weights, instead of the scorer of each data_source (``reinforge.reward.reward_functions``).
        ``prompt_sets``: the train (and val) prompts already tokenized from config.data (see ``preflight``)."""
        self.config = config
        # every check that can run before a model loads
        checked = preflight(config, placement, reward_functions, prompt_sets)
        self.run_dir = Path(config.trainer.output_dir)
        self.open_run_folder(config.trainer.resume, config.trainer.keep_last, resume_refuses(config))
        with self.run_folder_released_on_failure():
            torch.manual_seed(config.trainer.seed)
            np.random.seed(config.trainer.seed)

            self.tokenizer = tokenizer = checked.tokenizer
            self.pad_token_id = get_pad_token_id(tokenizer)
            self.train_loader = PromptLoader.for_training(checked.train_set, config.data, self.pad_token_id)
            self._prompt_batches: Iterator[Batch] | None = None
            self.val_loader = None
            if checked.val_set is not None:
                self.val_loader = PromptLoader.for_validation(checked.val_set, config.data, self.pad_token_id)
            self.total_steps = config.trainer.total_steps or len(self.train_loader) * config.trainer.total_epochs
            self.data_batches: int | None = None
            """With dynamic sampling and trainer.total_steps unset: the generation batches of trainer.total_epochs
            epochs, after which the run ends (a step draws several, so total_steps is only an upper bound)."""
            if config.algorithm.filter_groups.enable and config.trainer.total_steps is None:
                self.data_batches = len(self.train_loader) * config.trainer.total_epochs
            check_loader_resumes(self.train_loader, self._resume_state)  # changed data: refused before any model loads

        try:
            self._start_workers(placement, reward_functions, tokenizer)
        except BaseException:  # the groups started before the failing one stop too (on Ray, their processes)
            self.close(wait_s=STOP_WAIT_S)
            raise

    def _start_workers(self, placement: RolePlacement | None, reward_functions: Sequence[Callable[..., Any]] | None,
                       tokenizer: Any) -> None:
        """The worker group of each role, the judge's or remote scorer, the tracker and the off-policy mode."""
        config = self.config
        roles = roles_with_groups(config)
        build_group = _group_builder(config, placement or default_placement(config), self.run_dir / "logs")
        self.actor_rollout = build_group(ActorRolloutWorker, config, self.total_steps, role="actor_rollout")
        self.reference = None
        if reference_needed(config):  # a LoRA actor is its own reference: the base with the adapters off
            self.reference = (build_group(ReferenceWorker, config, role="ref") if "ref" in roles
                              else self.actor_rollout)
        self.critic = (build_group(CriticWorker, config, self.total_steps, role="critic")
                       if "critic" in roles else None)
        self.reward = build_group(RewardWorker, config, role="reward", reward_functions=reward_functions)
        self.reward_model = (build_group(RewardModelWorker, config, role="reward_model")
                             if "reward_model" in roles else None)
        self.rm_truncation_warned = False
        """Whether the reward model's inputs cut to reward.reward_model.max_length were warned about (once a run)."""
        self.judge = None
        """reward.judge: the judge's group (the actor's when the policy judges itself)."""
        if config.reward.judge.enable:
            self.judge = build_group(JudgeWorker, config, role="judge") if "judge" in roles else self.actor_rollout
        self.model_scorer: JudgeScorer | RemoteScorer | None = None
        """A judge's or a remote endpoint's score for each sample (reward.judge, reward.remote)."""
        if self.judge is not None:
            self.model_scorer = JudgeScorer(config, self.judge, tokenizer)
        elif config.reward.remote.enable:
            self.model_scorer = RemoteScorer(config, tokenizer)
        self.kl_controller = build_kl_controller(config.algorithm.kl_ctrl)
        self.tracker = Tracker(self.run_dir, config.trainer.loggers, config=config_to_dict(config),
                               project=config.trainer.project_name, experiment=config.trainer.experiment_name)
        self.step = 0
        self.rollout = None
        """trainer.separate_rollout: the worker group that generates in the off-policy modes."""
        if "rollout" in roles:
            self.rollout = build_group(ActorRolloutWorker, config, self.total_steps, role="rollout", rollout_only=True)
        self.mode = build_mode(config, self._mode_calls())
        """trainer.mode one_step_off or async (reinforge.trainer.modes); None in sync mode."""

    # ---- the step ---------------------------------------------------------------------
    def sampling(self, validation: bool = False) -> SamplingParams:
        rollout = self.config.rollout
        source = rollout.val_kwargs if validation else rollout
        return SamplingParams(max_tokens=self.config.data.max_response_length, temperature=source.temperature,
                              top_p=source.top_p, top_k=source.top_k,
                              min_p=0.0 if validation else rollout.min_p,
                              stop_token_ids=tuple(rollout.stop_token_ids))

    def on_policy(self) -> bool:
        """One epoch over one mini-batch: the policy that sampled is the policy being updated."""
        actor, correction = self.config.actor, self.config.algorithm.rollout_correction
        single_step = actor.ppo_epochs == 1 and actor.mini_batch_size in (None, self.config.data.train_batch_size)
        return single_step and correction.rollout_is is None and correction.rollout_rs is None

    def train_step(self, prompts: Batch) -> dict[str, float]:
        """A sync step on a batch of prompts; in an off-policy mode, a step on the batch its ``next_batch`` made."""
        if self.mode is not None:
            return self.mode.train(prompts)
        config, algorithm = self.config, self.config.algorithm
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        step_start = time.perf_counter()
        if algorithm.filter_groups.enable:
            batch, filter_metrics = collect_kept_groups(
                prompts, self.next_prompts, lambda gen_prompts: self._generate_scored(gen_prompts, timing, metrics),
                algorithm.filter_groups, config.data.train_batch_size, self.pad_token_id)
            metrics |= filter_metrics
        else:
            batch = self._generate_scored(prompts, timing, metrics)
        return self.train_on_batch(batch, timing, metrics, step_start)

    def train_on_batch(self, batch: Batch, timing: dict[str, float], metrics: dict[str, float],
                       step_start: float) -> dict[str, float]:
        """The step after generation and scoring: log-probs, rewards, advantages, updates, metrics. A batch whose
        tools failed (``failed_tools``) raises ``StepSkipped`` instead, before any update."""
        config, algorithm = self.config, self.config.algorithm
        failure = failed_tools(batch["tool_call_counts"]) if "tool_call_counts" in batch else None
        if failure is not None:
            self._log_samples(batch, skipped=True)  # they show the tools' error messages
            raise StepSkipped(failure, metrics | {f"timing_s/{key}": value for key, value in timing.items()}
                              | batch.meta.get("rollout_metrics", {}), can_redo=self.mode is None)
        batch = self._add_log_probs(batch, timing)
        with _timed(timing, "adv"):
            self._add_rewards(batch, metrics)
            # bypass mode corrects inside the loss, against the current policy; an off-policy mode's stale
            # batch arrives with its decoupled-loss weights (modes/decoupled.py)
            if not algorithm.rollout_correction.bypass_mode and "old_log_probs" in batch and \
                    "rollout_is_weights" not in batch and (
                    algorithm.rollout_correction.rollout_is or algorithm.rollout_correction.rollout_rs):
                weights, keep, correction_metrics = compute_rollout_correction(
                    batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
                    algorithm.rollout_correction)
                if weights is not None:
                    batch["rollout_is_weights"] = weights
                batch["response_mask"] = batch["response_mask"] * keep
                metrics |= correction_metrics
            advantages, returns = compute_advantages(
                algorithm.adv_estimator, token_level_rewards=batch["token_level_rewards"],
                response_mask=batch["response_mask"], group_ids=_group_ids(batch["uid"]), config=algorithm,
                values=batch.get("values"), reward_baselines=batch.get("reward_baselines"),
                old_log_probs=batch.get("old_log_probs"), sum_pi_squared=batch.get("sum_pi_squared"),
                rollout_is_weights=batch.get("rollout_is_weights"),
                reward_components=_reward_components(batch, algorithm.gdpo_reward_keys))
            batch["advantages"], batch["returns"] = advantages, returns

        if self.critic is not None:
            with _timed(timing, "update_critic"):
                metrics |= self.critic.update_critic(batch)
        if self.step >= config.critic.warmup_steps or self.critic is None:
            with _timed(timing, "update_actor"):
                metrics |= self.actor_rollout.update_actor(batch)
        timing["step"] = time.perf_counter() - step_start

        if "reward_model" in timing:
            metrics["reward_model/share_of_step"] = timing["reward_model"] / max(timing["step"], 1e-9)
        metrics |= compute_data_metrics(batch, config.data.max_response_length)
        metrics |= mean_of_extras(reward_extras(batch)) | function_metrics(batch.non_tensors)
        metrics |= batch.meta.get("reward_metrics", {})
        metrics |= batch.meta.get("mismatch_metrics", {})
        metrics |= {f"timing_s/{key}": value for key, value in timing.items()}
        metrics |= compute_throughput_metrics(batch, timing["step"])
        rollout_metrics = batch.meta.get("rollout_metrics", {})
        metrics |= rollout_metrics
        if "gen" in timing:
            generated = float(batch["response_mask"].sum())
            metrics.setdefault("rollout/tokens_per_s", generated / max(timing["gen"], 1e-9))
        self._log_samples(batch)
        return metrics

    def data_used_up(self) -> str | None:
        """With dynamic sampling and trainer.total_steps unset, once the generation batches of
        trainer.total_epochs epochs are drawn: one line saying so (the run ends there)."""
        if self.data_batches is None or self.train_loader.batches_drawn < self.data_batches:
            return None
        size_key = "data.gen_batch_size" if self.config.data.gen_batch_size else "data.train_batch_size"
        return (f"dynamic sampling used up trainer.total_epochs={self.config.trainer.total_epochs} epoch(s) of data "
                f"({self.data_batches} generation batches of {size_key}={self.train_loader.batch_size} prompts)")

    def next_prompts(self) -> Batch:
        """The loader's next batch of prompts (``fit`` and dynamic sampling draw from one iterator); raises
        ``DataExhausted`` once ``data_used_up``."""
        used_up = self.data_used_up()
        if used_up:
            raise DataExhausted(used_up, "add data, raise trainer.total_epochs or data.gen_batch_size, or set "
                                         "trainer.total_steps (the data then repeats); or use data whose samples "
                                         "of one prompt score differently (algorithm.filter_groups.metric)")
        if self._prompt_batches is None:
            self._prompt_batches = iter(self.train_loader)
        return next(self._prompt_batches)

    def _generate_scored(self, prompts: Batch, timing: dict[str, float], metrics: dict[str, float]) -> Batch:
        """n samples per prompt, generated and scored (with the KL-in-reward rewards when dynamic sampling
        filters on them)."""
        config, algorithm = self.config, self.config.algorithm
        batch = samples_of(prompts, config.rollout.n)
        with _timed(timing, "gen"):
            batch = without_prompt_tensors(batch) | self.generate(
                batch, self.sampling(), step_seed(config.trainer.seed, self.step))
        if algorithm.adv_estimator == "remax":
            with _timed(timing, "gen_max"):
                batch["reward_baselines"] = self._greedy_baseline(prompts, batch)
        updates = optimizer_steps_per_step(config)  # TRL's trainer_state counts optimizer steps
        batch.meta["trainer_state"] = {
            "global_step": self.step * updates, "max_steps": self.total_steps * updates,
            "epoch": self.step / max(1, len(self.train_loader)), "num_train_epochs": config.trainer.total_epochs,
            "metrics_file": str(self.run_dir / METRICS_FILE), "optimizer_steps_per_step": updates}
        with _timed(timing, "reward"):
            batch = batch | self.score(batch, timing)
        if algorithm.filter_groups.enable and algorithm.filter_groups.metric == "seq_final_reward":
            batch = self._add_log_probs(batch, timing)
            self._add_rewards(batch, metrics)
        return batch

    @functools.cached_property
    def tool_failure_check(self) -> ToolFailureCheck:
        """The tool failure check of the batches a generating group of several members returns (one member checks
        its own): its rollouts failed in a row last as long as the run's process, as a member's do."""
        return ToolFailureCheck([])

    def generate(self, batch: Batch, sampling: SamplingParams, seed: int) -> Batch:
        """``actor_rollout.generate``, its agent rows' tool calls checked over the whole batch (``generation_of``)."""
        return self.generation_of(self.actor_rollout)(batch, sampling, seed).result()

    def generation_of(self, group: WorkerGroup) -> Callable[[Batch, SamplingParams, int], ToolCheckedGeneration]:
        """Submits ``group.generate(batch, sampling, seed)``. Each of several members sees only its share of the
        rows: they leave ``ToolFailureCheck`` to this side, which runs it once on the gathered batch when its result
        is read (the line one member raises, where every tool call of the batch's rows failed rollout after rollout)."""
        def submit(batch: Batch, sampling: SamplingParams, seed: int) -> ToolCheckedGeneration:
            if getattr(group, "num_members", 1) > 1:
                batch = Batch(batch.tensors, batch.non_tensors, {**batch.meta, TOOL_CHECK_BY_CALLER: True})
            return ToolCheckedGeneration(group.generate.async_call(batch, sampling, seed), self.tool_failure_check)

        return submit

    def score(self, batch: Batch, timing: dict[str, float] | None = None) -> Batch:
        """token_level_scores of generated samples: the rule-based scorer's, or with a reward model, its score
        (reward.combine.mode=replace, the rule-based scorer not run) or its combination with the rule's, which is
        computed meanwhile. The reward model's time goes to ``timing["reward_model"]``."""
        if self.reward_model is None and self.model_scorer is None:
            return raise_if_every_row_failed(self.reward.score(batch))
        combine = self.config.reward.combine
        rule_call = self.reward.score.async_call(batch) if combine.mode != "replace" else None
        if self.model_scorer is not None:
            with _timed(timing if timing is not None else {}, self.model_scorer.name):
                model_scores, model_metrics = self.model_scorer(batch, self.step)
            rule = raise_if_every_row_failed(rule_call.result()) if rule_call is not None else None
            scores = combine_scores(model_scores, None if rule is None else rule["token_level_scores"].sum(-1),
                                    combine, f"reward.{self.model_scorer.name}")
            result = rule if rule is not None else Batch()
            result["token_level_scores"] = place_on_last_token(scores, batch["response_mask"].cpu()).to(
                batch["responses"].device)
            result.meta["reward_metrics"] = {**result.meta.get("reward_metrics", {}), **model_metrics}
            return result
        with _timed(timing if timing is not None else {}, "reward_model"):
            scored = self.reward_model.compute_rm_score(batch)
        rule = raise_if_every_row_failed(rule_call.result()) if rule_call is not None else None
        rm_scores = scored["rm_scores"].sum(-1)
        cut = int(scored["rm_truncated"].sum())
        if cut and not self.rm_truncation_warned:
            self.rm_truncation_warned = True
            limit, fix = "reward.reward_model.max_length", "raise it"
            if self.config.reward.reward_model.max_length is None:
                limit = ("the reward model's limit, data.max_prompt_length + data.max_response_length "
                         "(reward.reward_model.max_length is unset)")
                fix = "set reward.reward_model.max_length above that sum"
            logger.warning("%d of %d reward-model inputs were longer than %s and lost their end (the response's "
                           "last tokens) before scoring; %s (a re-rendered chat template adds tokens). Warned once; "
                           "reward_model/truncated counts them each step", cut, len(batch), limit, fix)
        scores = combine_scores(rm_scores, None if rule is None else rule["token_level_scores"].sum(-1), combine)
        result = rule if rule is not None else Batch()
        result["token_level_scores"] = place_on_last_token(scores, batch["response_mask"].cpu()).to(
            batch["responses"].device)
        result["rm_scores"], result["rm_truncated"] = scored["rm_scores"], scored["rm_truncated"]
        result.meta["reward_metrics"] = {**result.meta.get("reward_metrics", {}),
                                         "reward_model/score/mean": float(rm_scores.mean()),
                                         "reward_model/truncated": float(scored["rm_truncated"].sum())}
        return result

    def _add_log_probs(self, batch: Batch, timing: dict[str, float]) -> Batch:
        """Old and reference log-probs and values, where the step needs them and the batch lacks them."""
        algorithm = self.config.algorithm
        if "old_log_probs" in batch or "proximal_alpha" in batch:  # set by an off-policy mode (modes/decoupled.py)
            pass
        elif algorithm.rollout_correction.bypass_mode:
            batch["old_log_probs"] = batch["rollout_log_probs"]
        elif (not self.on_policy() or ADVANTAGE_ESTIMATORS[algorithm.adv_estimator].needs_sum_pi_squared) \
                and "old_log_probs" not in batch:
            with _timed(timing, "old_log_prob"):
                batch = batch | self.actor_rollout.compute_log_prob(batch)
        if self.reference is not None and "ref_log_probs" not in batch:
            with _timed(timing, "ref"):
                batch = batch | self.reference.compute_ref_log_prob(batch)
        if self.critic is not None and "values" not in batch:
            with _timed(timing, "values"):
                batch = batch | self.critic.compute_values(batch)
        return batch

    def _add_rewards(self, batch: Batch, metrics: dict[str, float]) -> None:
        """token_level_rewards: the scores, minus the KL penalty with algorithm.use_kl_in_reward."""
        algorithm = self.config.algorithm
        if "token_level_rewards" in batch:
            return
        if algorithm.use_kl_in_reward:
            old = batch.get("old_log_probs", batch["rollout_log_probs"])
            rewards, kl_metrics = apply_kl_penalty(batch["token_level_scores"], old, batch["ref_log_probs"],
                                                   batch["response_mask"], self.kl_controller, algorithm.kl_penalty)
            batch["token_level_rewards"] = rewards
            metrics |= kl_metrics
        else:
            batch["token_level_rewards"] = batch["token_level_scores"]

    def _greedy_baseline(self, prompts: Batch, batch: Batch) -> torch.Tensor:
        """ReMax's baseline: the score of each prompt's greedy response, broadcast to its samples."""
        greedy_sampling = replace(self.sampling(), temperature=0.0)
        greedy = without_prompt_tensors(prompts) | self.generate(prompts, greedy_sampling, 0)
        scores = self.score(greedy)["token_level_scores"].sum(-1)
        return scores.repeat_interleave(self.config.rollout.n)

    def _log_samples(self, batch: Batch, skipped: bool = False) -> None:
        """``num_logged_samples`` rows of ``batch`` into samples.jsonl, under the step it trains. A skipped attempt's
        rows (its redo logs that step's rows again) carry ``"skipped_step": true``, as its metrics row carries
        ``training/skipped_step``."""
        count = min(self.config.trainer.num_logged_samples, len(batch))
        if count == 0:
            return
        rows = []
        prompt_width = batch["prompts"].shape[1]
        for index in range(count):
            length = int(batch["attention_mask"][index][prompt_width:].sum())  # tool tokens of a trajectory too
            rows.append({"prompt": self.tokenizer.decode(batch["prompts"][index][batch["attention_mask"][index][
                :batch["prompts"].shape[1]].bool()]),
                "response": self.tokenizer.decode(batch["responses"][index][:length]),
                "score": float(batch["token_level_scores"][index].sum()),
                "ground_truth": str(batch["ground_truth"][index])} | ({"skipped_step": True} if skipped else {}))
        self.tracker.log_samples(self.step + 1, rows)  # the step this batch trains; the counter moves after it

    # ---- validation -------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        # an off-policy mode's rollout copy may lag the trainer (trainer.trigger_sync_steps): validate what is saved
        with self.mode.current_weights() if self.mode is not None and self.rollout is None else contextlib.nullcontext():
            return run_validation(self.val_loader, self.config.rollout.val_kwargs.n, self.sampling(validation=True),
                                  self.config.trainer.seed + 7, self.generate, self.reward.score)

    # ---- the run ------------------------------------------------------------------------
    def checkpoint_extras(self) -> dict[str, Any]:
        extras: dict[str, Any] = {"kl_controller": self.kl_controller.state_dict()}
        if self.mode is not None:
            extras["mode"] = self.mode.state_dict()
        return extras

    def _mode_calls(self) -> TrainerCalls:
        """What an off-policy mode calls: generation on the rollout group (or the actor's), the reward group's
        scores, the actor's log-probs, this trainer's step and weight sync."""
        generator = self.rollout if self.rollout is not None else self.actor_rollout
        return TrainerCalls(next_prompts=self.next_prompts, generate=self.generation_of(generator),
                            score=self.score, compute_log_prob=self.actor_rollout.compute_log_prob,
                            train_on_batch=self.train_on_batch, sync_rollout_weights=self.sync_rollout_weights,
                            trained_steps=lambda: self.step, sampling=self.sampling(), pad_token_id=self.pad_token_id,
                            run_dir=self.run_dir, rollout_copy_weights=generator.rollout_copy_weights,
                            load_rollout_weights=generator.load_rollout_weights)

    def sync_rollout_weights(self) -> None:
        """Off-policy modes: the rollout generates with the current weights from now on (a new version)."""
        if self.rollout is None:
            self.actor_rollout.sync_rollout_weights()
            return
        weights = self.actor_rollout.rollout_weights()
        self.rollout.load_rollout_weights(weights[0] if isinstance(weights, list) else weights)

    def save(self) -> Path:
        """A checkpoint; an off-policy mode's background work holds still meanwhile."""
        if self.mode is None:
            return super().save()
        with self.mode.paused():
            return super().save()

    def write_checkpoint(self, folder: Path) -> None:
        self.actor_rollout.save_checkpoint(str(folder))
        if self.critic is not None:
            self.critic.save_checkpoint(str(folder))
        if self.mode is not None:
            self.mode.write_checkpoint(folder)

    def load_checkpoint_state(self, folder: Path, state: dict[str, Any]) -> None:
        self.actor_rollout.load_checkpoint(str(folder))
        if self.critic is not None:
            self.critic.load_checkpoint(str(folder))
        if self.config.algorithm.kl_ctrl.type == "adaptive":  # a fixed coefficient is the config's, changed or not
            self.kl_controller.load_state_dict(state["kl_controller"])
        if self.mode is not None:
            self.sync_rollout_weights()  # the rollout starts from the restored weights
            self.mode.load_state_dict(state["mode"], state["step"])
            self.mode.read_checkpoint(folder)  # or from its version's, saved between two syncs

    def fit(self) -> dict[str, float]:
        """Train to ``total_steps`` (resuming by ``trainer.resume``); returns the last step's metrics."""
        config = self.config.trainer
        try:
            self.resume()
            self._prompt_batches = None  # a fresh iterator from the (restored) loader position
            next_batch = self.next_prompts
            if self.mode is not None and self.step < self.total_steps:
                self.mode.start()
                next_batch = self.mode.next_batch
            metrics = self.run_steps(next_batch, test_every=config.test_every, save_every=config.save_every,
                                     validate_first=config.val_before_train)
            if isinstance(self.model_scorer, JudgeScorer):  # a short run whose every judge call timed out
                self.model_scorer.check_the_run_was_judged()
            return metrics
        except KeyboardInterrupt:  # SIGTERM or Ctrl-C: do not wait for a long call (a slow scorer) to end
            self.close(wait_s=STOP_WAIT_S)
            raise
        finally:
            self.close()

    def close(self, wait_s: float | None = 60.0) -> None:
        """Stop the worker groups (their processes, on Ray) and flush the trackers; a second call does nothing.

        ``wait_s``: how long the off-policy mode's generation under way, and then each local worker's running call,
        may take to end (None: no limit). A generation that does not end by then is abandoned: nothing of it is
        saved (resuming starts from the latest checkpoint), and the stop's line says so.
        """
        if getattr(self, "_closed", False):
            return
        self._closed = True
        started = {name: getattr(self, name, None) for name in (  # all of them, unless a worker failed to start
            "mode", "actor_rollout", "reference", "critic", "reward", "reward_model", "judge", "rollout",
            "model_scorer", "tracker")}
        if started["mode"] is not None and started["mode"].stop(wait_s):
            within = "" if wait_s is None else f" within {wait_s:g} s"
            note_abandoned(f"the generation under way did not end{within} and was abandoned")
        for name in ("actor_rollout", "reference", "critic", "reward", "reward_model", "judge", "rollout"):
            group = started[name]
            if group is not None and (name == "actor_rollout" or group is not started["actor_rollout"]):
                group.shutdown(wait_s)
        if isinstance(started["model_scorer"], RemoteScorer):
            started["model_scorer"].close()
        if started["tracker"] is not None:
            started["tracker"].close()
        self.release_run_folder()


STOP_WAIT_S = 2.0
"""After SIGTERM or Ctrl-C, how long a worker's running call (a step, a batch of slow scorers) may take to end."""

RESUME_REFUSES = ("model.path", "model.tokenizer_path", "critic.model_path", "critic.enable", "algorithm.adv_estimator",
                  "algorithm.kl_ctrl.type", "data.train_files", "data.train_batch_size", "data.gen_batch_size",
                  "data.shuffle", "data.seed", "data.max_train_samples", "data.max_prompt_length",
                  "data.filter_overlong_prompts", "data.prompt_key", "data.image_key", "data.chat_template",
                  "data.min_pixels", "data.max_pixels", "trainer.seed", "trainer.mode",
                  "model.lora.rank", "model.lora.target_modules")
"""Settings a resumed run may not change: the checkpoint's weights, data order or algorithm would not fit them (the
pixel bounds set each image's tokens, so which prompts data.max_prompt_length keeps, and what the model was trained
to see)."""


def resume_refuses(config: Config) -> tuple[str, ...]:
    """``RESUME_REFUSES``, and in async mode what its checkpoint's prompt groups in flight were admitted under:
    rollout.n (each group's samples) and trainer.trigger_sync_steps (the staleness bound counts every group admitted
    so far in versions of trigger_sync_steps x train_batch_size groups; with another count the bound can admit
    nothing while the trainer waits for groups)."""
    if config.trainer.mode == "async":
        return RESUME_REFUSES + ("rollout.n", "trainer.trigger_sync_steps")
    return RESUME_REFUSES


def _group_builder(config: Config, placement: RolePlacement, log_dir: Path) -> Callable[..., WorkerGroup]:
    """``build(worker_cls, *init_args, role=...)``: the role's worker group on its pool and the configured backend.

    On Ray, preflight has checked the pools of the run's roles against the cluster (``check_ray_cluster``): a run the
    cluster cannot hold stopped before any model loads."""
    trainer = config.trainer
    group_class: type[WorkerGroup] = WorkerGroup
    if trainer.backend == "ray":
        from reinforge.controller.ray_backend import RayWorkerGroup, connect_ray

        connect_ray(trainer.ray_address, log_dir=log_dir, device=trainer.device)
        group_class = RayWorkerGroup

    def build(worker_cls: type, *init_args: Any, role: str, **init_kwargs: Any) -> WorkerGroup:
        return group_class(worker_cls, *init_args, name=role, backend=trainer.backend,
                           resource_pool=placement.pool_for(role), timeout_s=trainer.call_timeout_s,
                           init_kwargs=init_kwargs or None)

    return build


class ToolCheckedGeneration:
    """A generation under way (its group's future): ``result()`` is the generated batch, once through
    ``check.gathered``; a ``ToolFailure`` it raised is raised again by every later read, as a member's error is."""

    def __init__(self, future: Any, check: ToolFailureCheck):
        self.future, self.check = future, check
        self._checked: Batch | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return bool(self.future.done())

    def result(self, *timeout_s: Any) -> Batch:
        if self._error is not None:
            raise self._error
        if self._checked is None:
            generated = self.future.result(*timeout_s)
            try:
                self._checked = self.check.gathered(generated)
            except Exception as error:
                self._error = error
                raise
        return self._checked


@contextlib.contextmanager
def _timed(timing: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall time to ``timing[name]`` (reported as ``timing_s/<name>``)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _reward_components(batch: Batch, keys: list[str]) -> dict[str, torch.Tensor]:
    """The scorer's extras named in keys (its ``reward_<key>`` columns) as (B,) float tensors, for gdpo.

    "score" is the scorer's score itself (as in verl, where it is one of the returned dict's keys).
    """
    components = {}
    for key in keys:
        column = batch.non_tensors.get(f"reward_{key}")
        if column is None and key == "score":
            components[key] = batch["token_level_scores"].sum(dim=-1)
            continue
        if column is None:
            returned = sorted(name.removeprefix("reward_") for name in batch.non_tensors if name.startswith("reward_"))
            raise ValueError(f"algorithm.gdpo_reward_keys names {key!r}, but the scorer returned no {key!r}; it "
                             f"returned {', '.join(returned) or 'no extras (return a dict holding these keys)'}")
        try:
            components[key] = torch.as_tensor(np.asarray(column, dtype=np.float32))
        except (TypeError, ValueError) as error:
            raise ValueError(f"algorithm.gdpo_reward_keys names {key!r}, but the scorer's {key!r} values are not all "
                             f"numbers ({error}); return a number for every sample") from error
    return components


def _group_ids(uids: np.ndarray) -> torch.Tensor:
    mapping: dict[str, int] = {}
    return torch.tensor([mapping.setdefault(str(uid), len(mapping)) for uid in uids], dtype=torch.long)
