"""Rows checked against their scorers when the data loads; extra columns reach verl's and TRL's kinds of scorer."""

import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from reinforge.config.schema import DataConfig, RewardConfig
from reinforge.data.prompt_loader import collate_prompts
from reinforge.data.rl_dataset import RLDataset
from reinforge.reward.data_checks import check_rows_can_be_scored, load_reward_function
from reinforge.reward.manager import RewardManager

sys.path.insert(0, str(Path(__file__).parents[1]))
import forked_python  # noqa: E402

REWARDS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    """verl's signature."""
    return float(solution_str.strip() == ground_truth) + (0.5 if extra_info.get("bonus") else 0.0)


def trl_reward(completions, answer, **kwargs):
    """TRL's signature: the dataset's 'answer' column comes as a keyword argument."""
    return [float(completion == expected) for completion, expected in zip(completions, answer)]


def by_column(solution_str, answer):
    return float(solution_str == answer)


def by_position(solution_str, ground_truth, /):
    return 0.0
'''


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def dataset_of(tmp_path, tokenizer, rows, name="train.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return RLDataset(str(path), tokenizer, DataConfig(max_prompt_length=64, apply_chat_template=False)), path


def row(prompt="1+1=", data_source="arithmetic", ground_truth="2", **columns):
    reward_model = {"ground_truth": ground_truth} if ground_truth is not None else None
    return {"prompt": prompt, "data_source": data_source, "reward_model": reward_model, "extra_info": {"bonus": 0},
            **columns}


def check(tmp_path, tokenizer, rows, custom_function=None):
    config = RewardConfig(custom_function=custom_function, num_workers=0)
    dataset, path = dataset_of(tmp_path, tokenizer, rows)
    check_rows_can_be_scored(dataset, config, load_reward_function(config))
    return path


def test_every_row_needs_a_scorer(tmp_path, byte_tokenizer, rewards_file):
    with pytest.raises(ValueError) as error:
        check(tmp_path, byte_tokenizer, [row(), row(data_source="my/task")])
    assert str(error.value).startswith(f"row 1 of {tmp_path / 'train.parquet'} has data_source 'my/task', which has "
                                       "no scorer (known: ")
    assert str(error.value).endswith("set reward.custom_function=path/to/file.py[:function] or register a scorer "
                                     "for it")
    with pytest.raises(ValueError, match="row 0 of .* has no data_source, which has no scorer"):
        check(tmp_path, byte_tokenizer, [row(data_source=None)])
    check(tmp_path, byte_tokenizer, [row(data_source=None), row(data_source="my/task")], str(rewards_file))


def test_every_row_needs_a_ground_truth_unless_the_function_takes_none(tmp_path, byte_tokenizer, rewards_file):
    with pytest.raises(ValueError) as error:
        check(tmp_path, byte_tokenizer, [row(), row(ground_truth=None)])
    assert str(error.value) == (f"row 1 of {tmp_path / 'train.parquet'} has no reward_model.ground_truth, which the "
                                "'arithmetic' scorer needs; add reward_model: {ground_truth: ...} to the row")
    with pytest.raises(ValueError, match=r"which reward.custom_function compute_score in .*rewards.py needs; add "
                                         r"reward_model: \{ground_truth: ...\} to the row, or give the function's "
                                         r"ground_truth a default if it can score without one"):
        check(tmp_path, byte_tokenizer, [row(ground_truth=None)], str(rewards_file))
    check(tmp_path, byte_tokenizer, [row(ground_truth=None, answer="2")], f"{rewards_file}:trl_reward")


def test_columns_a_function_takes_must_be_in_every_row(tmp_path, byte_tokenizer, rewards_file):
    with pytest.raises(ValueError, match=r"row 1 of .* has no column 'answer' \(or it is null\), which "
                                         r"reward.custom_function by_column in .* takes \(columns are passed by "
                                         r"name\); the row's extra columns are: hint"):
        check(tmp_path, byte_tokenizer, [row(answer="2", hint="h"), row(hint="h")], f"{rewards_file}:by_column")
    # TRL's kind gets the column with None where a row has no value (as TRL passes a dataset's column), so it must
    # be in some row: a column no row has is refused
    check(tmp_path, byte_tokenizer, [row(answer="2", hint="h"), row(hint="h")], f"{rewards_file}:trl_reward")
    with pytest.raises(ValueError, match=r"row 0 of .* has no column 'answer' \(or it is null\), which "
                                         r"reward.custom_function trl_reward in .* takes \(TRL's kind: columns are "
                                         r"passed by name\)"):
        check(tmp_path, byte_tokenizer, [row(hint="h"), row(hint="h")], f"{rewards_file}:trl_reward")
    with pytest.raises(ValueError, match="row 0 of .* has a column 'ground_truth', a name reinforge already passes "
                                         "to the scorer"):
        check(tmp_path, byte_tokenizer, [{**row(ground_truth=None), "ground_truth": "2"}], str(rewards_file))


def test_a_broken_reward_function_is_one_line(rewards_file, tmp_path):
    with pytest.raises(ValueError, match="takes 'solution_str' by position only"):
        load_reward_function(RewardConfig(custom_function=f"{rewards_file}:by_position"))
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"importing .*broken.py failed: ModuleNotFoundError: No module named "
                                         r"'not_a_module_anywhere'"):
        load_reward_function(RewardConfig(custom_function=str(broken)))


@pytest.mark.parametrize("function, num_workers", [("compute_score", 0), ("trl_reward", 0), ("by_column", 0),
                                                   ("trl_reward", 1)])
def test_extra_columns_reach_the_scorer(tmp_path, byte_tokenizer, rewards_file, function, num_workers):
    """From the file to the score: the 'answer' column decides the reward of TRL's kind and of by_column."""
    rows = [row(prompt="1+1=", ground_truth="2", answer="2"), row(prompt="2+2=", ground_truth="4", answer="4")]
    dataset, _ = dataset_of(tmp_path, byte_tokenizer, rows)
    config = RewardConfig(custom_function=f"{rewards_file}:{function}", num_workers=num_workers)
    check_rows_can_be_scored(dataset, config, load_reward_function(config))
    batch = collate_prompts(dataset.examples, 0, ["u0", "u1"]).repeat(2, interleave=True)
    texts = ["2", "5", "4", "4"]  # sample 1 of the first prompt is wrong
    responses = torch.zeros((4, 3), dtype=torch.long)
    for index, text in enumerate(texts):
        responses[index, :len(text)] = torch.tensor(byte_tokenizer(text, add_special_tokens=False)["input_ids"])
    batch["responses"], batch["response_mask"] = responses, (responses != 0).long()
    with RewardManager(config, byte_tokenizer) as manager:
        output = manager.score(batch)
    assert output.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert output.metrics["reward/errors"] == 0.0


@pytest.mark.parametrize("data_source, ground_truth, problem", [
    ("arithmetic", "forty-two", "the arithmetic ground truth must be an integer, got 'forty-two'"),
    ("lighteval/MATH", " ", "the math ground truth is empty"),
    ("aime24", "", "the math_dapo ground truth is empty"),
])
def test_a_ground_truth_the_scorer_cannot_read_is_refused_before_any_model_loads(tmp_path, byte_tokenizer, data_source,
                                                                                  ground_truth, problem):
    # each of the row's samples failed (reward/errors), and a batch of such rows stopped the run at step 1
    with pytest.raises(ValueError) as error:
        check(tmp_path, byte_tokenizer, [row(), row(data_source=data_source, ground_truth=ground_truth)])
    assert str(error.value) == (f"row 1 of {tmp_path / 'train.parquet'} has a reward_model.ground_truth the "
                                f"{data_source!r} scorer cannot read ({problem}), so each of its samples would fail; "
                                "fix the row")


def test_a_countdown_ground_truth_without_numbers_is_refused(tmp_path, byte_tokenizer):
    rows = [row(data_source="countdown", ground_truth={"target": 24, "numbers": [3, 8]}),
            row(data_source="countdown", ground_truth={"target": 24, "numbers": None})]
    with pytest.raises(ValueError, match=r"row 1 of .* the 'countdown' scorer cannot read \(countdown ground truth has "
                                         r"no 'numbers'"):
        check(tmp_path, byte_tokenizer, rows)


def test_a_custom_function_reads_its_own_ground_truths(tmp_path, byte_tokenizer, rewards_file):
    check(tmp_path, byte_tokenizer, [row(ground_truth="forty-two")], str(rewards_file))


def test_a_missing_scorer_package_is_named_with_its_install_command(tmp_path, byte_tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if math-verify were not installed
    with pytest.raises(ValueError) as raised:
        check(tmp_path, byte_tokenizer, [row(data_source="lighteval/MATH", ground_truth="\\frac{1}{2}")])
    message = str(raised.value)
    assert "data_source 'lighteval/MATH'" in message and "math_verify" in message and "not installed" in message
    assert "pip install math-verify" in message and "reinforge[math]" in message
    assert "\n" not in message


def test_a_custom_function_needs_no_built_in_scorer_package(tmp_path, byte_tokenizer, rewards_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    check(tmp_path, byte_tokenizer, [row(data_source="lighteval/MATH", ground_truth="1")],
          custom_function=f"{rewards_file}:compute_score")


BLOCK_MATH_VERIFY = '''
import sys

class NoMathVerify:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "math_verify":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoMathVerify())
from reinforge.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
'''


@pytest.mark.slow
def test_train_without_math_verify_stops_before_the_model_loads(tiny_model_dir, tmp_path, byte_tokenizer):
    """The model folder has no weights: only a check made before loading can answer first."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").unlink()
    data = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist([row(prompt="What is 1/2?", data_source="lighteval/MATH", ground_truth="0.5")] * 4),
                   data)
    args = [f"model.path={model}", f"data.train_files=[{data}]", "data.train_batch_size=2", "rollout.n=2",
            f"trainer.output_dir={tmp_path / 'run'}", "trainer.val_before_train=false"]
    finished = forked_python.run(["-c", BLOCK_MATH_VERIFY, *args], timeout=300)
    assert finished.returncode == 2, finished.stderr[-3000:]
    last_line = finished.stderr.strip().splitlines()[-1]
    assert "data_source 'lighteval/MATH'" in last_line and "pip install math-verify" in last_line, finished.stderr[-3000:]


def test_a_trl_function_taking_completion_ids_and_trainer_state_needs_no_such_column(tmp_path, byte_tokenizer):
    def by_ids(prompts, completions, completion_ids, trainer_state, answer):
        return [float(len(ids)) for ids in completion_ids]

    config = RewardConfig(num_workers=0, weights=[1.0, 0.5])
    dataset, _ = dataset_of(tmp_path, byte_tokenizer, [row(answer="2")])
    load_reward_function(config, [by_ids, by_ids])
    check_rows_can_be_scored(dataset, config, None, [by_ids, by_ids])
    missing_answer, _ = dataset_of(tmp_path, byte_tokenizer, [row()], name="other.parquet")
    with pytest.raises(ValueError, match="row 0 of .* has no column 'answer' .*, which reward function by_ids takes"):
        check_rows_can_be_scored(missing_answer, config, None, [by_ids])
    with pytest.raises(ValueError, match=r"row 0 of .* has a column 'completion_ids', a name reinforge already passes"):
        check_rows_can_be_scored(dataset_of(tmp_path, byte_tokenizer, [row(completion_ids=[1])], name="ids.parquet")[0],
                                 config, None, [by_ids])
    with pytest.raises(ValueError, match=r"reward.weights=\[1.0, 0.5\] has 2 weights for 1 reward functions"):
        load_reward_function(config, [by_ids])


def test_several_functions_from_files_are_each_checked_against_the_rows(tmp_path, byte_tokenizer, rewards_file):
    config = RewardConfig(num_workers=0, functions=[str(rewards_file), f"{rewards_file}:trl_reward"], weights=[1, 2])
    assert load_reward_function(config) is None
    dataset, _ = dataset_of(tmp_path, byte_tokenizer, [row(answer="2")])
    check_rows_can_be_scored(dataset, config, None)
    without_answer, _ = dataset_of(tmp_path, byte_tokenizer, [row()], name="bare.parquet")
    with pytest.raises(ValueError, match="row 0 of .* has no column 'answer' .*, which reward function trl_reward takes"):
        check_rows_can_be_scored(without_answer, config, None)
    with pytest.raises(ValueError, match=r"reward.weights=\[1.0\] has 1 weights for 2 reward functions"):
        load_reward_function(RewardConfig(functions=config.functions, weights=[1.0]))
