import logging
import time

import numpy as np
import pytest
import torch

from reinforge.config.schema import RewardConfig
from reinforge.protocol import Batch
from reinforge.reward.manager import RewardManager, ScorerFailure

PAD, EOS = 0, 1

CUSTOM_SCORERS = '''
import os
import time


def exact(solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise RuntimeError("scorer exploded")
    if solution_str == "half":
        return 0.5
    return {"score": float(solution_str == ground_truth), "pred": solution_str}


def slow(solution_str, ground_truth, extra_info=None):
    if solution_str == "sleep":
        time.sleep(60)
    if solution_str == "spin":
        while True:
            pass
    if solution_str == "crash":
        os._exit(3)
    return 1.0


def with_source(solution_str, ground_truth, data_source, extra_info=None, bonus=0.0):
    return {"score": 1.0 + bonus, "source": data_source, "tag": extra_info["tag"]}


def turns_penalised(data_source, solution_str, ground_truth, extra_info=None):
    # as the ReTool recipe's scorer reads it
    return {"score": -extra_info["num_turns"] / 10, "tag": extra_info.get("tag")}


def not_a_score(solution_str, ground_truth):
    return "high"


async def judged(solution_str, ground_truth, extra_info=None):
    import asyncio

    await asyncio.sleep(0.01)  # as a call to a judge model's server would
    return {"score": float(solution_str == ground_truth), "judge": "async"}


_kept = []


def leaky(solution_str, ground_truth, extra_info=None):
    """Keeps 40 MB per call, as a scorer with a growing cache would."""
    if solution_str == "all at once":
        _kept.append(bytearray(8 * 2**30))
    _kept.append(bytearray(40 * 2**20))
    return float(len(_kept))


def huge(solution_str, ground_truth, extra_info=None):
    return 1e30 if solution_str == "big" else 1.0


def length(solution_str, ground_truth, extra_info=None):
    return float(len(solution_str))


async def completions_judged(completions, ground_truth, **kwargs):
    return [float(completion == truth) for completion, truth in zip(completions, ground_truth, strict=True)]


_client_loop = []


async def judged_by_a_kept_client(solution_str, ground_truth, extra_info=None):
    """Keeps a client made on its first call's event loop, whose answers arrive on that loop (an AsyncOpenAI client's
    or an aiohttp session's connections do)."""
    import asyncio

    if not _client_loop:
        _client_loop.append(asyncio.get_running_loop())
    answer = _client_loop[0].create_future()
    _client_loop[0].call_soon(answer.set_result, float(solution_str == ground_truth))
    return await answer
'''


@pytest.fixture
def scorer_path(tmp_path):
    path = tmp_path / "custom_scorers.py"
    path.write_text(CUSTOM_SCORERS)
    return path


def make_batch(tokenizer, texts, ground_truths, data_sources, response_len=12, eos=True, extra_infos=None):
    """Right-padded responses; each text is followed by EOS (inside the mask) when it fits."""
    responses = torch.full((len(texts), response_len), PAD, dtype=torch.long)
    response_mask = torch.zeros((len(texts), response_len), dtype=torch.long)
    for row, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([EOS] if eos else [])
        ids = ids[:response_len]
        responses[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[row, :len(ids)] = 1
    return Batch.from_dict(
        tensors={"responses": responses, "response_mask": response_mask},
        non_tensors={"data_source": data_sources, "ground_truth": ground_truths,
                     "extra_info": extra_infos or [{} for _ in texts]},
    )


def inline_manager(tokenizer, **overrides):
    return RewardManager(RewardConfig(**{"num_workers": 0, **overrides}), tokenizer)


def test_score_sits_on_the_last_response_token(byte_tokenizer):
    batch = make_batch(byte_tokenizer, ["#### 72", "#### 5", "", "#### 3"], ["72", "72", "1", "3"],
                       ["openai/gsm8k"] * 4, response_len=8)
    batch["response_mask"][2] = 0  # a row with no generated token
    output = inline_manager(byte_tokenizer).score(batch)
    expected = torch.zeros(4, 8)
    expected[0, 7] = 1.0  # "#### 72" is 7 tokens, then EOS at position 7
    expected[3, 6] = 1.0
    assert torch.equal(output.token_level_scores, expected)
    assert output.token_level_scores.dtype == torch.float32
    assert output.scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert output.extras["acc"] == [True, False, False, True]
    assert output.extras["pred"][:2] == ["72", "5"]
    assert output.metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/memory_exceeded": 0.0}


def test_decoding_skips_special_and_unmasked_tokens(byte_tokenizer, scorer_path):
    batch = make_batch(byte_tokenizer, ["4xy2"], ["42"], ["x"])  # 4 x y 2 <eos>, all in the mask
    batch["response_mask"][0, 1:3] = 0  # "xy": tool output inserted into the response
    output = inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:exact").score(batch)
    assert output.extras["pred"] == ["42"]
    assert output.token_level_scores[0].tolist() == [0.0] * 4 + [1.0] + [0.0] * 7


def test_each_data_source_gets_its_scorer(byte_tokenizer):
    batch = make_batch(byte_tokenizer, ["432", "<answer>3*8</answer>", "the answer is 5"],
                       ["432", {"target": 24, "numbers": [3, 8]}, "5"],
                       ["arithmetic", "countdown", "openai/gsm8k"], response_len=24)
    output = inline_manager(byte_tokenizer).score(batch)
    assert output.scores.tolist() == [1.0, 1.0, 0.0]
    flexible = inline_manager(byte_tokenizer, kwargs={"method": "flexible"}).score(batch)
    assert flexible.scores.tolist() == [1.0, 1.0, 1.0]


def test_unknown_data_source_and_option_are_refused(byte_tokenizer):
    batch = make_batch(byte_tokenizer, ["1"], ["1"], ["my/task"])
    with pytest.raises(ValueError, match="no scorer for data_source 'my/task'; known data sources: .*arithmetic, boxed, countdown"):
        inline_manager(byte_tokenizer).score(batch)
    with pytest.raises(ValueError, match="reward.kwargs has methd, which no scorer accepts; .*method"):
        inline_manager(byte_tokenizer, kwargs={"methd": "flexible"})
    with pytest.raises(ValueError, match="reward.kwargs sets ground_truth"):
        inline_manager(byte_tokenizer, kwargs={"ground_truth": 1})


def test_raising_scorer_gets_the_fallback_and_is_logged_once(byte_tokenizer, scorer_path, caplog):
    batch = make_batch(byte_tokenizer, ["raise", "7", "raise", "half"], ["7"] * 4, ["x"] * 4)
    manager = inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:exact", fallback_score=-1.0)
    with caplog.at_level(logging.WARNING, logger="reinforge.reward.manager"):
        output = manager.score(batch)
        manager.score(batch)
    assert output.scores.tolist() == [-1.0, 1.0, -1.0, 0.5]
    assert output.metrics["reward/errors"] == 2.0
    assert output.extras["pred"] == [None, "7", None, None]
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "scorer exploded" in warnings[0].getMessage() and "Traceback" in warnings[0].getMessage()


def test_a_non_score_counts_as_an_error(byte_tokenizer, scorer_path):
    batch = make_batch(byte_tokenizer, ["1", "2"], ["1", "2"], ["x", "x"])
    output = inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:exact").score(batch)
    assert output.metrics["reward/errors"] == 0.0
    with pytest.raises(ScorerFailure, match="returned a str"):
        inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:not_a_score").score(batch)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_batch_where_every_scorer_failed_stops_with_the_scorers_error(byte_tokenizer, scorer_path, num_workers):
    batch = make_batch(byte_tokenizer, ["raise", "raise"], ["7", "7"], ["x", "x"])
    config = RewardConfig(num_workers=num_workers, timeout_s=30, custom_function=f"{scorer_path}:exact")
    with RewardManager(config, byte_tokenizer) as manager, pytest.raises(ScorerFailure) as raised:
        manager.score(batch)
    message = str(raised.value)
    assert "\n" not in message and "failed on all 2 samples" in message
    assert "raised RuntimeError: scorer exploded" in message and f"{scorer_path}:exact" in message


def test_the_time_limit_holds_when_scoring_in_this_process(byte_tokenizer, scorer_path):
    batch = make_batch(byte_tokenizer, ["spin", "ok", "sleep"], ["x"] * 3, ["x"] * 3)
    manager = inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:slow", timeout_s=0.5,
                             fallback_score=-1.0)
    started = time.monotonic()
    output = manager.score(batch)
    assert time.monotonic() - started < 4.0
    assert output.scores.tolist() == [-1.0, 1.0, -1.0]
    assert output.metrics["reward/timeouts"] == 2.0


def test_custom_function_receives_data_source_extra_info_and_options(byte_tokenizer, scorer_path):
    batch = make_batch(byte_tokenizer, ["a", "b"], ["a", "b"], ["src/one", "src/two"],
                       extra_infos=[{"tag": 1}, {"tag": 2}])
    output = inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:with_source",
                            kwargs={"bonus": 0.5}).score(batch)
    assert output.scores.tolist() == [1.5, 1.5]
    assert output.extras == {"source": ["src/one", "src/two"], "tag": [1, 2]}
    merged = batch | output.to_batch()
    assert merged["token_level_scores"].shape == (2, 12)
    assert list(merged["reward_tag"]) == [1, 2]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_multi_turn_sample_has_num_turns_in_its_extra_info(byte_tokenizer, scorer_path, num_workers):
    batch = make_batch(byte_tokenizer, ["a", "b"], ["a", "b"], ["s", "s"], extra_infos=[{"tag": 1}, None])
    batch.non_tensors["num_turns"] = np.array([2, 5], dtype=object)
    with RewardManager(RewardConfig(num_workers=num_workers, custom_function=f"{scorer_path}:turns_penalised"),
                       byte_tokenizer) as manager:
        output = manager.score(batch)
    assert output.scores.tolist() == pytest.approx([-0.2, -0.5])
    assert output.extras["tag"] == [1, None]
    assert batch["extra_info"][0] == {"tag": 1}  # the row's own extra_info is left as it was


def test_missing_custom_file_or_function(byte_tokenizer, scorer_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        inline_manager(byte_tokenizer, custom_function=f"{tmp_path / 'nope.py'}:exact")
    with pytest.raises(AttributeError, match="has no function 'nope'"):
        inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:nope")


def test_worker_processes_score_built_in_and_custom_scorers(byte_tokenizer, scorer_path):
    batch = make_batch(byte_tokenizer, ["#### 72", "#### 5", "432"], ["72", "72", "432"],
                       ["openai/gsm8k", "openai/gsm8k", "arithmetic"])
    with RewardManager(RewardConfig(num_workers=2, timeout_s=30), byte_tokenizer) as manager:
        assert manager.score(batch).scores.tolist() == [1.0, 0.0, 1.0]
    custom = make_batch(byte_tokenizer, ["7", "raise"], ["7", "7"], ["x", "x"])
    config = RewardConfig(num_workers=2, timeout_s=30, custom_function=f"{scorer_path}:exact")
    with RewardManager(config, byte_tokenizer) as manager:
        output = manager.score(custom)
    assert output.scores.tolist() == [1.0, 0.0] and output.metrics["reward/errors"] == 1.0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_async_scorer_is_awaited_in_this_process_and_in_worker_processes(byte_tokenizer, scorer_path, num_workers):
    """``async def`` scorers (verl's and TRL's kinds) score like plain ones; a coroutine object was taken for the
    score (num_workers=0) or could not be sent back from a worker process (num_workers>0)."""
    batch = make_batch(byte_tokenizer, ["7", "8"], ["7", "7"], ["x", "x"])
    for function, extras in (("judged", {"judge": ["async", "async"]}), ("completions_judged", {})):
        config = RewardConfig(num_workers=num_workers, timeout_s=30, custom_function=f"{scorer_path}:{function}")
        with RewardManager(config, byte_tokenizer) as manager:
            output = manager.score(batch)
        assert output.scores.tolist() == [1.0, 0.0] and output.metrics["reward/errors"] == 0.0, function
        assert output.extras == extras


@pytest.mark.parametrize("num_workers", [0, 1])
def test_an_async_scorer_keeps_its_event_loop_from_call_to_call(byte_tokenizer, scorer_path, num_workers):
    """A client an async scorer keeps is bound to the event loop it was made on: each call awaited on a new loop
    failed from the second call on ("Event loop is closed"), every sample scored as an error."""
    batch = make_batch(byte_tokenizer, ["7", "8", "7"], ["7", "7", "7"], ["x", "x", "x"])
    config = RewardConfig(num_workers=num_workers, timeout_s=30,
                          custom_function=f"{scorer_path}:judged_by_a_kept_client")
    with RewardManager(config, byte_tokenizer) as manager:
        outputs = [manager.score(batch) for _ in range(2)]
    for output in outputs:
        assert output.scores.tolist() == [1.0, 0.0, 1.0] and output.metrics["reward/errors"] == 0.0


def test_timeouts_bound_wall_time_and_workers_are_replaced(byte_tokenizer, scorer_path, caplog):
    texts = ["sleep", "ok", "spin", "crash", "ok", "ok"]
    batch = make_batch(byte_tokenizer, texts, ["x"] * 6, ["x"] * 6)
    config = RewardConfig(num_workers=2, timeout_s=1.0, fallback_score=-1.0, custom_function=f"{scorer_path}:slow")
    with RewardManager(config, byte_tokenizer) as manager:
        manager.score(make_batch(byte_tokenizer, ["ok"], ["x"], ["x"]))  # workers started
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="reinforge.reward.manager"):
            output = manager.score(batch)
        elapsed = time.monotonic() - started
        assert output.scores.tolist() == [-1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
        assert output.metrics == {"reward/errors": 1.0, "reward/timeouts": 2.0, "reward/memory_exceeded": 0.0}
        assert elapsed < 6.0
        assert "timeout_s=1.0" in caplog.text and "scorer process died (exit code 3)" in caplog.text
        again = manager.score(make_batch(byte_tokenizer, ["ok", "ok"], ["x"] * 2, ["x"] * 2))
        assert again.scores.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("how", ["script", "code"])
def test_a_script_without_main_guard_scores_with_its_own_function_in_worker_processes(tmp_path, how):
    """The workers must not import the script again (it would start over inside each of them), and a function
    the script defines reaches them by value; ``python -c`` code, like a notebook's cell, has no file to import."""
    import subprocess
    import sys

    script = tmp_path / "train_without_guard.py"
    script.write_text("from reinforge.reward.scoring_pool import PickledFunction, ScoringPool, ScoringJob\n"
                      "print('script body ran', flush=True)\n"
                      "def doubled(completions, **kwargs):\n"
                      "    return [2.0 * len(completion) for completion in completions]\n"
                      "pool = ScoringPool(num_workers=2, timeout_s=30.0)\n"
                      "jobs = [ScoringJob(PickledFunction.of(doubled), {'completions': ['ab', 'c']}, num_samples=2),\n"
                      "        ScoringJob(PickledFunction.of(doubled), {'completions': ['abc']}, num_samples=1)]\n"
                      "print([result.value for result in pool.run(jobs)])\n")
    command = [str(script)] if how == "script" else ["-c", script.read_text()]
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["script body ran", "[[4.0, 2.0], [6.0]]"]


def test_multi_turn_response_is_scored_whole_with_tool_rewards_and_retool_shaping():
    from reinforge.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    # a response of 'ab' (sampled) + '12' (tool) + 'c' (sampled), padded; the scorer must see all of 'ab12c'
    ids = tokenizer("ab12c", add_special_tokens=False)["input_ids"]
    responses = torch.tensor([ids + [0], ids + [0]])
    response_mask = torch.tensor([[1, 1, 0, 0, 1, 0]] * 2, dtype=torch.float32)
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]] * 2)  # one prompt token, five response tokens
    seen = []

    def scorer(solution_str, ground_truth):
        seen.append(solution_str)
        return {"score": 1.0 if solution_str == ground_truth else 0.0, "acc": solution_str == ground_truth}

    batch = Batch.from_dict(
        tensors={"responses": responses, "response_mask": response_mask, "attention_mask": attention_mask},
        non_tensors={"ground_truth": ["ab12c", "nope"], "data_source": ["x", "x"],
                     "tool_rewards": [[0.25, 0.5], []], "num_turns": [6, 10]})
    manager = RewardManager(RewardConfig(num_workers=0, retool_wrong_answer=True), tokenizer, functions=[scorer])
    output = manager.score(batch)
    assert seen == ["ab12c", "ab12c"]
    assert output.scores.tolist() == pytest.approx([1.75, -0.6])  # right + tool rewards; wrong: min(-0.6, -0.6)
    assert output.token_level_scores[0].nonzero().flatten().tolist() == [4]  # the last sampled token
    batch["num_turns"] = [6, 4]
    assert manager.score(batch).scores.tolist() == pytest.approx([1.75, -0.9])


def test_a_numpy_bool_is_a_score():
    # a scorer returning `pred == gt` on numpy values gave np.bool_: "the scorer returned a bool_", every sample failed
    import numpy as np

    from reinforge.reward.manager import _unpack_score
    from reinforge.reward.scoring_pool import JobResult

    assert _unpack_score(JobResult(value=np.bool_(True))) == (1.0, {})
    assert _unpack_score(JobResult(value={"score": np.bool_(False), "acc": np.bool_(False)})) == (0.0, {"acc": False})
    # a one-element array (np.mean(..., keepdims=True), a 0-d array) is a score, as a one-element tensor is
    assert _unpack_score(JobResult(value=np.array(0.5))) == (0.5, {})
    assert _unpack_score(JobResult(value={"score": np.array([[0.25]], dtype=np.float32)})) == (0.25, {})
    with pytest.raises(TypeError, match="returned a ndarray"):
        _unpack_score(JobResult(value=np.array([0.5, 1.0])))


def test_a_scorer_past_max_memory_mb_gets_the_fallback_and_its_process_is_replaced(byte_tokenizer, scorer_path,
                                                                                   caplog):
    config = RewardConfig(num_workers=1, timeout_s=30, fallback_score=-1.0, max_memory_mb=300,
                          custom_function=f"{scorer_path}:leaky")
    with RewardManager(config, byte_tokenizer) as manager:
        with caplog.at_level(logging.WARNING, logger="reinforge.reward.manager"):
            output = manager.score(make_batch(byte_tokenizer, ["a"] * 12, ["x"] * 12, ["leaks"] * 12))
        scores = output.scores.tolist()
        # each call keeps 40 MB more: a few fit under 300 MB, the next one is stopped and a fresh process goes on
        assert 1 <= output.metrics["reward/memory_exceeded"] <= 3, scores
        first_failure = scores.index(-1.0)
        assert first_failure >= 3 and scores[first_failure + 1] == 1.0, scores
        assert output.metrics["reward/errors"] == 0.0
        assert "reward.max_memory_mb=300" in caplog.text and "'leaks'" in caplog.text
        one_allocation = manager.score(make_batch(byte_tokenizer, ["all at once", "a"], ["x"] * 2, ["x"] * 2))
        assert one_allocation.scores.tolist() == [-1.0, 1.0]
        assert one_allocation.metrics["reward/memory_exceeded"] == 1.0


def test_a_score_beyond_max_abs_score_is_warned_once(byte_tokenizer, scorer_path, caplog):
    manager = inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:huge")
    with caplog.at_level(logging.WARNING, logger="reinforge.reward.manager"):
        manager.score(make_batch(byte_tokenizer, ["ok", "ok"], ["x"] * 2, ["x"] * 2))
        assert not caplog.records
        for _ in range(3):
            manager.score(make_batch(byte_tokenizer, ["ok", "big"], ["x"] * 2, ["src"] * 2))
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "1e+30" in warnings[0] and "reward.max_abs_score=1e+06" in warnings[0] and "'src'" in warnings[0]
    quiet = inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:huge", max_abs_score=1e31)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="reinforge.reward.manager"):
        quiet.score(make_batch(byte_tokenizer, ["big"], ["x"], ["x"]))
    assert not caplog.records


def test_one_score_for_every_sample_batch_after_batch_is_warned_once(byte_tokenizer, scorer_path, caplog):
    from reinforge.reward.manager import CONSTANT_SCORE_BATCHES

    batch = make_batch(byte_tokenizer, ["a", "b", "c"], ["x"] * 3, ["flat"] * 3)
    manager = inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:length")
    with caplog.at_level(logging.WARNING, logger="reinforge.reward.manager"):
        for _ in range(CONSTANT_SCORE_BATCHES - 1):
            manager.score(batch)
        assert not caplog.records
        for _ in range(3):
            manager.score(batch)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert f"last {CONSTANT_SCORE_BATCHES} batches scored 1.0" in warnings[0] and "'flat'" in warnings[0]


def test_constant_scores_with_extras_or_a_varying_batch_are_not_warned_about(byte_tokenizer, scorer_path, caplog):
    from reinforge.reward.manager import CONSTANT_SCORE_BATCHES

    with_extras = inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:exact")  # returns a 'pred' extra
    flat = inline_manager(byte_tokenizer, custom_function=f"{scorer_path}:length")
    with caplog.at_level(logging.WARNING, logger="reinforge.reward.manager"):
        for step in range(2 * CONSTANT_SCORE_BATCHES - 1):
            with_extras.score(make_batch(byte_tokenizer, ["1", "2"], ["7"] * 2, ["x"] * 2))
            # one batch whose scores vary (1 and 2), in the middle, restarts the count
            texts = ["a", "bb"] if step == CONSTANT_SCORE_BATCHES - 1 else ["a", "b"]
            flat.score(make_batch(byte_tokenizer, texts, ["x"] * 2, ["x"] * 2))
    assert not caplog.records


@pytest.mark.parametrize(("overrides", "message"), [
    (["reward.max_memory_mb=16"], r"reward.max_memory_mb=16 is too little for a scoring process .* at least 128, "
                                  r"or null for no cap"),
    (["reward.max_abs_score=nan"], r"reward.max_abs_score=nan must be a finite number >= 0"),
])
def test_reward_limits_that_cannot_work_are_refused_before_loading(overrides, message):
    from reinforge.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    assert load_config(None, ["reward.max_memory_mb=null"]).reward.max_memory_mb is None


def length_reward(completions, completion_ids, **kwargs):
    """TRL's kind: one call per batch (in chunks across workers), returning one score per completion."""
    return [float(len(ids)) for ids in completion_ids]


def exact_or_none(completions, ground_truth, **kwargs):
    return [None if truth == "skip" else float(completion == truth) for completion, truth in zip(completions, ground_truth, strict=True)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_trl_functions_are_called_once_per_batch_and_weighted_with_none_left_out(byte_tokenizer, num_workers):
    calls = []

    def counted(completions, prompts, trainer_state, **kwargs):
        calls.append((len(completions), trainer_state.global_step))
        return [1.0] * len(completions)

    batch = make_batch(byte_tokenizer, ["7", "8", "77", "9"], ["7", "7", "skip", "skip"], ["x"] * 4)
    batch["raw_prompt"] = ["q"] * 4
    batch.meta["trainer_state"] = {"global_step": 3, "max_steps": 10}
    functions = [exact_or_none, length_reward] + ([counted] if num_workers == 0 else [])
    weights = [2.0, 0.5] + ([0.0] if num_workers == 0 else [])
    config = RewardConfig(num_workers=num_workers, timeout_s=30, weights=weights)
    with RewardManager(config, byte_tokenizer, functions=functions) as manager:
        output = manager.score(batch)
    # exact: 1, 0, None, None (x2); length (EOS included): 2, 2, 3, 2 (x0.5)
    assert output.scores.tolist() == [3.0, 1.0, 1.5, 1.0]
    assert output.function_scores["rewards/exact_or_none"][:2] == [1.0, 0.0]
    assert all(value != value for value in output.function_scores["rewards/exact_or_none"][2:])  # NaN: not applicable
    assert output.function_scores["rewards/length_reward"] == [2.0, 2.0, 3.0, 2.0]
    if num_workers == 0:
        assert calls == [(4, 3)]  # one call for the whole batch, with the trainer's step
    from reinforge.reward.reward_functions import function_metrics

    metrics = function_metrics(output.to_batch().non_tensors)
    assert metrics["rewards/exact_or_none/mean"] == 0.5 and metrics["rewards/length_reward/mean"] == 2.25
    assert metrics["rewards/exact_or_none/std"] == pytest.approx(2 ** -0.5)


def test_functions_that_score_no_sample_of_a_batch_are_warned_about_once(byte_tokenizer, caplog):
    def never_applies(completions, **kwargs):
        return [None] * len(completions)

    batch = make_batch(byte_tokenizer, ["7", "8"], ["7", "7"], ["x"] * 2)
    batch["raw_prompt"] = ["q"] * 2
    with (RewardManager(RewardConfig(num_workers=0), byte_tokenizer, functions=[never_applies]) as manager,
          caplog.at_level(logging.WARNING, logger="reinforge.reward.manager")):
        for _ in range(2):
            assert manager.score(batch).scores.tolist() == [0.0, 0.0]
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "every reward function returned None" in warnings[0] and "\n" not in warnings[0]


def test_samples_no_function_scores_are_warned_about_once_where_others_are_scored(byte_tokenizer, caplog):
    """TRL warns where every function returned None for a sample: such a sample scores 0 as if it were wrong."""
    batch = make_batch(byte_tokenizer, ["7", "8", "9"], ["7", "skip", "skip"], ["x"] * 3)
    batch["raw_prompt"] = ["q"] * 3
    with (RewardManager(RewardConfig(num_workers=0), byte_tokenizer, functions=[exact_or_none]) as manager,
          caplog.at_level(logging.WARNING, logger="reinforge.reward.manager")):
        for _ in range(2):
            assert manager.score(batch).scores.tolist() == [1.0, 0.0, 0.0]
    [warning] = [record.getMessage() for record in caplog.records]
    assert warning.startswith("every reward function returned None (does not apply) for 2 of 3 samples")


def logging_reward(completions, trainer_state, log_metric, log_extra, **kwargs):
    """What TRL 1.16 gives a reward function besides the rows: log_metric, log_extra and its TrainerState."""
    log_metric("completions/chars", sum(len(completion) for completion in completions) / len(completions))
    log_extra("length", [len(completion) for completion in completions])
    last_logged = trainer_state.log_history[-1]
    return [trainer_state.global_step + trainer_state.epoch + last_logged["step"]] * len(completions)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_trl_function_logs_metrics_and_extras_and_reads_trls_trainer_state(byte_tokenizer, tmp_path, num_workers):
    from reinforge.reward.reward_functions import function_metrics

    metrics_file = tmp_path / "metrics.jsonl"
    metrics_file.write_text('{"step": 1, "critic/score/mean": 0.0}\n{"step": 2, "critic/score/mean": 1.0}\n')
    batch = make_batch(byte_tokenizer, ["7", "88", "777", "9"], ["7"] * 4, ["x"] * 4)
    batch["raw_prompt"] = ["q"] * 4
    batch.meta["trainer_state"] = {"global_step": 4, "max_steps": 10, "epoch": 0.5, "metrics_file": str(metrics_file),
                                   "optimizer_steps_per_step": 2}
    with RewardManager(RewardConfig(num_workers=num_workers, timeout_s=30), byte_tokenizer,
                       functions=[logging_reward]) as manager:
        output = manager.score(batch)
    assert output.scores.tolist() == [8.5] * 4  # 4 optimizer steps, half an epoch, the last row's step 2 x 2
    assert output.extras["length"] == [1, 2, 3, 1]
    assert output.metrics["reward/errors"] == 0.0
    # one call (1.75), or two of two samples (1.5 and 2.0): the step's metric is their mean, under its own name
    assert function_metrics(output.to_batch().non_tensors)["completions/chars"] == pytest.approx(1.75)


def test_a_failed_batch_call_fails_each_of_its_samples_counted_and_named_once(byte_tokenizer, caplog):
    def breaks_on_eight(completions, **kwargs):
        if "8" in completions:
            raise RuntimeError("judge unreachable")
        return [1.0] * len(completions)

    config = RewardConfig(num_workers=0, fallback_score=-1.0, weights=[1.0, 1.0])
    manager = RewardManager(config, byte_tokenizer, functions=[breaks_on_eight, length_reward])
    with caplog.at_level(logging.WARNING, logger="reinforge.reward.manager"):
        ok = manager.score(make_batch(byte_tokenizer, ["7", "9"], ["7", "7"], ["x"] * 2))
        with pytest.raises(ScorerFailure, match="reward function breaks_on_eight failed on all 2 samples.*"
                                                "raised RuntimeError: judge unreachable"):
            manager.score(make_batch(byte_tokenizer, ["7", "8"], ["7", "7"], ["x"] * 2))
    assert ok.scores.tolist() == [3.0, 3.0] and ok.metrics["reward/errors"] == 0.0
    pool_config = RewardConfig(num_workers=2, timeout_s=30, fallback_score=-1.0)
    with RewardManager(pool_config, byte_tokenizer, functions=[breaks_on_eight]) as pooled, \
            caplog.at_level(logging.WARNING, logger="reinforge.reward.manager"):
        output = pooled.score(make_batch(byte_tokenizer, ["7", "8", "9", "6"], ["7"] * 4, ["x"] * 4))
    assert output.scores.tolist() == [-1.0, -1.0, 1.0, 1.0]  # the chunk holding "8" failed as a whole
    assert output.metrics["reward/errors"] == 2.0
    warnings = [record.getMessage() for record in caplog.records if "breaks_on_eight" in record.getMessage()]
    assert len(warnings) == 1 and "failed on a batch call of 2 samples" in warnings[0]


def test_a_batch_call_has_the_per_sample_time_limit_once_per_sample(byte_tokenizer):
    def slow_batch(completions, **kwargs):
        time.sleep(0.3 * len(completions))  # 0.3 s a sample: within 0.5 s a sample
        return [1.0] * len(completions)

    def stuck(completions, **kwargs):
        time.sleep(60)

    batch = make_batch(byte_tokenizer, ["1", "2", "3", "4"], ["1"] * 4, ["x"] * 4)
    manager = RewardManager(RewardConfig(num_workers=0, timeout_s=0.5), byte_tokenizer, functions=[slow_batch])
    assert manager.score(batch).scores.tolist() == [1.0] * 4
    started = time.monotonic()
    stopped = RewardManager(RewardConfig(num_workers=0, timeout_s=0.25, fallback_score=-1.0), byte_tokenizer,
                            functions=[stuck, slow_batch])
    with pytest.raises(ScorerFailure, match="reward function stuck failed on all 4 samples .*4 timed out"):
        stopped.score(batch)
    assert time.monotonic() - started < 3.0


def test_reward_weights_must_match_the_functions(byte_tokenizer):
    with pytest.raises(ValueError, match=r"reward.weights=\[1.0\] has 1 weights for 2 reward functions"):
        RewardManager(RewardConfig(num_workers=0, weights=[1.0]), byte_tokenizer,
                      functions=[length_reward, exact_or_none])
    with pytest.raises(TypeError, match="a reward function must be callable; got a str"):
        RewardManager(RewardConfig(num_workers=0), byte_tokenizer, functions=["reward.py:fn"])


def test_a_verl_kind_function_object_is_sent_to_the_worker_processes_by_value(byte_tokenizer):
    bonus = 0.25  # a closure: only pickling by value gets it there

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return {"score": float(solution_str == ground_truth) + bonus, "source": data_source}

    batch = make_batch(byte_tokenizer, ["7", "8"], ["7", "7"], ["x", "y"])
    with RewardManager(RewardConfig(num_workers=1, timeout_s=30), byte_tokenizer, functions=[compute_score]) as manager:
        output = manager.score(batch)
    assert output.scores.tolist() == [1.25, 0.25] and output.extras == {"source": ["x", "y"]}
    assert output.function_scores == {"rewards/compute_score": [1.25, 0.25]}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_several_functions_from_files_are_summed_with_their_weights(byte_tokenizer, scorer_path, num_workers):
    batch = make_batch(byte_tokenizer, ["7", "88"], ["7", "7"], ["x", "x"])
    config = RewardConfig(num_workers=num_workers, timeout_s=30, weights=[1.0, 0.5],
                          functions=[f"{scorer_path}:exact", f"{scorer_path}:completions_judged"])
    with RewardManager(config, byte_tokenizer) as manager:
        output = manager.score(batch)
    assert output.scores.tolist() == [1.5, 0.0]  # exact: 1, 0; completions_judged (x0.5): 1, 0
    assert output.function_scores == {"rewards/exact": [1.0, 0.0], "rewards/completions_judged": [1.0, 0.0]}
    with pytest.raises(ValueError, match="reward.custom_function=.* and reward.functions=.* are both set"):
        RewardManager(RewardConfig(num_workers=0, custom_function=f"{scorer_path}:exact",
                                   functions=[f"{scorer_path}:length"]), byte_tokenizer)


def test_a_batch_calls_scores_are_numbers_not_strings_that_read_as_numbers():
    from reinforge.reward.reward_functions import batch_scores

    assert batch_scores([np.float32(0.5), np.array(1.0), True, None], "f")[:3] == [0.5, 1.0, 1.0]
    with pytest.raises(TypeError, match="reward function f returned a str in its list; return one float"):
        batch_scores([1.0, "42"], "f")  # an extracted answer returned in place of its score


def test_padding_rows_are_not_scored_counted_or_checked(byte_tokenizer):
    """The last ``padding_rows`` rows (copies a split over several workers adds) reach no scorer, count in no metric,
    and cannot make a batch "all failed"; each gets a placeholder row (score 0, no extras, no failure)."""
    calls: list[str] = []

    def scorer(solution_str, ground_truth, extra_info=None):
        calls.append(solution_str)
        if solution_str == "raise":
            raise RuntimeError("scorer exploded")
        return {"score": 1.0, "acc": True}

    manager = RewardManager(RewardConfig(num_workers=0), byte_tokenizer, functions=[scorer])
    batch = make_batch(byte_tokenizer, ["ok", "raise", "raise"], ["1"] * 3, ["x"] * 3)
    output = manager.score(batch, padding_rows=1)
    assert calls == ["ok", "raise"] and output.failures == [None, "error", None]
    assert output.metrics["reward/errors"] == 1 and output.extras == {"acc": [True, None, None]}
    assert output.token_level_scores.shape == (3, 12) and output.scores.tolist() == [1.0, 0.0, 0.0]
    assert np.isnan(output.function_scores["rewards/scorer"][1:]).all()
    with pytest.raises(ScorerFailure, match="failed on all 1 samples"):
        manager.score(batch.index([1, 0, 0]), padding_rows=2)
    with pytest.raises(ValueError, match="padding_rows=4 of a batch of 3 rows"):
        manager.score(batch, padding_rows=4)
