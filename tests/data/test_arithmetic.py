from pathlib import Path

import pyarrow.parquet as pq
import pytest

from reinforge.data.commands import data_main
from reinforge.data.tasks.arithmetic import (
    ArithmeticProblem,
    generate_problems,
    make_rl_rows,
    make_sft_rows,
    split_of,
    write_arithmetic_dataset,
)


def test_problem_text_and_answer():
    problem = ArithmeticProblem(47, "+", 385)
    assert problem.question == "What is 47 + 385? Answer with the number only."
    assert problem.answer == 432
    assert ArithmeticProblem(385, "-", 47).answer == 338


def test_train_and_test_problems_never_overlap():
    train = generate_problems(2000, "train", seed=0, max_digits=2)
    test = generate_problems(300, "test", seed=1, max_digits=2)
    assert not set(train) & set(test)
    assert all(split_of(problem) == "train" for problem in train)
    assert all(split_of(problem) == "test" for problem in test)
    assert len(set(train)) == 2000


def test_split_depends_only_on_the_problem():
    problems = [ArithmeticProblem(left, "+", right) for left in range(30) for right in range(30)]
    test_share = sum(split_of(problem) == "test" for problem in problems) / len(problems)
    assert 0.05 < test_share < 0.15
    assert [split_of(problem) for problem in problems] == [split_of(problem) for problem in problems]


def test_generation_is_seeded_and_respects_the_knobs():
    assert generate_problems(50, "train", seed=3) == generate_problems(50, "train", seed=3)
    assert generate_problems(50, "train", seed=3) != generate_problems(50, "train", seed=4)
    problems = generate_problems(200, "train", min_digits=3, max_digits=3, operators=("-",))
    assert all(100 <= problem.left <= 999 and 100 <= problem.right <= 999 for problem in problems)
    assert all(problem.operator == "-" and problem.answer >= 0 for problem in problems)


def test_asking_for_more_problems_than_exist_is_an_error():
    with pytest.raises(ValueError, match="found only .* distinct train problems"):
        generate_problems(500, "train", max_digits=1, operators=("+",))
    with pytest.raises(ValueError, match="operators"):
        generate_problems(5, "train", operators=("*",))
    with pytest.raises(ValueError, match=r"^num_problems=-5 must be 0 or more$"):  # it returned hundreds of problems
        generate_problems(-5, "train")


@pytest.mark.parametrize("flags", [["--num-train", "0"], ["--num-test", "-5"]])
def test_the_command_refuses_no_problems_before_writing_any_file(tmp_path, flags):
    """--num-train 0 wrote parquet files of no rows and no columns; --num-test -5 hundreds of rows."""
    with pytest.raises(ValueError, match=rf"^{flags[0]} {flags[1]} \(command line\) must be at least 1"):
        data_main(["arithmetic", "--out", str(tmp_path / "out"), *flags])
    assert not (tmp_path / "out").exists()


def test_rl_and_sft_rows():
    problems = [ArithmeticProblem(47, "+", 385)]
    (row,) = make_rl_rows(problems, "train")
    assert row["data_source"] == "arithmetic"
    assert row["prompt"] == [{"role": "user", "content": "What is 47 + 385? Answer with the number only."}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "432"}
    assert row["extra_info"] == {"split": "train", "index": 0, "expression": "47 + 385"}
    (sft,) = make_sft_rows(problems)
    assert sft["messages"][1] == {"role": "assistant", "content": "432"}


def test_wrong_sign_flaws_only_the_chosen_share_of_sft_subtractions(tmp_path):
    problems = generate_problems(1000, "train", seed=0, max_digits=2)
    rows = make_sft_rows(problems, wrong_sign_fraction=0.6, seed=0)
    assert rows == make_sft_rows(problems, wrong_sign_fraction=0.6, seed=0)
    answers = [int(row["messages"][1]["content"]) for row in rows]
    flawed = [problem for problem, answer in zip(problems, answers, strict=True) if answer != problem.answer]
    assert all(answer in (problem.answer, -problem.answer) for problem, answer in zip(problems, answers, strict=True))
    assert all(problem.operator == "-" and problem.answer > 0 for problem in flawed)
    subtractions = [problem for problem in problems if problem.operator == "-" and problem.answer != 0]
    assert 0.5 < len(flawed) / len(subtractions) < 0.7
    assert make_sft_rows(problems) == make_sft_rows(problems, wrong_sign_fraction=0.0)
    with pytest.raises(ValueError, match="wrong_sign_fraction"):
        make_sft_rows(problems, wrong_sign_fraction=1.5)
    # the RL rows keep the true answers
    files = write_arithmetic_dataset(tmp_path, num_train=200, num_test=10, max_digits=2, operators=("-",),
                                     sft_wrong_sign_fraction=1.0)
    rl_answers = [row["reward_model"]["ground_truth"] for row in pq.read_table(files["train"]).to_pylist()]
    sft_answers = [row["messages"][1]["content"] for row in pq.read_table(files["sft_train"]).to_pylist()]
    assert all(not answer.startswith("-") for answer in rl_answers)
    assert all(sft == ("0" if rl == "0" else "-" + rl) for rl, sft in zip(rl_answers, sft_answers, strict=True))


def test_cli_writes_the_three_files(tmp_path):
    assert data_main(["arithmetic", "--out", str(tmp_path), "--num-train", "30", "--num-test", "10"]) == 0
    assert pq.read_table(tmp_path / "train.parquet").num_rows == 30
    assert pq.read_table(tmp_path / "test.parquet").num_rows == 10
    assert pq.read_table(tmp_path / "sft_train.parquet").column_names == ["messages"]
    (tmp_path / "notes.txt").write_text("mine\n")  # a file as --out: it was "[Errno 17] File exists: ..."
    with pytest.raises(FileExistsError, match=r"^--out .*notes.txt \(command line\) is a file; reinforge data "
                                              r"arithmetic writes its parquet files into a folder"):
        data_main(["arithmetic", "--out", str(tmp_path / "notes.txt")])
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_an_interrupted_write_leaves_no_cut_off_file(tmp_path, monkeypatch):
    """A write that stops part way (Ctrl-C, a full disk) leaves the files written before it whole and no other."""
    real = pq.write_table

    def cut_off(table, where, **kwargs):
        if "test" in Path(where).name:
            Path(where).write_bytes(b"PAR1")
            raise KeyboardInterrupt
        return real(table, where, **kwargs)

    monkeypatch.setattr(pq, "write_table", cut_off)
    with pytest.raises(KeyboardInterrupt):
        write_arithmetic_dataset(tmp_path, num_train=8, num_test=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["train.parquet"]
    assert pq.read_table(tmp_path / "train.parquet").num_rows == 8
