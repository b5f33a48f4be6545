"""The judge's prompts and how its answers become scores: templates, the three parse rules, malformed answers."""

from __future__ import annotations

import math

import pytest
import torch

from reinforge.models import build_char_tokenizer
from reinforge.protocol import Batch
from reinforge.reward.judge import (
    answer_token_id,
    check_template,
    judge_prompts,
    parse_judgement,
    problem_text,
    read_template,
    render,
    scores_from_texts,
    unreadable,
    yes_no_batch,
    yes_no_scores,
)


@pytest.mark.parametrize("text, rule, expected", [
    ("The answer is right. Score: 8", "marker", 8.0),
    ("Score: 2 at first... on reflection Score: **7.5**/10", "marker", 7.5),
    ("Score:\n-1", "marker", -1.0),
    ("I would say \\boxed{9}", "boxed", 9.0),
    ("\\boxed{3} no, \\boxed{ 4.25 }", "boxed", 4.25),
    ("\\boxed{\\frac{1}{2}}", "boxed", None),
    ("no score given", "marker", None),
    ("Score: excellent", "marker", None),
    ("\\boxed{9", "boxed", None),
])
def test_a_judgement_is_read_by_its_rule(text, rule, expected):
    assert parse_judgement(text, rule) == expected


def test_malformed_judgements_get_the_fallback_and_are_counted():
    judgements = scores_from_texts(["Score: 10", "nothing", "Score: 5"], "marker", "Score:", scale=10.0,
                                   fallback=-1.0)
    assert judgements.scores == [1.0, -1.0, 0.5]
    assert judgements.malformed == 1
    assert judgements.metrics(2.0)["reward/judge/malformed"] == 1.0
    assert unreadable(judgements, ["Score: 10", "nothing", "Score: 5"], "marker", "Score:") is None
    none = scores_from_texts(["meh", "hmm"], "marker", "Score:", 1.0, 0.0)
    line = unreadable(none, ["meh", "hmm"], "marker", "Score:")
    assert line.startswith("none of the judge's 2 answers has a number after 'Score:' (reward.judge.parse=marker); "
                           "the first reads 'meh'")
    blank = scores_from_texts(["\n\n", ""], "marker", "Score:", 1.0, 0.0)  # newlines only: shown as written
    assert "the first reads '\\n\\n': fix" in unreadable(blank, ["\n\n", ""], "marker", "Score:")


def test_templates_name_known_fields_and_show_the_response(tmp_path):
    check_template("Q: {prompt}\nA: {response}\nRef: {ground_truth}\nJSON like {{\"score\": 1}}", "t")
    with pytest.raises(ValueError, match=r"^t has the placeholder \{answer\}, which is not one of"):
        check_template("{prompt} {answer}", "t")
    with pytest.raises(ValueError, match="never shows the judge the response"):
        check_template("{prompt}", "t")
    assert render("Q={prompt} A={response} R={ground_truth} {{x}}", "1+1", "2", 2) == "Q=1+1 A=2 R=2 {x}"
    assert render("{response}|{ground_truth}", "", "r", None) == "r|"
    # the sample's own braces reach the judge as written (a Jinja or f-string answer, LaTeX's {{)
    assert render("{{{{ {prompt} | {response} | {ground_truth} }}", "f'{{x}}'", "{{ name }}", "a}}b") == \
        "{{ f'{{x}}' | {{ name }} | a}}b }"
    path = tmp_path / "judge.txt"
    path.write_text("Judge {response}")
    assert read_template(str(path)) == "Judge {response}"
    assert read_template("Judge {response}") == "Judge {response}"
    # a mistyped path is said to be one, not read as a template without {response}
    for missing in (str(tmp_path / "judge.tx"), "prompts/judge"):
        with pytest.raises(ValueError, match=rf"^reward.judge.template={missing} names no file .*give the template"):
            read_template(missing)


def test_the_problem_is_the_prompts_user_turns():
    assert problem_text("plain") == "plain"
    assert problem_text([{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}]) == "1+1?"


def policy_batch(tokenizer, prompts: list[str], responses: list[str]) -> Batch:
    """The policy's samples in the rollout layout: left-padded prompts, right-padded responses."""
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    response_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in responses]
    width, rwidth = max(map(len, prompt_ids)), max(map(len, response_ids))
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(prompts), width + rwidth), pad)
    mask = torch.zeros_like(input_ids)
    for row, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        input_ids[row, width - len(p):width] = torch.tensor(p)
        input_ids[row, width:width + len(r)] = torch.tensor(r)
        mask[row, width - len(p):width + len(r)] = 1
    return Batch.from_dict(tensors={"prompts": input_ids[:, :width], "input_ids": input_ids, "attention_mask": mask},
                           non_tensors={"raw_prompt": [[{"role": "user", "content": text}] for text in prompts],
                                        "ground_truth": ["4", "9"]})


def test_judge_prompts_render_each_sample_in_the_judges_chat_template():
    tokenizer = build_char_tokenizer()
    batch = policy_batch(tokenizer, ["2+2?", "3*3?"], ["4", "it is 8"])
    prompts, cut = judge_prompts(batch, tokenizer, tokenizer, "P:{prompt} R:{response} G:{ground_truth}",
                                 chat_template=True, max_prompt_length=512)
    assert cut == 0
    assert list(prompts.non_tensors["uid"]) == ["judge-0", "judge-1"]
    row = prompts["input_ids"][1][prompts["attention_mask"][1].bool()].tolist()
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "P:3*3? R:it is 8 G:9"}],
                                             add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(row) == expected
    short, cut = judge_prompts(batch, tokenizer, tokenizer, "R:{response}", chat_template=False, max_prompt_length=3)
    assert cut == 1 and short["attention_mask"].sum(-1).tolist() == [3, 3]  # "R:4" fits; the other keeps its end
    assert tokenizer.decode(short["input_ids"][1].tolist()) == "s 8"


def test_yes_no_scores_are_the_yes_probability_whatever_the_temperature():
    tokenizer = build_char_tokenizer()
    yes, no = answer_token_id(tokenizer, "Y", "yes"), answer_token_id(tokenizer, "N", "no")
    with pytest.raises(ValueError, match=r"^reward.judge.yes_token='Yes' is 3 tokens"):
        answer_token_id(tokenizer, "Yes", "reward.judge.yes_token")
    batch = policy_batch(tokenizer, ["a?", "b?"], ["x", "y"])
    prompts, _ = judge_prompts(batch, tokenizer, tokenizer, "{response}", chat_template=False, max_prompt_length=64)
    pairs = yes_no_batch(prompts, yes, no)
    assert pairs["responses"][:, 0].tolist() == [yes, no, yes, no]
    assert pairs["input_ids"].shape[1] == prompts["input_ids"].shape[1] + 1
    logits_yes, logits_no, temperature = 2.0, 0.5, 0.7
    # log-probs at temperature T: l/T - logZ_T; the score must be sigmoid(l_yes - l_no)
    log_z = math.log(math.exp(logits_yes / temperature) + math.exp(logits_no / temperature) + 3.0)
    log_probs = torch.tensor([[logits_yes / temperature - log_z], [logits_no / temperature - log_z]] * 2,
                             dtype=torch.float64)
    scores = yes_no_scores(log_probs, temperature)
    assert scores == pytest.approx([1 / (1 + math.exp(-(logits_yes - logits_no)))] * 2, abs=1e-9)
    # rollout.temperature=0 (greedy, n=1): the log-probs are computed at temperature 1, as the engines sample them
    log_z = math.log(math.exp(logits_yes) + math.exp(logits_no) + 3.0)
    at_one = torch.tensor([[logits_yes - log_z], [logits_no - log_z]], dtype=torch.float64)
    assert yes_no_scores(at_one, 0.0) == pytest.approx([1 / (1 + math.exp(-(logits_yes - logits_no)))], abs=1e-9)


def test_an_answer_of_several_tokens_is_refused_with_ones_the_vocabulary_has():
    tokenizer = build_char_tokenizer()
    with pytest.raises(ValueError) as refusal:
        answer_token_id(tokenizer, "Yes", "reward.judge.yes_token")
    assert str(refusal.value) == ("reward.judge.yes_token='Yes' is 3 tokens of the judge's vocabulary; parse=yes_no "
                                  "reads the probability of one token: pick an answer that is one token (e.g. 'Y', "
                                  "'y')")
    with pytest.raises(ValueError, match=r"one token \(its vocabulary has none of 'é', ' é'\)$"):
        answer_token_id(tokenizer, "é", "reward.judge.yes_token")  # two bytes, two tokens of the byte-level vocabulary
