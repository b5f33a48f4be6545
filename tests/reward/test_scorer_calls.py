import pytest

from reinforge.reward.scorer_calls import accepted_keywords, build_call_kwargs, load_custom_scorer

SCORER_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "source": data_source}

def helper(x):
    return x

NOT_A_FUNCTION = 3

def needs_more(solution_str, ground_truth, tokenizer):
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


def test_load_errors_are_clear(scorer_file, tmp_path):
    with pytest.raises(ValueError, match="must look like path/to/file.py:function_name"):
        load_custom_scorer(str(scorer_file))
    with pytest.raises(FileNotFoundError, match="file '.*missing.py' does not exist"):
        load_custom_scorer(f"{tmp_path / 'missing.py'}:compute_score")
    with pytest.raises(AttributeError, match="has no function 'score'; it defines: compute_score, helper, needs_more"):
        load_custom_scorer(f"{scorer_file}:score")
    with pytest.raises(TypeError, match="'NOT_A_FUNCTION' .* is a int, not a function"):
        load_custom_scorer(f"{scorer_file}:NOT_A_FUNCTION")
    with pytest.raises(TypeError, match="takes an argument 'tokenizer' that reinforge cannot pass"):
        load_custom_scorer(f"{scorer_file}:needs_more")


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
