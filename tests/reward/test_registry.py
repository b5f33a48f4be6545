import pytest

from reinforge.reward import SCORERS, get_scorer, register_scorer
from reinforge.reward.scorers.countdown import score_countdown
from reinforge.reward.scorers.gsm8k import score_gsm8k
from reinforge.reward.scorers.math_answer import score_math
from reinforge.reward.scorers.math_dapo import score_math_dapo


def test_built_in_data_sources():
    assert get_scorer("openai/gsm8k") is score_gsm8k
    assert get_scorer("lighteval/MATH") is get_scorer("HuggingFaceH4/MATH-500") is score_math
    assert get_scorer("countdown") is score_countdown
    assert "arithmetic" in SCORERS


def test_dapo_sources_are_routed_as_verl_routes_them():
    for data_source in ("math_dapo", "math", "math_dapo_reasoning", "aime", "aime24", "aime_2025"):
        assert get_scorer(data_source) is score_math_dapo
    with pytest.raises(ValueError, match="no scorer for data_source 'daime'"):
        get_scorer("daime")


def test_unknown_data_source_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"no scorer for data_source 'nope'; known data sources: .*arithmetic, boxed, "
                                         r"countdown.*openai/gsm8k"):
        get_scorer("nope")
    with pytest.raises(ValueError, match="a sample has no data_source"):
        get_scorer(None)


def test_register_and_refuse_duplicates():
    @register_scorer("test/echo")
    def score_echo(solution_str, ground_truth, extra_info=None):
        return float(solution_str == ground_truth)

    try:
        assert get_scorer("test/echo") is score_echo
        with pytest.raises(ValueError, match="'test/echo' is registered twice"):
            register_scorer("test/echo")(score_echo)
    finally:
        SCORERS.pop("test/echo")
