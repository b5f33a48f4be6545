"""`reinforge bench train --model SIZES [--trl] [--out DIR]`: each size in a process of its own, one table last."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

import reinforge.bench.sizes as sizes
from reinforge.bench.train import parse_args
from reinforge.cli import main


@pytest.mark.slow
def test_two_sizes_run_in_processes_of_their_own_and_print_one_table_last(tmp_path, capsys):
    out = tmp_path / "out"  # a Qwen2.5 size and the MoE shape that trains a LoRA adapter, tiny on the CPU
    assert main(["bench", "train", "--model", "0.5b,qwen3-30b-a3b", "--cpu", "--steps", "1", "--out", str(out)]) == 0
    files = sorted(path.name for path in out.iterdir())
    assert files == ["reinforge_0.5b_steps-1_cpu.json", "reinforge_qwen3-30b-a3b_steps-1_cpu.json"]
    case = json.loads((out / files[0]).read_text())
    assert case["case"]["status"] == "ok" and case["case"]["options"] == ["--steps", "1", "--cpu"]
    assert len(case["steps"]) == 1 and case["median"]["step_s"] > 0
    moe = json.loads((out / files[1]).read_text())
    assert moe["shape"]["family"] == "qwen3_moe" and moe["shape"]["training"] == "LoRA r32"
    assert moe["shape"]["active_params"] < moe["shape"]["params"]
    printed = capsys.readouterr().out.rstrip().splitlines()
    top = printed.index("| | 0.5b | qwen3-30b-a3b |")
    assert printed[top - 2].startswith("`reinforge bench train --model 0.5b,qwen3-30b-a3b --steps 1 --cpu` on ")
    assert all(line.startswith("|") or not line for line in printed[top:])  # the tables are the last thing printed
    families = printed.index("| family | shape | step s | rollout s | update s | MFU (active params) | peak GiB |")
    assert printed[families + 2].startswith("| qwen2 | 0.5b, ")
    assert printed[families + 3].startswith("| qwen3_moe | qwen3-30b-a3b, ") and "active), LoRA r32 |" in printed[-1]
    assert printed[families + 3].count("|") == 8  # no TRL columns without TRL


def test_case_options_are_passed_on_as_given_and_run_options_are_not():
    args = parse_args(["--model", "0.5b,7b", "--lora", "32", "--gpu-memory-gib", "80", "--checkpointing", "all",
                       "--optimizer-offload", "false", "--out", "x", "--deadline-s", "570", "--ref-offload"])
    assert args.sizes == ["0.5b", "7b"] and args.model == "0.5b"
    assert args.case_options == ["--lora", "32", "--gpu-memory-gib", "80", "--checkpointing", "all",
                                 "--optimizer-offload", "false", "--ref-offload"]
    assert sizes.case_file("reinforge", "7b", args.case_options) == \
        "reinforge_7b_lora-32_gpu-memory-gib-80_checkpointing-all_optimizer-offload-false_ref-offload.json"


def test_the_rollout_engine_is_the_one_asked_for_and_the_cpus_default_is_generate():
    assert parse_args([]).rollout == "native"
    assert parse_args(["--cpu"]).rollout == "hf"
    assert parse_args(["--cpu", "--rollout", "native"]).rollout == "native"
    assert parse_args(["--cpu", "--kv-cache-dtype", "fp8"]).rollout == "native"
    assert parse_args(["--cpu", "--rollout", "native"]).case_options == ["--rollout", "native", "--cpu"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "0.5b,13b"], "argument --model: '0.5b,13b' names no model shape 13b; give one or more of "
                              "0.5b,1.5b,3b,7b,gemma2-2b,phi3-mini,olmo2-1b,mistral-7b,olmoe-1b-7b,qwen3-30b-a3b"),
    (["--model", "0.5b", "--trl", "--variant", "ppo"], "--trl compares the grpo variant with the rule reward on a GPU"),
    (["--model", "0.5b", "--trl", "--reward-model", "0.5b"], "drop --trl, or --variant / --reward-model / --cpu"),
    (["--rollout", "hf", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype sets the native engine, and --rollout hf runs"),
    (["--rollout", "hf", "--shared-prefix-decode", "on"], "--shared-prefix-decode sets the native engine"),
    (["--json", "no/such/folder/r.json"], "--json no/such/folder/r.json: its folder no/such/folder does not exist"),
    (["--model", "0.5b,1.5b", "--json", "a.json"], "--json writes one size's results"),
    (["--model", "0.5b,1.5b", "--model-dir", "m"], "--model-dir names the folder of one size"),
    (["--model", "0.5b", "--trl", "--profile"], "--profile profiles one size in this process"),
    (["--deadline-s", "0"], "argument --deadline-s: 0 s leaves no time"),
    (["--deadline-s", "inf"], "argument --deadline-s: inf s is no deadline; leave --deadline-s out"),
    (["--bandwidth-tbps", "inf"], "argument --bandwidth-tbps: inf TB/s is no device's rate"),
    (["--bandwidth-tbps", "0"], "argument --bandwidth-tbps: 0 TB/s is no device's rate"),
    (["--model", "0.5b,,1.5b"], "argument --model: '0.5b,,1.5b' has an empty name between or beside its commas"),
    (["--model", ","], "argument --model: ',' has an empty name"),
    (["--checkpointing", "-3"], "argument --checkpointing: '-3' is no checkpointing setting; give all, none or a"),
    (["--checkpointing", "some"], "argument --checkpointing: 'some' is no checkpointing setting"),
    (["--gpu-memory-gib", "80GB"], "argument --gpu-memory-gib: '80GB' is not a size in GiB; give a positive size"),
    (["--gpu-memory-gib", "inf"], "argument --gpu-memory-gib: inf GiB is no device"),
])
def test_run_options_that_cannot_work_together_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error


def test_trl_without_its_script_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sizes, "trl_script", lambda: None)
    assert main(["bench", "train", "--model", "0.5b", "--trl", "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "runs benchmarks/trl_grpo.py of a reinforge source checkout" in line and "drop --trl" in line
    assert not (tmp_path / "out").exists()


def test_the_trl_script_is_found_in_the_checkout():
    assert sizes.trl_script() is not None and sizes.trl_script().name == "trl_grpo.py"


def runner(tmp_path, deadline_s: float | None) -> sizes.CaseRunner:
    args = argparse.Namespace(deadline_s=deadline_s, case_options=[])
    return sizes.CaseRunner(args, [], tmp_path, {})


def test_a_process_past_the_deadline_is_ended_with_its_children_and_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sizes, "MIN_CASE_S", 0.0)
    monkeypatch.setattr(sizes, "MARGIN_S", 0.0)
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print('started', flush=True); time.sleep(60)")
    status, exit_code, tail = runner(tmp_path, 1.5).run_process("case", [sys.executable, "-c", code])
    assert status == "timeout" and exit_code is not None and tail == ["started"]


def test_trls_steps_written_before_the_deadline_ended_it_stand(tmp_path, monkeypatch):
    """TRL's script writes its results as each step ends; ended during its second step, its first is reported."""
    monkeypatch.setattr(sizes, "MIN_CASE_S", 0.0)
    monkeypatch.setattr(sizes, "MARGIN_S", 0.0)
    path = tmp_path / "trl_7b.json"
    best = {"checkpointing": False, "step_times_s": [200.0], "step_s": 200.0, "first_step_only": True,
            "peak_memory_gb": 90.0}
    code = (f"import json, pathlib, time; pathlib.Path({str(path)!r}).write_text(json.dumps("
            f"{{'runs': [{best!r}], 'best': {best!r}}})); print('step 1', flush=True); time.sleep(60)")
    case = runner(tmp_path, 3.0)
    case.run_case("trl", "7b", [sys.executable, "-c", code], path)
    [result] = case.results
    assert result["case"]["status"] == "ok" and result["best"]["ended_at_deadline"]
    assert sizes.summary(result) == "TRL step 200.00 s (first step only, from training's start), peak 90.0 GiB"


def test_a_case_that_cannot_start_in_time_is_skipped_and_an_oom_is_named(tmp_path, monkeypatch):
    assert runner(tmp_path, 10.0).run_process("case", [sys.executable, "-c", "print(1)"])[0] == "skipped"
    code = "import sys; print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB'); sys.exit(1)"
    case = runner(tmp_path, None)
    case.run_case("reinforge", "7b", [sys.executable, "-c", code], tmp_path / "reinforge_7b.json")
    [result] = case.results
    assert result["case"]["status"] == "OOM" and result["case"]["exit"] == 1
    assert json.loads((tmp_path / "reinforge_7b.json").read_text())["case"]["status"] == "OOM"


def test_the_update_profile_needs_a_cuda_device_and_says_so_in_one_line(capsys):
    assert main(["bench", "train", "--cpu", "--profile"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("reinforge bench train --profile needs a CUDA device")


def test_a_trl_case_that_fit_on_its_second_try_is_no_oom(tmp_path):
    """With --checkpointing auto TRL runs out of memory without checkpointing, then fits with it."""
    path = tmp_path / "trl_7b.json"
    summary = {"runs": [{"checkpointing": False, "error": "out of memory: CUDA out of memory."},
                        {"checkpointing": True, "step_s": 50.0, "peak_memory_gb": 120.0}],
               "best": {"checkpointing": True, "step_s": 50.0, "peak_memory_gb": 120.0}}
    code = (f"import json, pathlib; print('out of memory: CUDA out of memory.'); "
            f"pathlib.Path({str(path)!r}).write_text(json.dumps({summary!r}))")
    case = runner(tmp_path, None)
    case.run_case("trl", "7b", [sys.executable, "-c", code], path)
    assert case.results[0]["case"]["status"] == "ok"


def test_a_shape_whose_weights_the_disk_cannot_hold_is_refused_before_any_weight_is_made(tmp_path, monkeypatch):
    import shutil

    from reinforge.bench import train

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100 * 2**30, 90 * 2**30, 10 * 2**30))
    with pytest.raises(SystemExit, match=r"the mistral-7b model's random weights need 14 GiB on disk but .* has "
                                         r"10 GiB free; point TMPDIR at a larger disk"):
        train.write_model(tmp_path, tiny=False, size="mistral-7b")
    assert not any(tmp_path.iterdir())
    folder = train.write_model(tmp_path, tiny=False, size="qwen3-30b-a3b")  # built on the device as it loads
    assert (folder / "random_weights.json").is_file()


def test_a_bench_train_case_gets_the_time_left_as_its_own_deadline(tmp_path, monkeypatch):
    args = argparse.Namespace(deadline_s=300.0, case_options=["--steps", "2"])
    case = sizes.CaseRunner(args, [], tmp_path, {})
    commands = []
    monkeypatch.setattr(case, "run_case", lambda kind, size, command, path, env=None: commands.append(command))
    case.run_reinforge("1.5b", tmp_path / "model")
    [command] = commands
    deadline = float(command[command.index("--deadline-s") + 1])
    assert 300 - 2 * sizes.MARGIN_S - 2 <= deadline <= 300 - 2 * sizes.MARGIN_S  # before this process ends it
    assert command[command.index("--steps") + 1] == "2"
    case.args.deadline_s = None
    case.run_reinforge("1.5b", tmp_path / "model")
    assert "--deadline-s" not in commands[-1]


def test_trls_case_gets_the_time_left_as_its_own_deadline(tmp_path, monkeypatch):
    """TRL's script stops between steps before the bench's deadline and writes the steps it made, instead of being
    ended with its results unwritten."""
    args = argparse.Namespace(deadline_s=300.0, case_options=["--steps", "2"])
    case = sizes.CaseRunner(args, [], tmp_path, {})
    commands = []
    monkeypatch.setattr(case, "run_case", lambda kind, size, command, path, env=None: commands.append(command))
    case.run_trl("qwen2.5-vl-3b", tmp_path / "model", tmp_path / "trl_grpo.py")
    [command] = commands
    assert command[1].endswith("trl_grpo_vl.py")
    deadline = float(command[command.index("--deadline-s") + 1])
    assert 300 - 2 * sizes.MARGIN_S - 2 <= deadline <= 300 - 2 * sizes.MARGIN_S
    case.args.deadline_s = None
    case.run_trl("1.5b", tmp_path / "model", tmp_path / "trl_grpo.py")
    assert "--deadline-s" not in commands[-1]


def test_trls_checkpointing_setting_reaches_its_script(tmp_path, monkeypatch):
    """``--trl-checkpointing on`` skips TRL's try without checkpointing (a shape known not to fit without it)."""
    args = parse_args(["--model", "1.5b", "--trl", "--trl-checkpointing", "on", "--steps", "2"])
    assert args.case_options == ["--steps", "2"]  # TRL's setting, not the reinforge case's
    case = sizes.CaseRunner(args, [], tmp_path, {})
    commands = []
    monkeypatch.setattr(case, "run_case", lambda kind, size, command, path, env=None: commands.append(command))
    case.run_trl("1.5b", tmp_path / "model", tmp_path / "trl_grpo.py")
    assert commands[-1][commands[-1].index("--checkpointing") + 1] == "on"
    args.trl_checkpointing = "auto"
    case.run_trl("1.5b", tmp_path / "model", tmp_path / "trl_grpo.py")
    assert commands[-1][commands[-1].index("--checkpointing") + 1] == "auto"


def test_trl_trains_the_adapter_reinforge_trains(tmp_path, monkeypatch):
    """--lora R has TRL train a rank-R adapter on reinforge's projections; a shape's own adapter (Qwen3-30B-A3B's,
    on the attention projections) is TRL's too, and a full fine-tuning case passes none."""
    args = parse_args(["--model", "1.5b", "--trl", "--lora", "16", "--steps", "2"])
    case = sizes.CaseRunner(args, [], tmp_path, {})
    commands = []
    monkeypatch.setattr(case, "run_case", lambda kind, size, command, path, env=None: commands.append(command))
    case.run_trl("1.5b", tmp_path / "model", tmp_path / "trl_grpo.py")
    command = commands[-1]
    assert command[command.index("--lora-rank") + 1] == "16"
    assert command[command.index("--lora-targets") + 1] == "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    args.lora = 0
    case.run_trl("qwen3-30b-a3b", tmp_path / "model", tmp_path / "trl_grpo.py")
    command = commands[-1]
    assert command[command.index("--lora-rank") + 1] == "32"
    assert command[command.index("--lora-targets") + 1] == "q_proj,k_proj,v_proj,o_proj"
    case.run_trl("1.5b", tmp_path / "model", tmp_path / "trl_grpo.py")
    assert "--lora-rank" not in commands[-1]


def test_trl_checkpointing_without_trl_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", "1.5b", "--trl-checkpointing", "on"])
    assert "it needs --trl" in capsys.readouterr().err


def test_trl_runs_with_expandable_segments_unless_the_allocator_is_configured():
    """TRL's update allocates beside what ``generate`` left; its process gets PyTorch's expandable segments so that
    fragments do not end it, and a user's own allocator setting is kept."""
    assert sizes.trl_environment({"PATH": "/bin"}) == {"PATH": "/bin", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert sizes.trl_environment(mine) == mine


def test_a_case_file_is_replaced_whole_or_left_as_it_was(tmp_path, monkeypatch):
    """A case's JSON is written beside its file and renamed over it: a process ended before the rename leaves the
    earlier file whole, and ``bench table`` (which reads ``*.json``) never sees the half-written one."""
    import reinforge.bench.table as table

    case = runner(tmp_path, None)
    path = tmp_path / sizes.case_file("reinforge", "0.5b", [])
    path.write_text('{"earlier": true}')

    def ended(source, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(table.os, "replace", ended)
    with pytest.raises(KeyboardInterrupt):
        case.record("reinforge", "0.5b", {"median": {"step_s": 1.0}}, "ok", 0, 1.0, [])
    assert json.loads(path.read_text()) == {"earlier": True}
    assert sorted(item.name for item in tmp_path.iterdir()) == [path.name]
    monkeypatch.undo()
    case.record("reinforge", "0.5b", {"median": {"step_s": 1.0}}, "ok", 0, 1.0, [])
    assert json.loads(path.read_text())["case"]["status"] == "ok"
    assert sorted(item.name for item in tmp_path.iterdir()) == [path.name]


def test_a_case_without_a_result_fails_the_command_and_trl_running_out_of_memory_does_not():
    def case(kind: str, size: str, status: str) -> dict:
        return {"case": {"kind": kind, "size": size, "status": status}}

    assert sizes.failed_cases([case("reinforge", "0.5b", "ok"), case("trl", "0.5b", "ok"),
                               case("trl", "7b", "OOM")]) == []
    assert sizes.failed_cases([case("reinforge", "0.5b", "ok"), case("trl", "0.5b", "failed (exit 1)"),
                               case("reinforge", "7b", "OOM"), case("trl", "3b", "timeout"),
                               case("reinforge", "3b", "skipped")]) == ["0.5b trl", "7b reinforge", "3b trl",
                                                                        "3b reinforge"]


def test_a_model_folder_written_earlier_is_reused_by_the_case_and_trl(tmp_path, monkeypatch):
    """``--model-dir`` with ``--trl`` or ``--out`` runs both on that folder instead of writing the weights again."""
    monkeypatch.setattr(sizes, "_cuda_available", lambda: True)
    monkeypatch.setattr(sizes, "environment", lambda: {})
    monkeypatch.setattr(sizes, "trl_script", lambda: tmp_path / "trl_grpo.py")
    monkeypatch.setattr(sizes.importlib.util, "find_spec", lambda name: object())
    ran = []

    def written_again(self, size, folder):
        raise AssertionError("the model was written again")

    monkeypatch.setattr(sizes.CaseRunner, "write_model", written_again)
    monkeypatch.setattr(sizes.CaseRunner, "run_reinforge", lambda self, size, model_dir: ran.append(("ours", model_dir)))
    monkeypatch.setattr(sizes.CaseRunner, "run_trl", lambda self, size, model_dir, script: ran.append(("trl", model_dir)))
    model_dir = tmp_path / "model"
    argv = ["--model", "1.5b", "--trl", "--model-dir", str(model_dir), "--out", str(tmp_path / "out")]
    assert sizes.run_sizes(parse_args(argv), argv) == 0
    assert ran == [("ours", model_dir), ("trl", model_dir)]
