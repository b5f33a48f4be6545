"""The reward manager: responses in, token-level scores out.

For each sample it decodes the whole response (every token after the prompt, tool output of a
multi-turn trajectory included; special tokens skipped), calls the run's reward functions
(``reward_functions.py``: the scorer of each ``data_source``, ``reward.custom_function``, or
function objects with ``reward.weights``; TRL's kind once per batch, in one chunk per worker, verl's
once per sample) in worker processes with a per-sample time limit (a batch call gets it once per
sample), and puts each score on the sample's last generated token (``response_mask == 1``).
A trajectory's per-call tool rewards (the ``tool_rewards`` column) are added to its score, a score
an agent loop set itself (``agent_reward_score``) replaces the scorer's, and
``reward.retool_wrong_answer`` gives a wrong answer ReTool's ``min(-0.6, -1 + 0.05 * (num_turns - 2))``. A scorer that raises or times out gives
``reward.fallback_score`` to its sample (a failed batch call: to every sample of it); it is counted in the
metrics and the first traceback is logged, naming the function.
A batch where every sample's scorer failed raises ``ScorerFailure`` naming the error: a run
that scores nothing learns nothing. ``reward.num_workers=0`` scores in a thread of this
process (handy under a debugger), still stopped at the time limit, a scorer's ``sys.exit`` or
``os._exit`` counted as its error, and a crash that ends the process named on its last line
(``reward.in_process``). With ``reward.overlong_buffer.enable`` each score
gets DAPO's overlong penalty (``reward.overlong``), kept per sample as the ``overlong_penalty``
extra and counted in ``reward/overlong/*``.

Each scoring process's heap is capped at ``reward.max_memory_mb``; a sample whose scorer runs
past it gets the fallback score, counted in ``reward/memory_exceeded``, and the process is
replaced. Two signs of a scorer that scores nothing useful are warned about once each, in one
line: a score whose magnitude exceeds ``reward.max_abs_score``, and every sample scoring the same
value for ``CONSTANT_SCORE_BATCHES`` batches in a row while the scorer returns no extras (a
scorer that returns extras, such as ``acc``, shows its progress there).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from reinforge.config.schema import RewardConfig
from reinforge.protocol import Batch
from reinforge.reward.in_process import ScorerSentinel, intercept_scorer_exits, run_job_in_thread
from reinforge.reward.overlong import overlong_penalty
from reinforge.reward.registry import SCORERS, Scorer, find_scorer, get_scorer
from reinforge.reward.reward_functions import (
    FUNCTION_SCORES_PREFIX,
    RewardFunction,
    RewardLog,
    TrainerState,
    batch_call_kwargs,
    batch_scores,
    build_reward_functions,
    chunks_of,
    combine,
    logged_metric_columns,
)
from reinforge.reward.scorer_calls import (
    accepted_keywords,
    build_call_kwargs,
    check_reward_options,
    file_function_specs,
    load_custom_scorer,
)
from reinforge.reward.scoring_pool import JobResult, ScoringJob, ScoringPool

logger = logging.getLogger(__name__)


CONSTANT_SCORE_BATCHES = 5
"""Batches in a row (a training step scores one, or several under dynamic sampling) in which every sample scores
the same value before the reward manager warns that the scorer may not discriminate."""


class ScorerFailure(RuntimeError):
    """Every sample of a batch got the fallback score: the scorer is broken, not the samples."""


@dataclass
class RewardOutput:
    token_level_scores: Tensor
    """(batch, response_len) float32: each sample's score on its last generated token, 0 elsewhere."""
    scores: Tensor
    """(batch,) float32: the score of each sample (fallback_score for failed ones), overlong penalty included."""
    extras: dict[str, list[Any]] = field(default_factory=dict)
    """Extra values of dict scores (acc, pred, ...), one per sample; None where a sample lacks the key."""
    metrics: dict[str, float] = field(default_factory=dict)
    """reward/errors and reward/timeouts: counts of samples that got the fallback score."""
    function_scores: dict[str, list[float]] = field(default_factory=dict)
    """``rewards/<name>`` -> each sample's score from that reward function (NaN: None or failed), for functions
    given by the user (not the built-in scorers by data source)."""
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)
    """``logged_metric/<name>`` -> per sample, what its batch call logged through ``log_metric`` (NaN: nothing)."""
    failures: list[str | None] = field(default_factory=list)
    """Per sample, why it got the fallback score (``error``, ``timeout`` or ``memory``; None: it did not)."""
    failure_report: dict[str, str] = field(default_factory=dict)
    """Where any sample failed: the parts of the ``ScorerFailure`` line (``all_failed_message``) that a caller
    needs to raise it over several such outputs: ``scorer`` (who failed first), ``raised`` (the first error's last
    line, where one raised), ``timed_out`` and ``out_of_memory`` (the limits, as the line names them)."""

    def to_batch(self) -> Batch:
        """``token_level_scores`` plus one ``reward_<key>`` column per extra, one ``rewards/<name>`` column per
        reward function and one ``logged_metric/<name>`` per value logged, to merge with ``batch |= ...``."""
        return Batch.from_dict(tensors={"token_level_scores": self.token_level_scores},
                               non_tensors={**{f"reward_{key}": values for key, values in self.extras.items()},
                                            **self.function_scores, **self.logged_metrics})


class RewardManager:
    """Scores batches of responses; keeps its worker processes between calls (``close()`` ends them)."""

    def __init__(self, config: RewardConfig, tokenizer: Any, max_response_length: int | None = None,
                 functions: Sequence[Scorer] | None = None) -> None:
        """``max_response_length`` (data.max_response_length) is needed by reward.overlong_buffer; ``functions``
        are reward function objects (weighted by reward.weights) that replace the scorers by data source.

        ``config`` is a checked one (``config.validate``: workers, timeout, the buffer's length).
        """
        if config.overlong_buffer.enable and max_response_length is None:
            raise ValueError("reward.overlong_buffer.enable=true needs the RewardManager's max_response_length "
                             "(data.max_response_length)")
        self.config = config
        self.tokenizer = tokenizer
        self.max_response_length = max_response_length
        self.options = dict(config.kwargs)
        if config.num_workers == 0:  # before the custom scorer loads, in case it binds os._exit at import
            intercept_scorer_exits()
        self.custom_scorer: Scorer | None = None
        if config.custom_function:
            self.custom_scorer = load_custom_scorer(config.custom_function)
        files = [(spec, self.custom_scorer if spec == config.custom_function else load_custom_scorer(spec))
                 for spec in file_function_specs(config)]
        self.functions = build_reward_functions(functions, config.weights, files)
        given = [function.scorer for function in self.functions if function.scorer is not None]
        check_reward_options(self.options, given or list(set(SCORERS.values())))
        self._accepted: dict[Scorer, frozenset[str] | None] = {}
        self._pool: ScoringPool | None = None
        self._sentinel: ScorerSentinel | None = None
        self._logged: set[str] = set()
        self._warned_scale = False
        self._warned_constant = False
        self._warned_unscored = False
        self._warned_some_unscored = False
        self._constant_score: float | None = None
        self._constant_batches = 0

    def close(self) -> None:
        """Stop the scorer processes (they also stop when the manager is garbage-collected)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._sentinel is not None:
            self._sentinel.close()
            self._sentinel = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def score(self, batch: Batch, raise_when_all_failed: bool = True, padding_rows: int = 0) -> RewardOutput:
        """Score every sample of ``batch``; where every sample failed, raise ``ScorerFailure`` (or, with
        ``raise_when_all_failed=False``, give each the fallback score, as a caller that scores a batch in parts
        decides over the whole batch: ``failures`` and ``failure_report``).

        ``padding_rows``: how many of the last rows are padding (copies of other rows that a split over several
        workers adds, dropped after gathering). No scorer is called for them (a scorer with side effects, or a paid
        one, would run twice for the row copied) and no count or check covers them; each gets a placeholder of the
        output's shape (``with_padding_rows``).

        Needs tensors ``responses`` (B, T) right-padded token ids and ``response_mask`` (B, T),
        and non-tensors ``ground_truth``, ``data_source`` (unless a custom function scores
        everything) and, optionally, ``extra_info``, ``columns`` (a dict of the row's extra
        columns), ``raw_prompt``, ``tool_rewards`` and ``num_turns`` (also passed in ``extra_info``). The response's length is
        read from ``attention_mask`` (its last T columns) when the batch has it, since tool
        tokens have response_mask 0. ``meta["trainer_state"]`` (global_step, max_steps) reaches
        TRL-kind functions as ``trainer_state``.
        """
        if not 0 <= padding_rows <= len(batch):
            raise ValueError(f"padding_rows={padding_rows} of a batch of {len(batch)} rows; it counts the batch's last "
                             "rows, so it must be between 0 and the batch's rows")
        if padding_rows:
            real = batch.index(slice(0, len(batch) - padding_rows))
            return with_padding_rows(self.score(real, raise_when_all_failed), padding_rows)
        responses, response_mask = batch["responses"].cpu(), batch["response_mask"].cpu().bool()
        width = responses.shape[1]
        in_response = (batch["attention_mask"][:, -width:].cpu().bool() if "attention_mask" in batch
                       else response_mask)
        num_samples = len(batch)
        nothing = np.full(num_samples, None, dtype=object)
        data_sources, extra_infos = batch.get("data_source", nothing), batch.get("extra_info", nothing)
        if "num_turns" in batch.non_tensors:  # a multi-turn rollout: extra_info["num_turns"], as verl's managers give
            extra_infos = [{**(info if isinstance(info, dict) else {}), "num_turns": int(turns)}
                           for info, turns in zip(extra_infos, batch["num_turns"], strict=True)]
        completion_ids = [row[mask].tolist() for row, mask in zip(responses, in_response, strict=True)]
        samples = {"texts": self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
                   "completion_ids": completion_ids, "prompts": list(batch.get("raw_prompt", nothing)),
                   "ground_truths": list(batch["ground_truth"]), "extra_infos": list(extra_infos),
                   "data_sources": list(data_sources), "columns": list(batch.get("columns", nothing))}
        trainer_state = TrainerState(**batch.meta.get("trainer_state", {}))
        jobs: list[ScoringJob] = []
        owners: list[tuple[int, range]] = []
        for row, function in enumerate(self.functions):
            if function.batched:
                for indices in chunks_of(num_samples, max(1, self.config.num_workers)):
                    log = RewardLog(len(indices))
                    kwargs = batch_call_kwargs(function, indices, samples, self.options, trainer_state, log)
                    jobs.append(ScoringJob(self._scorer_to_send(function), kwargs, num_samples=len(indices), log=log))
                    owners.append((row, indices))
            else:
                for index in range(num_samples):
                    jobs.append(self._sample_job(function, index, samples))
                    owners.append((row, range(index, index + 1)))
        results = self._run(jobs, owners, data_sources, batch.get("uid", nothing))

        function_scores = np.full((len(self.functions), num_samples), np.nan)
        per_sample_extras: list[dict[str, Any]] = [{} for _ in range(num_samples)]
        failures: list[str | None] = [None] * num_samples
        """Per sample: None, or the first way one of its functions failed (error, timeout, memory)."""
        first_failures: dict[str, tuple[RewardFunction, range, str | None]] = {}
        logs: list[tuple[range, RewardLog]] = []
        for (row, indices), result in zip(owners, results, strict=True):
            function = self.functions[row]
            details = None
            if result.timed_out:
                kind = "timeout"
            elif result.memory_exceeded:
                kind = "memory"
            else:
                try:
                    if function.batched:
                        if result.error is not None:
                            raise RuntimeError(result.error)
                        value, log = result.value
                        function_scores[row, indices.start:indices.stop] = batch_scores(value, function.name)
                        logs.append((indices, log))
                        for column, values in log.extras.items():
                            for index, item in zip(indices, values, strict=True):
                                per_sample_extras[index][column] = item
                    else:
                        function_scores[row, indices.start], extras = _unpack_score(result)
                        per_sample_extras[indices.start] |= extras
                    continue
                except Exception as error:
                    kind, details = "error", result.error or f"{type(error).__name__}: {error}"
            first_failures.setdefault(kind, (function, indices, details))
            for index in indices:
                failures[index] = failures[index] or kind
        num_errors, num_timeouts, num_out_of_memory = (failures.count(kind) for kind in ("error", "timeout", "memory"))
        report = self._failure_report(first_failures, data_sources)
        if raise_when_all_failed and num_samples and num_errors + num_timeouts + num_out_of_memory == num_samples:
            raise ScorerFailure(all_failed_message(report, num_samples, num_timeouts, num_out_of_memory))
        for kind, (function, indices, details) in first_failures.items():
            self._log_once(kind, function, indices, data_sources[indices[0]], details)
        unscored = np.isnan(function_scores).all(axis=0) & ~np.array([failure is not None for failure in failures],
                                                                     dtype=bool)
        if num_samples and not self._warned_unscored and unscored.all():
            self._warned_unscored = True  # TRL's "all reward functions returned None", once a run
            logger.warning("every reward function returned None (does not apply) for every sample of a batch "
                           "(data_source %r), so each scores 0 and the batch teaches nothing; return a score where "
                           "a function applies. Warned once.", data_sources[0])
        elif num_samples and not self._warned_some_unscored and unscored.any() and not unscored.all():
            self._warned_some_unscored = True
            first = int(np.flatnonzero(unscored)[0])
            logger.warning("every reward function returned None (does not apply) for %d of %d samples (the first: "
                           "data_source %r), so they score 0; give each kind of row a function that scores it. "
                           "Warned once.", int(unscored.sum()), num_samples, data_sources[first])
        scores = torch.as_tensor(combine(function_scores, [function.weight for function in self.functions]),
                                 dtype=torch.float32)
        failed = torch.tensor([failure is not None for failure in failures], dtype=torch.bool)
        scores[failed] = float(self.config.fallback_score)
        self._watch_scores(scores, data_sources, returned_extras=any(per_sample_extras))

        if self.config.retool_wrong_answer:
            scores = retool_scores(scores, per_sample_extras, batch.get("num_turns", np.full(num_samples, 2)))
        if "tool_rewards" in batch:
            scores = scores + torch.tensor([float(sum(rewards or ())) for rewards in batch["tool_rewards"]])
        if "agent_reward_score" in batch:  # a loop that scored its own trajectory
            for index, own_score in enumerate(batch["agent_reward_score"]):
                if own_score is not None:
                    scores[index] = float(own_score)
        keys = sorted({key for extras in per_sample_extras for key in extras})
        extras = {key: [extras.get(key) for extras in per_sample_extras] for key in keys}
        metrics = {"reward/errors": float(num_errors), "reward/timeouts": float(num_timeouts),
                   "reward/memory_exceeded": float(num_out_of_memory)}
        buffer = self.config.overlong_buffer
        if buffer.enable:
            assert self.max_response_length is not None  # checked in __init__
            penalties = overlong_penalty(in_response.sum(-1), self.max_response_length, buffer.len,
                                         buffer.penalty_factor)
            scores = scores + penalties
            extras["overlong_penalty"] = penalties.tolist()
            shaped = penalties < 0
            metrics |= {"reward/overlong/count": float(shaped.sum()),
                        "reward/overlong/fraction": float(shaped.sum()) / num_samples if num_samples else 0.0}
        named = {f"{FUNCTION_SCORES_PREFIX}{function.name}": function_scores[row].tolist()
                 for row, function in enumerate(self.functions) if function.scorer is not None}
        return RewardOutput(
            token_level_scores=place_on_last_token(scores, response_mask).to(batch["responses"].device),
            scores=scores, extras=extras, metrics=metrics, function_scores=named,
            logged_metrics=logged_metric_columns(logs, num_samples), failures=failures, failure_report=report)

    def _scorer_to_send(self, function: RewardFunction) -> Any:
        """The function as a job carries it: the object in this process, a spec or its pickle for the workers."""
        return function.scorer if self.config.num_workers == 0 else function.for_workers()

    def _sample_job(self, function: RewardFunction, index: int, samples: dict[str, list[Any]]) -> ScoringJob:
        """One call of a verl-kind function (or of the sample's built-in scorer) on sample ``index``."""
        data_source = samples["data_sources"][index]
        if function.scorer is None:
            scorer = get_scorer(data_source)
            if scorer not in self._accepted:
                self._accepted[scorer] = accepted_keywords(scorer)
            accepted, to_send = self._accepted[scorer], scorer
        else:
            accepted, to_send = function.accepted, self._scorer_to_send(function)
        kwargs = build_call_kwargs(accepted, samples["texts"][index], samples["ground_truths"][index],
                                   samples["extra_infos"][index], data_source, self.options,
                                   columns=samples["columns"][index])
        return ScoringJob(to_send, kwargs)

    def _run(self, jobs: list[ScoringJob], owners: list[tuple[int, range]], data_sources: Any,
             uids: Any) -> list[JobResult]:
        if self.config.num_workers == 0:
            return self._run_in_process(jobs, owners, data_sources, uids)
        if self._pool is None:
            self._pool = ScoringPool(self.config.num_workers, self.config.timeout_s, self.config.custom_function,
                                     self.config.max_memory_mb)
        return self._pool.run(jobs)

    def _run_in_process(self, jobs: list[ScoringJob], owners: list[tuple[int, range]],
                        data_sources: Any, uids: Any) -> list[JobResult]:
        """Each job on a thread of this process, under the sentinel's watch (``reward.in_process``)."""
        if self._sentinel is None:
            self._sentinel = ScorerSentinel()
        results = []
        num_samples = len(data_sources)
        for job, (row, indices) in zip(jobs, owners, strict=True):
            function, first = self.functions[row], indices[0]
            what = (f"samples {first}-{indices[-1]} of a batch of {num_samples} in one call" if function.batched
                    else f"sample {first} of a batch of {num_samples}")
            self._sentinel.begin(
                f"the trainer process ended while {self._function_name(function, data_sources[first])} was scoring "
                f"{what} (data_source {data_sources[first]!r}, uid {uids[first]}) in this "
                "process (reward.num_workers=0). A scorer that crashes (a segfault, an exit from C code) takes the "
                "trainer with it: set reward.num_workers>0 to score in worker processes, where such a sample gets "
                "reward.fallback_score and is counted")
            try:
                results.append(run_job_in_thread(job, self.config.timeout_s * job.time_units))
            finally:
                self._sentinel.end()
        return results

    def _function_name(self, function: RewardFunction, data_source: Any) -> str:
        if function.spec is not None and function.spec == self.config.custom_function:
            return f"reward.custom_function={function.spec}"
        if function.spec is not None:
            return f"reward function {function.spec} (reward.functions)"
        if function.scorer is not None:
            return f"reward function {function.name}"
        scorer = find_scorer(data_source)
        name = f"{getattr(scorer, '__module__', '?')}.{getattr(scorer, '__qualname__', scorer)}"
        return f"the scorer of data_source {data_source!r} ({name})"

    def _failure_report(self, first_failures: dict[str, tuple[RewardFunction, range, str | None]],
                        data_sources: Any) -> dict[str, str]:
        """``RewardOutput.failure_report`` of a batch's first failures (by kind); empty where none failed."""
        if not first_failures:
            return {}
        function, indices, _ = next(iter(first_failures.values()))
        data_source = data_sources[indices[0]]
        report = {"scorer": (f"the scorer of data_source {data_source!r}" if function.scorer is None
                             else self._function_name(function, data_source)),
                  "timed_out": f"ran past reward.timeout_s={self.config.timeout_s}",
                  "out_of_memory": f"ran past reward.max_memory_mb={self.config.max_memory_mb}"}
        error = first_failures.get("error")
        if error is not None and error[2] is not None:
            report["raised"] = "raised " + (error[2].strip().splitlines() or ["?"])[-1]
        return report

    def _log_once(self, kind: str, function: RewardFunction, indices: range, data_source: Any,
                  details: str | None) -> None:
        """One warning per kind of failure (error, timeout, memory) over the manager's life; later ones are counted."""
        if kind in self._logged:
            return
        self._logged.add(kind)
        who = self._function_name(function, data_source)
        where = (f"a batch call of {len(indices)} samples (each gets reward.fallback_score={self.config.fallback_score})"
                 if function.batched else
                 f"a sample of data_source {data_source!r}; it gets reward.fallback_score={self.config.fallback_score}")
        if kind == "error":
            logger.warning("%s failed on %s. Later failures are only counted in reward/errors.\n%s",
                           who, where, details)
        elif kind == "timeout":
            logger.warning("%s ran past reward.timeout_s=%s (per sample) on %s and was stopped. Later timeouts are "
                           "only counted in reward/timeouts.", who, self.config.timeout_s, where)
        else:
            logger.warning("%s ran past reward.max_memory_mb=%s on %s; its process was replaced. Later ones are only "
                           "counted in reward/memory_exceeded.", who, self.config.max_memory_mb, where)

    def _watch_scores(self, scores: Tensor, data_sources: Any, returned_extras: bool) -> None:
        """Warn once about a score beyond reward.max_abs_score, and once about scores that never vary."""
        if not len(scores):
            return
        beyond = scores.abs() > self.config.max_abs_score
        if beyond.any() and not self._warned_scale:
            self._warned_scale = True
            index = int(beyond.nonzero()[0, 0])
            logger.warning("a scorer returned %.6g on a sample of data_source %r, beyond reward.max_abs_score=%g; "
                           "at such a scale advantages and the critic lose all precision: rescale the scorer (or "
                           "raise reward.max_abs_score if it is meant). Warned once.",
                           float(scores[index]), data_sources[index], self.config.max_abs_score)
        value = float(scores[0])
        if returned_extras or not bool((scores == value).all()):
            self._constant_score, self._constant_batches = None, 0
            return
        self._constant_batches = self._constant_batches + 1 if self._constant_score == value else 1
        self._constant_score = value
        if self._constant_batches >= CONSTANT_SCORE_BATCHES and not self._warned_constant:
            self._warned_constant = True
            logger.warning("every sample of the last %d batches scored %s (data_source %r) and the scorer returns "
                           "no extras: a score that never varies teaches nothing; check the scorer and the ground "
                           "truths. Warned once.", self._constant_batches, value,
                           data_sources[0])


def with_padding_rows(output: RewardOutput, num_rows: int) -> RewardOutput:
    """``output`` with ``num_rows`` placeholder rows after its own: score 0, no extras (None), no function score
    (NaN), no failure; its metrics and failure report, which count its own rows alone, unchanged."""
    width = output.token_level_scores.shape[1]
    token_level_scores = torch.cat([output.token_level_scores,
                                    output.token_level_scores.new_zeros((num_rows, width))])
    return RewardOutput(
        token_level_scores=token_level_scores, scores=torch.cat([output.scores, output.scores.new_zeros(num_rows)]),
        extras={key: [*values, *[None] * num_rows] for key, values in output.extras.items()},
        metrics=dict(output.metrics),
        function_scores={key: [*values, *[math.nan] * num_rows] for key, values in output.function_scores.items()},
        logged_metrics={key: [*values, *[math.nan] * num_rows] for key, values in output.logged_metrics.items()},
        failures=[*output.failures, *[None] * num_rows], failure_report=dict(output.failure_report))


def all_failed_message(report: dict[str, str], num_samples: int, num_timeouts: int, num_out_of_memory: int) -> str:
    """The ``ScorerFailure`` line of a batch of ``num_samples`` where every sample failed, from the
    ``failure_report`` of its scoring (the first that has each part, where it was scored in parts)."""
    if "raised" in report:
        what = report["raised"]
    elif num_timeouts:
        what = report["timed_out"]
    else:
        what = report["out_of_memory"]
    return (f"{report['scorer']} failed on all {num_samples} samples of a batch ({num_timeouts} timed out, "
            f"{num_out_of_memory} ran out of memory); it {what}. "
            "Nothing can be learned from such a step: fix the scorer (reward.num_workers=0 runs it in this "
            "process, under a debugger)")


def retool_scores(scores: Tensor, extras: list[dict[str, Any]], num_turns: Any) -> Tensor:
    """ReTool's outcome reward: a wrong answer scores min(-0.6, -1 + 0.05 * (num_turns - 2)), a right one keeps its score.

    A sample is wrong when its scorer's ``acc`` extra is false, or, without ``acc``, when its score is <= 0.
    """
    shaped = scores.clone()
    for index, sample_extras in enumerate(extras):
        wrong = not sample_extras["acc"] if "acc" in sample_extras else float(scores[index]) <= 0
        if wrong:
            shaped[index] = min(-0.6, -1.0 + 0.05 * (int(num_turns[index]) - 2))
    return shaped


def place_on_last_token(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Each row's score on its last masked position; rows without one stay all zero.

    scores: (batch,); response_mask: (batch, response_len) bool. Returns (batch, response_len) float32.
    """
    token_level_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    last_positions = response_mask.shape[1] - 1 - response_mask.flip(dims=[1]).int().argmax(dim=1)
    rows = torch.nonzero(response_mask.any(dim=1), as_tuple=True)[0]
    token_level_scores[rows, last_positions[rows]] = scores[rows].float()
    return token_level_scores


def _unpack_score(result: JobResult) -> tuple[float, dict[str, Any]]:
    """The score and extras of a scorer's return value; raises when it failed or returned a non-score."""
    if result.error is not None:
        raise RuntimeError(result.error)
    value = result.value
    extras: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"the scorer returned a dict without 'score' (keys: {sorted(value)}); "
                             "return a float or a dict with a 'score'")
        extras = {key: item for key, item in value.items() if key != "score"}
        value = value["score"]
    if isinstance(value, bool | int | float | np.number | np.bool_) or (
            isinstance(value, Tensor) and value.numel() == 1) or (isinstance(value, np.ndarray) and value.size == 1):
        score = float(value.item() if isinstance(value, np.ndarray) else value)
    else:
        raise TypeError(f"the scorer returned a {type(value).__name__}; return a float or a dict with a 'score'")
    if not math.isfinite(score):
        raise ValueError(f"the scorer returned a non-finite score {score}")
    return score, extras
