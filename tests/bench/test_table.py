"""`reinforge bench table DIR [DIR ...]`: one markdown table, one column per size, from the cases of several runs."""

from __future__ import annotations

import json
import re

from reinforge.cli import main

H200 = {"gpu": "NVIDIA H200", "gpu_memory_gib": 140.4, "python": "3.12.3", "torch": "2.11.0+cu130",
        "transformers": "5.17.0", "triton": "3.6.0", "trl": "0.29.0", "commit": "5d1e9b", "date": "2026-12-03"}


def reinforge_case(size: str, step_s: float, **case) -> dict:
    return {"median": {"step_s": step_s, "rollout_s": step_s / 2, "update_actor_s": step_s / 2 - 0.1, "mfu": 0.213,
                       "mfu_measured_peak": 0.264, "mfu_with_attention": 0.225, "rollout_floor_s": step_s / 4,
                       "rollout_over_floor": 2.0, "rollout_peak_gb": 10.7, "update_peak_gb": 78.1},
            "plan": {"settings": {"micro_batch_tokens": 65536, "checkpoint_layers": 0, "optimizer_offload": False,
                                  "keep_rollout_memory": True},
                     "estimated_gb": {"rollout": 12.0, "update": 80.5}},
            "case": {"kind": "reinforge", "size": size, "options": [], "status": "ok", "environment": H200, **case}}


def trl_case(size: str, step_s: float | None, status: str = "ok") -> dict:
    best = None if step_s is None else {"step_s": step_s, "peak_memory_gb": 60.2, "checkpointing": False}
    return {"runs": [], "best": best,
            "case": {"kind": "trl", "size": size, "options": [], "status": status, "environment": H200}}


def write(folder, name, data):
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(data))


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the first table in ``text`` by label."""
    rows = {}
    lines = text.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("|"))
    for line in lines[start:]:
        if not line:
            break
        if line.startswith("| ") and not line.startswith("| |"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_the_table_of_two_runs_names_command_machine_versions_commit_and_date(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    write(first, "reinforge_1.5b.json", reinforge_case("1.5b", 8.0))
    write(first, "trl_1.5b.json", trl_case("1.5b", 40.0))
    write(first, "reinforge_0.5b.json", reinforge_case("0.5b", 3.0))
    write(first, "trl_0.5b.json", trl_case("0.5b", 15.0))
    write(second, "reinforge_7b.json", reinforge_case("7b", 30.0))
    write(second, "trl_7b.json", trl_case("7b", None, status="OOM"))
    write(second, "notes.json", {"something": "else"})  # not a case: left out
    assert main(["bench", "table", str(first), str(second)]) == 0
    out = capsys.readouterr().out
    header, table = out.split("\n\n", 1)
    assert header == ("`reinforge bench train --model 0.5b,1.5b,7b --trl` on NVIDIA H200 (140.4 GiB); torch "
                      "2.11.0+cu130, transformers 5.17.0, triton 3.6.0, Python 3.12.3, trl 0.29.0; commit 5d1e9b; "
                      "2026-12-03 (UTC)")
    assert table.splitlines()[0] == "| | 0.5b | 1.5b | 7b |"
    rows = table_rows(table)
    assert rows["step s"] == ["3.00", "8.00", "30.00"]
    assert rows["MFU vs datasheet (989 TFLOP/s)"] == ["21.3%"] * 3
    assert rows["MFU vs measured peak (799 TFLOP/s)"] == ["26.4%"] * 3
    assert rows["MFU with attention vs datasheet (989 TFLOP/s)"] == ["22.5%"] * 3
    assert rows["rollout bandwidth floor s"] == ["0.75", "2.00", "7.50"]
    assert rows["rollout / floor"] == ["2.00"] * 3
    assert rows["micro-batch tokens (planner)"] == ["65536"] * 3
    assert rows["rollout memory kept (planner)"] == ["yes"] * 3
    assert rows["TRL step s"] == ["15.00", "40.00", "OOM"]
    assert rows["TRL step / reinforge step"] == ["5.0", "5.0", "–"]
    assert rows["TRL gradient checkpointing"] == ["no", "no", "OOM"]
    for cells in rows.values():  # one figure per cell
        assert all(re.fullmatch(r"[\d.]+%?|yes|no|–|OOM", cell) for cell in cells), cells


def test_a_trl_run_of_one_step_is_marked_in_its_cells_and_ratio(tmp_path, capsys):
    folder = tmp_path / "run"
    write(folder, "reinforge_0.5b.json", reinforge_case("0.5b", 4.0))
    one_step = trl_case("0.5b", 40.0)
    one_step["best"]["first_step_only"] = True
    one_step["best"]["generate_s"] = [31.5]
    write(folder, "trl_0.5b.json", one_step)
    assert main(["bench", "table", str(folder)]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert rows["TRL step s"] == ["40.00 (first step only)"]
    assert rows["TRL generate s, each call"] == ["31.50"]  # its steady step is at least this
    assert rows["TRL step / reinforge step"] == ["10.0 (first step only)"]
    assert out.splitlines()[-1].endswith("| 40.00 (first step only) | 10.0 (first step only) |")


def test_a_trl_run_ended_in_its_second_step_bounds_its_steady_step_by_that_steps_generation(tmp_path, capsys):
    """TRL made one step and its second ``generate`` call ended before the deadline ended the run: its steady step
    is longer than that generation, and the ratio is at least the generation over reinforge's step."""
    folder = tmp_path / "run"
    write(folder, "reinforge_0.5b.json", reinforge_case("0.5b", 19.83))
    one_step = trl_case("0.5b", 285.37)
    one_step["best"].update(first_step_only=True, generate_s=[270.9, 136.27], stopped_at_deadline=True)
    write(folder, "trl_0.5b.json", one_step)
    assert main(["bench", "table", str(folder)]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert rows["TRL step s"] == ["more than 136.27 (its second step's generation alone; its first step 285.37)"]
    assert rows["TRL step / reinforge step"] == ["more than 6.8"]  # 6.87, rounded down
    assert out.splitlines()[-1].endswith("| more than 6.8 |")


def test_the_generate_calls_of_a_trl_run_that_ran_out_of_memory_are_shown_beside_its_status(tmp_path, capsys):
    folder = tmp_path / "run"
    write(folder, "reinforge_0.5b.json", reinforge_case("0.5b", 4.0))
    failed = trl_case("0.5b", None, status="OOM")
    failed["runs"] = [{"checkpointing": True, "error": "out of memory: CUDA out of memory.",
                       "step_times_s_before_the_error": [200.0], "generate_s": [150.0, 60.25]}]
    write(folder, "trl_0.5b.json", failed)
    assert main(["bench", "table", str(folder)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows["TRL step s"] == ["OOM"]
    assert rows["TRL generate s, each call"] == ["150.00, 60.25 (OOM)"]


def test_a_later_folder_replaces_a_case_and_differing_options_name_their_columns(tmp_path, capsys):
    write(tmp_path / "a", "reinforge_0.5b.json", reinforge_case("0.5b", 3.0))
    write(tmp_path / "b", "reinforge_0.5b.json", reinforge_case("0.5b", 2.5))
    lora = reinforge_case("0.5b", 4.0, options=["--lora", "32"])
    write(tmp_path / "b", "reinforge_0.5b_lora-32.json", lora)
    assert main(["bench", "table", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "`reinforge bench train --model 0.5b; reinforge bench train --model 0.5b --lora 32`" in out
    assert "| | 0.5b | 0.5b --lora 32 |" in out
    assert table_rows(out)["step s"] == ["2.50", "4.00"]
    assert "TRL" not in out and ", trl" not in out


def test_the_family_table_has_one_row_per_case_with_active_parameters_and_the_trl_ratio(tmp_path, capsys):
    moe = reinforge_case("olmoe-1b-7b", 6.0)
    moe["median"]["peak_memory_gb"] = 70.25
    moe["shape"] = {"name": "olmoe-1b-7b", "family": "olmoe", "training": "full", "params": 6.92e9,
                    "active_params": 1.28e9}
    write(tmp_path, "reinforge_olmoe-1b-7b.json", moe)
    write(tmp_path, "trl_olmoe-1b-7b.json", trl_case("olmoe-1b-7b", 30.0))
    write(tmp_path, "reinforge_0.5b.json", reinforge_case("0.5b", 3.0))  # a case written before shapes were recorded
    assert main(["bench", "table", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    top = lines.index("| family | shape | step s | rollout s | update s | MFU (active params) | peak GiB | TRL step s | "
                      "TRL / reinforge |")
    assert lines[top + 2] == "| qwen2 | 0.5b | 3.00 | 1.50 | 1.40 | 21.3% | – | – | – |"
    assert lines[top + 3] == ("| olmoe | olmoe-1b-7b, 6.9B (1.3B active), full | 6.00 | 3.00 | 2.90 | 21.3% | 70.2 | "
                              "30.00 | 5.0 |")


def test_the_table_of_no_cases_says_so_in_one_line(tmp_path, capsys):
    assert main(["bench", "table", str(tmp_path)]) == 2
    assert main(["bench", "table", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no case of `reinforge bench train --out`" in err[0] and "does not exist" in err[1]



def test_the_environment_names_versions_commit_and_date_without_touching_the_device():
    import platform
    import subprocess

    import torch

    from reinforge.bench.table import environment

    env = environment()
    assert env["torch"] == torch.__version__ and env["python"] == platform.python_version()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", env["date"])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert (env["commit"] or "").removesuffix("+changes") == head  # + changes: this checkout's edits
    assert not torch.cuda.is_initialized()


def test_the_commit_is_marked_when_the_tracked_files_differ_from_it(tmp_path):
    import subprocess

    from reinforge.bench.table import commit

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    clean = commit(tmp_path)
    assert clean and "+" not in clean
    (tmp_path / "a.py").write_text("x = 2\n")
    assert commit(tmp_path) == clean + "+changes"
    assert commit(tmp_path / "no_such_folder") is None


def test_a_median_of_the_first_step_alone_is_marked_as_compiling(tmp_path, capsys):
    """``--steps 1`` (or a deadline after the first step) leaves the compiling first step as the median: its cells
    and the ratio to TRL say so, where a steady step's do not."""
    first_only = {**reinforge_case("0.5b", 30.0), "median_steps": [1]}
    steady = {**reinforge_case("1.5b", 8.0), "median_steps": [2, 3]}
    write(tmp_path, "reinforge_0.5b.json", first_only)
    write(tmp_path, "trl_0.5b.json", trl_case("0.5b", 15.0))
    write(tmp_path, "reinforge_1.5b.json", steady)
    write(tmp_path, "trl_1.5b.json", trl_case("1.5b", 40.0))
    assert main(["bench", "table", str(tmp_path)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows["step s"] == ["30.00 (first step only, compiling)", "8.00"]
    assert rows["TRL step / reinforge step"] == ["0.5 (first step only, compiling)", "5.0"]
