import pytest

from reinforge.reward.scorers.arithmetic import score_arithmetic
from reinforge.reward.scorers.countdown import evaluate_equation, score_countdown
from reinforge.reward.scorers.gsm8k import extract_gsm8k_answer, score_gsm8k
from reinforge.reward.scorers.math_answer import score_math
from reinforge.reward.scorers.math_dapo import normalize_final_answer, score_math_dapo


# Golden cases worked out from verl's gsm8k scorer: one space after ####, the text compared as text, the last
# 300 characters searched.
@pytest.mark.parametrize(("response", "strict", "flexible"), [
    ("48 / 2 = 24, 48 + 24 = 72.\n#### 72", "72", "72"),
    ("The total is 1,234.\n#### 1,234", "1234", "1,234"),
    ("#### 5 then I changed my mind #### 7", "7", "7"),
    ("The answer is 72.", None, "72."),
    ("I do not know", None, None),
    ("I do not know.", None, "."),
    ("#### -3.5", "-3.5", "-3.5"),
    ("#### $72", None, "72"),
    ("####72", None, "72"),
    ("#### 72.0", "72.0", "72.0"),
    ("the sum is 72, so . .", None, "72,"),
    ("dots only: . .", None, "."),
    ("#### 72" + " and then some padding" * 15, None, None),
    ("#### 71 " + "x" * 300 + " #### 72", "72", "72"),
])
def test_gsm8k_extraction_as_verl(response, strict, flexible):
    assert extract_gsm8k_answer(response, "strict") == strict
    assert extract_gsm8k_answer(response, "flexible") == flexible


def test_gsm8k_scores_as_verl():
    assert score_gsm8k("so #### 72", "72") == {"score": 1.0, "acc": True, "pred": "72"}
    assert score_gsm8k("so #### 72.0", "72") == {"score": 0.0, "acc": False, "pred": "72.0"}
    assert score_gsm8k("so #### 72.0", "72", format_score=0.1)["score"] == 0.1  # an answer, a wrong one
    assert score_gsm8k("so #### $72", "72", format_score=0.1)["score"] == 0.0  # no answer at all
    assert score_gsm8k("so #### 1,234", "1234")["score"] == 1.0
    assert score_gsm8k("so #### 71", "72") == {"score": 0.0, "acc": False, "pred": "71"}
    assert score_gsm8k("so #### 72", "72", score=2.0)["score"] == 2.0
    assert score_gsm8k("the answer is 72", "72")["score"] == 0.0
    assert score_gsm8k("the answer is 72", "72", method="flexible")["score"] == 1.0
    assert score_gsm8k("the answer is 72.", "72", method="flexible")["score"] == 0.0
    assert score_gsm8k("72, or maybe 73", "72", method="flexible")["score"] == 0.0
    assert score_gsm8k("#### 72" + "x" * 300, "72")["score"] == 0.0  # beyond the 300-character clip
    assert score_gsm8k("so #### 72", 72)["score"] == 1.0  # a numeric ground truth compares as its text
    with pytest.raises(ValueError, match="not a gsm8k method"):
        score_gsm8k("#### 1", "1", method="lenient")


# Golden cases worked out from verl's math_dapo scorer: the last "Answer:" line of the last 300 characters,
# both sides normalised, +1 or -1.
@pytest.mark.parametrize(("response", "ground_truth", "score", "pred"), [
    ("6 * 7 = 42, so\nAnswer: 42", "42", 1.0, "42"),
    ("Answer: $42$", "42", 1.0, "42"),
    ("answer : \\boxed{42}", "42", 1.0, "42"),
    ("ANSWER: 5 dollars", "5", 1.0, "5"),
    ("Answer: \\text{12 cm}", "12", 1.0, "12"),
    ("Answer: x = 3", "3", 1.0, "3"),
    ("Answer: 1,000", "1000", 1.0, "1000"),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
    ("Answer: \\sqrt2", "\\sqrt{2}", 1.0, "\\sqrt{2}"),
    ("Answer: 10^\\circ", "10", 1.0, "10"),
    ("Answer: 7\nAnswer: 8", "8", 1.0, "8"),
    ("Answer: 42", 42, 1.0, "42"),
    ("Answer: 3.", "3", -1.0, "3."),
    ("Answer: 41", "42", -1.0, "41"),
    ("so the answer is \\boxed{42}", "42", -1.0, "[INVALID]"),
    ("Answer: 42" + "x" * 300, "42", -1.0, "[INVALID]"),
    ("x" * 500 + "\nAnswer: 42", "42", 1.0, "42"),
])
def test_math_dapo_as_verl(response, ground_truth, score, pred):
    assert score_math_dapo(response, ground_truth) == {"score": score, "acc": score == 1.0, "pred": pred}


def test_math_dapo_strict_box_verify_compares_the_last_box_unnormalised():
    assert score_math_dapo("so \\boxed{42}", "42", strict_box_verify=True)["score"] == 1.0
    assert score_math_dapo("so \\boxed{42.}", "42", strict_box_verify=True)["score"] == -1.0
    assert score_math_dapo("\\boxed{42}" + "x" * 100, "42", strict_box_verify=True)["score"] == -1.0
    assert score_math_dapo("Answer: 42", "42", strict_box_verify=True) == {"score": -1.0, "acc": False, "pred": None}


def test_normalize_final_answer():
    assert normalize_final_answer("The total is $\\$1,234$.") == "1234"
    assert normalize_final_answer("\\text{(A)}") == "(A)"
    assert normalize_final_answer("\\fracab") == "\\frac{a}{b}"


@pytest.mark.parametrize(("response", "ground_truth", "expected"), [
    ("so the answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
    ("so the answer is $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
    ("The final answer is $\\boxed{2\\sqrt{2}}$.", "\\sqrt{8}", 1.0),
    ("We get $\\boxed{x^2 + 2x + 1}$", "(x+1)^2", 1.0),
    ("so the answer is $\\boxed{3}$", "\\frac{1}{2}", 0.0),
    ("I give up.", "5", 0.0),
])
def test_math_uses_math_verify_equivalence(response, ground_truth, expected):
    result = score_math(response, ground_truth)
    assert result["score"] == expected and result["acc"] == (expected == 1.0)


COUNTDOWN = {"target": 24, "numbers": [3, 5, 8]}


@pytest.mark.parametrize(("response", "score"), [
    ("<think>3*8=24 but 5?</think><answer>(5 - 3) * 8 + 8</answer>", 0.1),  # 8 used twice
    ("<answer>(8 - 5) * 3</answer>", 0.1),  # 9, not 24
    ("<answer>3 * 8</answer>", 0.1),  # 5 unused
    ("<answer>(5 - 3 + 1) * 8</answer>", 0.1),  # 1 is not given
    ("<answer>8 * (5 - 3 / 3)</answer>", 0.1),
    ("<answer>__import__('os').system('true')</answer>", 0.1),
    ("<answer>3 / (5 - 5) + 8</answer>", 0.1),
    ("no answer tags: 8 * 3 = 24", 0.0),
    ("<answer>8 * 3 * (5 / 5)</answer>", 0.1),
    ("<answer>wrong</answer> then <answer>8 * (5 - 3) + 8</answer>", 0.1),
])
def test_countdown_misses(response, score):
    assert score_countdown(response, COUNTDOWN)["score"] == score


def test_countdown_hits():
    assert score_countdown("<answer>8 * 3 * 5 / 5</answer>", {"target": 24, "numbers": [3, 5, 5, 8]})["score"] == 1.0
    assert score_countdown("<answer>(8 - 5) * 8 = 24</answer>", {"target": 24, "nums": [8, 5, 8]}) == \
        {"score": 1.0, "acc": True, "pred": "(8 - 5) * 8"}
    assert score_countdown("<answer>3 * 8 - 5 + 5</answer>", {"target": 24, "numbers": [5, 8, 5, 3]})["score"] == 1.0
    assert score_countdown("<answer>(3 + 5) / 8</answer>", {"target": 1, "numbers": [3, 5, 8]})["score"] == 1.0


def test_countdown_evaluates_exactly_without_eval():
    value, used = evaluate_equation("(1 + 2) / 3 * 7")
    assert value == 7 and used == [1, 2, 3, 7]
    for not_an_equation in ["2 ** 10", "abs(3)", "3 if 1 else 2", "1.5 + 2", "-3 + 4", "[1, 2]", "(" * 300]:
        with pytest.raises(ValueError):
            evaluate_equation(not_an_equation)


def test_countdown_needs_a_target_and_numbers():
    with pytest.raises(ValueError, match="'target' and 'numbers'"):
        score_countdown("<answer>1</answer>", "24")


@pytest.mark.parametrize(("response", "ground_truth", "score"), [
    ("432", "432", 1.0),
    (" 432.\n", "432", 1.0),
    ("47 + 385 = 432", "432", 1.0),
    ("1,432", "1432", 1.0),
    ("-12", "-12", 1.0),
    ("433", "432", 0.0),
    ("432 and then 5", "432", 0.0),
    ("I think it is four hundred", "432", 0.0),
    ("432", 432.0, 1.0),  # a parquet column of integers with a gap is float; int("432.0") failed every sample
    ("1432", "1,432", 1.0),
])
def test_arithmetic_exact_integer(response, ground_truth, score):
    assert score_arithmetic(response, ground_truth)["score"] == score


def test_boxed_scorer_reads_the_last_complete_box():
    from reinforge.reward.scorers.boxed import last_boxed, score_boxed

    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}} and \\boxed{3") == "\\frac{1}{2}"
    assert last_boxed("no box") is None
    # unclosed boxes: the last complete one, found in time linear in the text (20,000 open boxes took minutes)
    assert last_boxed("\\boxed{" * 20000) is None
    assert last_boxed("\\boxed{7} " + "\\boxed{" * 20000) == "7"
    assert last_boxed("\\boxed{x \\boxed{y }") == "y " and last_boxed("\\boxed{a \\boxed{b} c}") == "b"
    assert last_boxed("\\boxed{x \\boxed{y ") is None and last_boxed("\\boxed{1} \\boxed{x \\boxed{y ") == "1"
    assert score_boxed("first \\boxed{5}, corrected: \\boxed{1,000}.", "1000") == {
        "score": 1.0, "acc": True, "pred": "1000"}
    assert score_boxed("\\boxed{$72.00$}", 72)["acc"] is True
    assert score_boxed("\\boxed{71}", "72") == {"score": 0.0, "acc": False, "pred": "71"}
    assert score_boxed("the answer is 72", "72") == {"score": 0.0, "acc": False, "pred": None}
