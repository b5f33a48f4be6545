"""The run folder of a real (tiny) RL run: damaged checkpoints, changed settings, locks, logs, export."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reinforge.atomic_files import temporary_beside
from reinforge.cli import main


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_truncated_newest_checkpoint_resumes_from_the_one_before(rl_args, tmp_path, caplog):
    run_dir = tmp_path / "run"
    args = rl_args(run_dir, **{"trainer.save_every": 1, "trainer.keep_last": 3})
    assert main(["train", *args]) == 0
    reference = rows(run_dir / "metrics.jsonl")
    state = run_dir / "checkpoints" / "step_000002" / "actor_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    first = (run_dir / "checkpoints" / "step_000001" / "manifest.json").read_text()
    assert main(["train", *args]) == 0
    assert "skipping checkpoint step_000002: actor_state.pt has" in caplog.text
    assert (run_dir / "checkpoints" / "step_000002.invalid").is_dir()
    assert (run_dir / "checkpoints" / "step_000001" / "manifest.json").read_text() == first  # not rewritten
    again = rows(run_dir / "metrics.jsonl")
    assert [row["step"] for row in again] == [1, 2]
    assert again[1]["actor/grad_norm"] == reference[1]["actor/grad_norm"]  # step 2 trained again, the same way


def test_no_valid_checkpoint_refuses_instead_of_restarting_over_them(rl_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = rl_args(run_dir, **{"trainer.total_steps": 1})
    assert main(["train", *args]) == 0
    (run_dir / "checkpoints" / "step_000001" / "trainer_state.pt").unlink()
    capsys.readouterr()
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint in" in err[0] and "trainer_state.pt is missing" in err[0]
    assert main(["train", *args, "trainer.resume=never"]) == 0  # starting over is asked for: it replaces them
    assert [row["step"] for row in rows(run_dir / "metrics.jsonl")] == [1]


def test_a_changed_learning_rate_applies_on_resume_a_changed_batch_is_refused_and_samples_carry_steps(rl_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 1})]) == 0
    assert rows(run_dir / "metrics.jsonl")[0]["actor/lr"] == 2e-3
    capsys.readouterr()
    refused = rl_args(run_dir, **{"trainer.total_steps": 2, "data.train_batch_size": 2})
    assert main(["train", *refused]) == 2
    err = capsys.readouterr().err
    assert "data.train_batch_size: 4 -> 2" in err and "cannot take" in err
    assert "train_batch_size: 4" in (run_dir / "config.yaml").read_text()  # config.yaml still tells the truth
    # settings that change which rows the data loader's restored position counts over are refused too
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 2, "data.max_train_samples": 16})]) == 2
    assert "data.max_train_samples: None -> 16" in capsys.readouterr().err
    dynamic = {"trainer.total_steps": 2, "algorithm.filter_groups.enable": True, "data.gen_batch_size": 6}
    assert main(["train", *rl_args(run_dir, **dynamic)]) == 2  # the loader's batches: 6 prompts, not 4
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "data.gen_batch_size: None -> 6" in line and "cannot take" in line
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 2, "actor.optim.lr": 1e-3})]) == 0
    assert rows(run_dir / "metrics.jsonl")[1]["actor/lr"] == 1e-3
    assert "lr: 0.001" in (run_dir / "config.yaml").read_text()
    # samples carry the step that trained on them (and a resumed step keeps its own)
    assert [row["step"] for row in rows(run_dir / "samples.jsonl")] == [1] * 4 + [2] * 4
    assert not (run_dir / ".lock").exists()


def test_another_experiment_name_does_not_resume_the_folders_experiment(rl_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 1, "trainer.experiment_name": "first"})]) == 0
    capsys.readouterr()
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 2, "trainer.experiment_name": "second"})]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds experiment 'first'" in err[0] and "this run is experiment 'second'" in err[0]
    assert "its own trainer.output_dir" in err[0]
    assert [row["step"] for row in rows(run_dir / "metrics.jsonl")] == [1]


def test_a_second_run_on_the_same_folder_is_refused(rl_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (run_dir / ".lock").write_text(f"{holder.pid}\n")
        assert main(["train", *rl_args(run_dir)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"is in use by pid {holder.pid}" in err[0]
        assert not (run_dir / "config.yaml").exists()
    finally:
        holder.communicate(b"")


def test_a_lock_whose_pid_now_belongs_to_a_later_process_is_taken_over(rl_args, tmp_path, caplog):
    """A SIGKILLed run's pid reused (e.g. after a container restart): the start time in the lock tells them apart."""
    from reinforge.trainer.run_folder import RunLock, _start_time

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (run_dir / ".lock").write_text(f"{holder.pid} 1\n")  # started at tick 1: not this process
        lock = RunLock(run_dir).acquire()
        assert "taking over" in caplog.text
        assert (run_dir / ".lock").read_text().split()[0] == str(os.getpid())
        lock.release()
        assert not (run_dir / ".lock").exists()
        (run_dir / ".lock").write_text(f"{holder.pid} {_start_time(holder.pid) or ''}\n")  # the live holder's own
        with pytest.raises(ValueError, match=f"in use by pid {holder.pid}"):
            RunLock(run_dir).acquire()
    finally:
        holder.communicate(b"")


def test_export_refuses_a_non_empty_folder_unless_forced(rl_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 1})]) == 0
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["export", str(run_dir), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "notes.txt").is_file()
    assert main(["export", str(run_dir), str(out), "--force"]) == 0
    assert (out / "config.json").is_file()
    (tmp_path / "model.bin").write_bytes(b"")
    capsys.readouterr()
    assert main(["export", str(run_dir), str(tmp_path / "model.bin")]) == 2
    assert "model.bin is a file, not a folder" in capsys.readouterr().err
    for inside in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "step_000001" / "merged"):
        assert main(["export", str(run_dir), str(inside), "--force"]) == 2  # it would delete what it exports
        assert "being exported" in capsys.readouterr().err
    assert (run_dir / "checkpoints" / "step_000001" / "actor_state.pt").is_file()


ALWAYS_RAISES = '''
def compute_score(solution_str, ground_truth, extra_info=None, **kwargs):
    raise ZeroDivisionError("scorer bug")
'''


def test_a_step_where_every_scorer_failed_stops_the_run_with_one_line(rl_args, tmp_path, capsys, monkeypatch):
    reward_file = tmp_path / "broken.py"
    reward_file.write_text(ALWAYS_RAISES)
    run_dir = tmp_path / "run"
    args = rl_args(run_dir, **{"reward.custom_function": f"{reward_file}:compute_score", "reward.num_workers": 0})
    monkeypatch.delenv("REINFORGE_DEBUG", raising=False)
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: worker group 'reward'") and "raised ZeroDivisionError: scorer bug" in last
    assert "failed on all 16 samples" in last and "REINFORGE_DEBUG=1" in last and "Traceback" not in err
    assert not (run_dir / "metrics.jsonl").read_text().strip()  # nothing was logged as if it had trained
    monkeypatch.setenv("REINFORGE_DEBUG", "1")
    with pytest.raises(Exception, match="scorer bug"):
        main(["train", *args])


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_temporary_folder(rl_args, tmp_path, capsys,
                                                                                     monkeypatch):
    import errno

    import torch

    save = torch.save

    def disk_fills_up(obj, path, *args, **kwargs):
        if str(path).endswith("actor_state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_fills_up)
    run_dir = tmp_path / "run"
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 1})]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: no space left on device while writing ") and "actor_state.pt" in last
    assert not [path.name for path in (run_dir / "checkpoints").iterdir()]  # no temporary folder, no checkpoint


def test_a_resumed_lora_run_may_not_change_its_adapters_shape(tmp_path):
    from reinforge.trainer.rl_trainer import RESUME_REFUSES
    from reinforge.trainer.run_folder import check_resumed_settings

    old = {"model": {"lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}}
    for change in ({"rank": 16}, {"target_modules": ["q_proj"]}):
        new = {"model": {"lora": old["model"]["lora"] | change}}
        with pytest.raises(ValueError, match=rf"changed settings it cannot take: model.lora.{next(iter(change))}:"):
            check_resumed_settings(old, new, RESUME_REFUSES, tmp_path)
    check_resumed_settings(old, {"model": {"lora": old["model"]["lora"] | {"alpha": 32}}}, RESUME_REFUSES, tmp_path)


def test_a_checkpoint_written_before_a_setting_existed_resumes_with_that_settings_value(tmp_path, caplog):
    """A reinforge that had no trainer.mode wrote the checkpoint: this run's trainer.mode is no change it refuses."""
    from reinforge.trainer.rl_trainer import RESUME_REFUSES
    from reinforge.trainer.run_folder import check_resumed_settings

    old = {"trainer": {"seed": 1}, "data": {"shuffle": True}}
    with caplog.at_level(logging.WARNING, logger="reinforge.trainer.run_folder"):
        check_resumed_settings(old, {"trainer": {"seed": 1, "mode": "sync"}, "data": {"shuffle": True}}, RESUME_REFUSES,
                               tmp_path)
    assert "trainer.mode: (not in the checkpoint) -> 'sync'" in caplog.text
    with pytest.raises(ValueError, match="changed settings it cannot take: trainer.seed: 1 -> 2"):
        check_resumed_settings(old, {"trainer": {"seed": 2, "mode": "sync"}, "data": {"shuffle": True}},
                               RESUME_REFUSES, tmp_path)


@pytest.mark.parametrize("trainer, key, value", [
    ("rl_trainer", "min_pixels", 50176), ("rl_trainer", "max_pixels", 50176), ("sft_trainer", "min_pixels", 50176),
    ("sft_trainer", "max_pixels", 50176), ("rl_trainer", "prompt_key", "question"), ("rl_trainer", "image_key", "pics"),
    ("rl_trainer", "chat_template", "{{ messages }}"), ("sft_trainer", "image_key", "pics")])
def test_a_resumed_run_may_not_change_what_its_rows_read(tmp_path, trainer, key, value):
    """The pixel bounds set every image's token count: which prompts fit data.max_prompt_length, SFT's batches, and
    the resolution the checkpoint was trained at; the prompt, image and template keys change the rows themselves (and
    which ones fit), so the data position the checkpoint counts no longer points where it did."""
    import importlib

    from reinforge.trainer.run_folder import check_resumed_settings

    refused = importlib.import_module(f"reinforge.trainer.{trainer}").RESUME_REFUSES
    old = {"data": {"min_pixels": None, "max_pixels": 200704, "prompt_key": "prompt", "image_key": "images",
                    "chat_template": None}}
    with pytest.raises(ValueError, match=rf"changed settings it cannot take: data.{key}: "):
        check_resumed_settings(old, {"data": old["data"] | {key: value}}, refused, tmp_path)
    check_resumed_settings(old, {"data": dict(old["data"])}, refused, tmp_path)


def test_resume_never_keeps_the_earlier_checkpoints_until_the_new_run_can_start(rl_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 1})]) == 0
    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    bad = tmp_path / "typo.jsonl"  # the new run fails on its data, after the run folder is opened
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 1, "trainer.resume": "never",
                                               "data.train_files": f"[{bad}]"})]) != 0
    assert "does not exist" in capsys.readouterr().err
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == checkpoints
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 1, "trainer.resume": "never"})]) == 0
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]


class DiskFull:
    """Writes into ``folder`` fail as on a full disk, where a path's name starts with one of ``names``: folders are not
    made, and a file opens but its data does not fit (the error, as Python raises it, names no path), or with
    ``at_open`` the file is not made (the error names it)."""

    def __init__(self, monkeypatch, folder: Path, names: tuple[str, ...], at_open: bool = False):
        import builtins
        import errno
        import io

        self.folder, self.names = folder.resolve(), names
        self.error = lambda: OSError(errno.ENOSPC, "No space left on device")
        real_open, real_fdopen, real_mkdir = builtins.open, os.fdopen, os.mkdir

        def opened(file, mode="r", *args, **kwargs):
            if at_open and isinstance(file, str | Path) and self.hits(file, mode):
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
            handle = real_open(file, mode, *args, **kwargs)
            return self.failing(handle) if isinstance(file, str | Path) and self.hits(file, mode) else handle

        def fdopened(descriptor, mode="r", *args, **kwargs):
            handle = real_fdopen(descriptor, mode, *args, **kwargs)
            return self.failing(handle) if self.hits(os.readlink(f"/proc/self/fd/{descriptor}"), mode) else handle

        def made(path, *args, **kwargs):
            if self.hits(path, "w"):
                raise self.error()
            return real_mkdir(path, *args, **kwargs)

        for module in (builtins, io):
            monkeypatch.setattr(module, "open", opened)
        monkeypatch.setattr(os, "fdopen", fdopened)
        monkeypatch.setattr(os, "mkdir", made)

    def hits(self, path, mode: str) -> bool:
        path = Path(path).absolute()
        return any(flag in mode for flag in "wax+") and path.parent in (self.folder, self.folder.parent) \
            and path.name.startswith(self.names) and (path == self.folder or path.parent == self.folder)

    def failing(self, handle):
        error = self.error

        class Failing:
            name = handle.name

            def write(self, data):
                raise error()

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                handle.close()

            def __getattr__(self, attribute):
                return getattr(handle, attribute)

        return Failing()


@pytest.mark.parametrize("names, path, what", [
    (("run",), "", "the run folder, trainer.output_dir"),
    ((".lock",), ".lock", "the run folder's lock"),
    (("config.yaml",), "config.yaml", "the run's config"),
])
def test_a_full_disk_at_the_start_names_the_path_and_the_fix_before_any_model_loads(rl_args, tmp_path, capsys,
                                                                                    monkeypatch, names, path, what):
    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a))
    run_dir = tmp_path / "run"
    DiskFull(monkeypatch, run_dir, names)
    assert main(["train", *rl_args(run_dir)]) == 2
    target = run_dir / path if path else run_dir
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: cannot write {target.resolve() if path == '.lock' else target} ({what}): No space left on device; "
        "free space on its disk, or set trainer.output_dir to a folder on another disk, and run the same command again")
    assert not loaded
    assert not (run_dir / ".lock").exists()  # a later run is not kept out by a lock of this one
    assert not list(run_dir.glob("*.tmp"))  # nor part of a file left


def test_a_full_disk_at_the_loggers_start_or_on_resume_names_the_file(rl_args, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patched:
        DiskFull(patched, run_dir, ("metrics.jsonl",), at_open=True)
        assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 1})]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: cannot write {run_dir / 'metrics.jsonl'} (a file of the jsonl logger, trainer.loggers): No space "
        "left on device; free space on its disk, or set trainer.output_dir to a folder on another disk, and run the "
        "same command again")

    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')  # a step past the checkpoint it resumes
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 1})]) == 0
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    staging = temporary_beside(run_dir / "metrics.jsonl")
    DiskFull(monkeypatch, run_dir, (staging.name,))
    assert main(["train", *rl_args(run_dir, **{"trainer.total_steps": 2})]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"error: cannot write {run_dir / 'metrics.jsonl'} (dropping its lines after step 1, to resume there): No "
        "space left on device; free space")
    assert not staging.exists()


def test_a_plots_folder_on_a_full_disk_is_named(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    DiskFull(monkeypatch, run_dir / "plots", ("plots",))
    assert main(["plot", str(run_dir)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: cannot write {run_dir / 'plots'} (the plots' folder): No space left on device; free space on its "
        "disk, or set --out to a folder on another disk, and run the same command again")
