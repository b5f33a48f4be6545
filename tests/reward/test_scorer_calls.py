import pytest

from reinforge.reward.scorer_calls import (
    accepted_keywords,
    build_call_kwargs,
    completion_of,
    load_custom_scorer,
    parse_custom_function,
    takes_completions,
)
from reinforge.reward.scoring_pool import ScoringJob, run_job

SCORER_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "source": data_source}

def helper(x):
    return x

NOT_A_FUNCTION = 3

def needs_more(solution_str, ground_truth, tokenizer):
    return 0.0

def by_position(solution_str, ground_truth, /):
    return 0.0

def no_response(ground_truth):
    return 0.0
'''


@pytest.fixture
def scorer_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(SCORER_FILE)
    return path


def test_load_and_call_a_verl_style_function(scorer_file):
    fn = load_custom_scorer(f"{scorer_file}:compute_score")
    kwargs = build_call_kwargs(accepted_keywords(fn), " 42", "42", {"i": 1}, "my/source", {})
    assert fn(**kwargs) == {"score": 1.0, "source": "my/source"}


def test_a_file_without_function_name_means_compute_score(scorer_file):
    """As in verl: reward.custom_function=path.py is path.py:compute_score."""
    assert load_custom_scorer(str(scorer_file)).__name__ == "compute_score"
    assert parse_custom_function("dir/my_reward.py") == ("dir/my_reward.py", "compute_score")
    assert parse_custom_function("dir/my_reward.py:score") == ("dir/my_reward.py", "score")
    assert parse_custom_function("C:/rewards/my_reward.py") == ("C:/rewards/my_reward.py", "compute_score")
    with pytest.raises(ValueError, match=r"reward.custom_function=':score' must look like path/to/file.py or "):
        parse_custom_function(":score")
    with pytest.raises(ValueError, match=r"'compute-score' is not a Python function name; write .*:function_name"):
        parse_custom_function(f"{scorer_file}:compute-score")


def test_load_errors_are_clear(scorer_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="file '.*missing.py' does not exist"):
        load_custom_scorer(f"{tmp_path / 'missing.py'}:compute_score")
    with pytest.raises(AttributeError, match="has no function 'score'; it defines: by_position, compute_score, helper, "
                                             "needs_more, no_response"):
        load_custom_scorer(f"{scorer_file}:score")
    with pytest.raises(TypeError, match="'NOT_A_FUNCTION' .* is a int, not a function"):
        load_custom_scorer(f"{scorer_file}:NOT_A_FUNCTION")
    with pytest.raises(TypeError, match="takes 'solution_str' by position only; reinforge passes every argument by "
                                        "keyword, so remove the '/'"):
        load_custom_scorer(f"{scorer_file}:by_position")
    with pytest.raises(TypeError, match="takes neither 'solution_str' .* nor 'completions'"):
        load_custom_scorer(f"{scorer_file}:no_response")
    # an argument we do not pass may be a dataset column: the rows are checked against it when the data loads
    assert load_custom_scorer(f"{scorer_file}:needs_more").__name__ == "needs_more"


def test_arguments_follow_the_signature():
    def plain(solution_str, ground_truth):
        return 0.0

    def with_options(solution_str, ground_truth, extra_info=None, *, method="strict"):
        return 0.0

    def anything(solution_str, ground_truth, **kwargs):
        return 0.0

    options = {"method": "flexible"}
    assert build_call_kwargs(accepted_keywords(plain), "s", "g", {}, "d", options) == \
        {"solution_str": "s", "ground_truth": "g"}
    assert build_call_kwargs(accepted_keywords(with_options), "s", "g", {}, "d", options) == \
        {"solution_str": "s", "ground_truth": "g", "extra_info": {}, "method": "flexible"}
    assert build_call_kwargs(accepted_keywords(anything), "s", "g", None, "d", options) == \
        {"solution_str": "s", "ground_truth": "g", "extra_info": None, "data_source": "d", "method": "flexible"}


def test_trl_kind_gets_one_call_with_lists_of_the_batch_and_the_columns():
    from reinforge.reward.reward_functions import RewardFunction, TrainerState, batch_call_kwargs

    def trl_reward(completions, answer, completion_ids, trainer_state, **kwargs):
        texts = [completion if isinstance(completion, str) else completion[0]["content"] for completion in completions]
        return [float(text == answer_) for text, answer_ in zip(texts, answer, strict=True)]

    assert takes_completions(trl_reward) and takes_completions(lambda prompts, **kwargs: None)
    assert not takes_completions(lambda solution_str, completions=None: 0.0)
    prompt = [{"role": "user", "content": "2+2?"}]
    samples = {"texts": ["4", "5", "6"], "completion_ids": [[52], [53], [54]], "prompts": [prompt, prompt, "3+3="],
               "ground_truths": [None, None, "6"], "extra_infos": [{"i": 0}, {"i": 1}, {}],
               "data_sources": ["math"] * 3, "columns": [{"answer": "4"}, {"answer": "4"}, {"answer": "6"}]}
    state = TrainerState(global_step=3, max_steps=10)
    kwargs = batch_call_kwargs(RewardFunction.of(trl_reward), range(3), samples, {"scale": 2}, state)
    assert kwargs == {"completions": [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}],
                                      "6"],
                      "prompts": [prompt, prompt, "3+3="], "completion_ids": [[52], [53], [54]],
                      "ground_truth": [None, None, "6"], "extra_info": [{"i": 0}, {"i": 1}, {}],
                      "data_source": ["math"] * 3, "answer": ["4", "4", "6"], "trainer_state": state, "scale": 2}
    assert run_job(ScoringJob(trl_reward, kwargs, num_samples=3)) == [1.0, 0.0, 1.0]
    prefilled = [*prompt, {"role": "assistant", "content": "It is "}]  # continued, as TRL's bootstrap
    assert completion_of("4", prefilled) == [{"role": "assistant", "content": "It is 4"}]
    named = batch_call_kwargs(RewardFunction.of(lambda completions, answer: None), range(1, 3), samples, {}, state)
    assert named == {"completions": [[{"role": "assistant", "content": "5"}], "6"], "answer": ["4", "6"]}
    with pytest.raises(TypeError, match=r"returned 1.0 for 3 completions; return a list with one score \(or None\)"):
        run_job(ScoringJob(lambda completions, **kwargs: 1.0, kwargs, num_samples=3))
    import numpy as np
    import torch

    for scores in (np.array([1.0, 0.0, 2.0]), torch.tensor([1.0, 0.0, 2.0])):  # TRL takes any sequence of scores
        assert run_job(ScoringJob(lambda completions, scores=scores, **kwargs: scores, kwargs, num_samples=3)) == [
            1.0, 0.0, 2.0]
    with pytest.raises(TypeError, match=r"returned \[1.0, 0.0\] for 3 completions"):
        run_job(ScoringJob(lambda completions, **kwargs: np.array([1.0, 0.0]), kwargs, num_samples=3))


def test_verl_kind_gets_the_columns_it_names():
    def by_column(solution_str, answer, data_source=None):
        return float(solution_str == answer)

    kwargs = build_call_kwargs(accepted_keywords(by_column), "7", None, None, "d", {},
                               columns={"answer": "7", "unused": 1})
    assert kwargs == {"solution_str": "7", "answer": "7", "data_source": "d"}


def test_a_reward_file_that_exits_at_import_is_an_import_error_not_an_exit(tmp_path):
    """A module-level sys.exit() or argparse would end reinforge with its exit code (0) and no word."""
    path = tmp_path / "exits.py"
    path.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ImportError, match=r"importing .*exits.py failed: SystemExit: 0"):
        load_custom_scorer(f"{path}:compute_score")


def test_a_folder_given_as_the_reward_file_is_named_a_folder(tmp_path):
    (tmp_path / "rewards").mkdir()  # it was "file '.../rewards' does not exist"
    with pytest.raises(FileNotFoundError, match=r"^reward.custom_function: '.*rewards' is a folder; give the Python file "
                                                r"that defines the function, e.g. .*rewards/reward.py\[:function\]$"):
        load_custom_scorer(str(tmp_path / "rewards"))


def test_without_cloudpickle_an_importable_function_still_travels_and_a_local_one_is_named(monkeypatch):
    import sys

    from reinforge.reward.scoring_pool import PickledFunction

    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # import cloudpickle now raises ImportError
    sent = PickledFunction.of(build_call_kwargs)
    assert run_job(ScoringJob(sent, {"accepted": None, "solution_str": "s", "ground_truth": "g", "extra_info": None,
                                     "data_source": "d", "options": {}})) == \
        {"solution_str": "s", "ground_truth": "g", "extra_info": None, "data_source": "d"}

    def local_reward(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ImportError, match="local_reward is defined in the script or a notebook.*pip install cloudpickle"):
        PickledFunction.of(local_reward)
