"""Checkpoints validate against their manifest; resume takes the newest good one; a full disk is one line."""

from __future__ import annotations

import errno
import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from reinforge.trainer import run_folder
from reinforge.trainer.checkpoint import CheckpointError, CheckpointManager, checkpoint_problem
from reinforge.trainer.run_folder import RunFolderInUse, RunLock, config_changes


def write_weights(folder: Path) -> None:
    torch.save({"model": {"w": torch.arange(1000.0)}}, folder / "actor_state.pt")
    (folder / "hf").mkdir()
    (folder / "hf" / "config.json").write_text("{}")


def saved_run(tmp_path: Path, steps: int = 3) -> CheckpointManager:
    manager = CheckpointManager(tmp_path, keep_last=5)
    for step in range(1, steps + 1):
        manager.save(step, write_weights, {"step": step})
    return manager


def test_a_saved_checkpoint_validates_and_lists_its_files(tmp_path):
    manager = saved_run(tmp_path, steps=1)
    folder = manager.root / "step_000001"
    assert checkpoint_problem(folder) is None
    assert (folder / "manifest.json").is_file() and not list(manager.root.glob(".tmp-*"))
    assert manager.resolve("auto") == folder


@pytest.mark.parametrize("damage, reason", [
    (lambda folder: (folder / "trainer_state.pt").unlink(), "trainer_state.pt is missing"),
    (lambda folder: (folder / "manifest.json").unlink(), "no manifest.json"),
    (lambda folder: (folder / "actor_state.pt").write_bytes((folder / "actor_state.pt").read_bytes()[:100]),
     "actor_state.pt has 100 bytes"),
    (lambda folder: (folder / "actor_state.pt").write_bytes(b"x" * (folder / "actor_state.pt").stat().st_size),
     "does not match its SHA-256"),
    (lambda folder: (folder / "manifest.json").write_text("garbage"), "unreadable"),
])
def test_resume_skips_a_damaged_newest_checkpoint_and_keeps_it_aside(tmp_path, caplog, damage, reason):
    manager = saved_run(tmp_path)
    newest = manager.root / "step_000003"
    damage(newest)
    with caplog.at_level(logging.WARNING):
        chosen = manager.resolve("auto")
    assert chosen == manager.root / "step_000002"
    assert reason in caplog.text and "skipping checkpoint step_000003" in caplog.text
    assert not newest.exists() and (manager.root / "step_000003.invalid").is_dir()  # kept, never written over
    with pytest.raises(CheckpointError, match=reason):
        manager.resolve(str(manager.root / "step_000003.invalid"))


@pytest.mark.parametrize("pointer", [None, "garbage\x00\n", "step_000009\n"])
def test_a_missing_garbage_or_dangling_latest_pointer_does_not_matter(tmp_path, caplog, pointer):
    manager = saved_run(tmp_path)
    latest = manager.root / "latest"
    if pointer is None:
        latest.unlink()
    else:
        latest.write_text(pointer)
    with caplog.at_level(logging.WARNING):
        assert manager.resolve("auto") == manager.root / "step_000003"
    assert "checkpoints/latest" in caplog.text


def test_when_no_checkpoint_validates_resume_refuses_and_touches_nothing(tmp_path):
    manager = saved_run(tmp_path, steps=2)
    for folder in manager.step_folders():
        (folder / "trainer_state.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* validates .*trainer.resume=never"):
        manager.resolve("auto")
    assert [path.name for path in manager.step_folders()] == ["step_000002", "step_000001"]
    assert manager.resolve("never") is None
    assert manager.remove_all() == 2 and manager.step_folders() == []


def test_a_full_disk_is_one_line_and_leaves_no_temporary_folder(tmp_path):
    manager = saved_run(tmp_path, steps=1)

    def full_disk(folder: Path) -> None:
        write_weights(folder)
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / "actor_state.pt"))
        except OSError as error:  # as a worker group reports it: the member's error is the cause
            raise RuntimeError("worker group 'actor_rollout' rank 0 of 1 raised in save_checkpoint") from error

    with pytest.raises(OSError, match=r"no space left on device while writing .*actor_state.pt") as raised:
        manager.save(2, full_disk, {"step": 2})
    assert raised.value.errno == errno.ENOSPC
    assert not list(manager.root.glob(".tmp-*"))
    assert manager.resolve("auto") == manager.root / "step_000001"


def test_a_disk_quota_exceeded_is_one_line_as_a_full_disk_is(tmp_path):
    manager = saved_run(tmp_path, steps=1)

    def over_quota(folder: Path) -> None:
        raise OSError(errno.EDQUOT, "Disk quota exceeded", str(folder / "actor_state.pt"))

    with pytest.raises(OSError, match=r"^disk quota exceeded while writing .*actor_state.pt .*free space") as raised:
        manager.save(2, over_quota, {"step": 2})
    assert raised.value.errno == errno.EDQUOT and "[Errno" not in str(raised.value)
    assert not list(manager.root.glob(".tmp-*"))


def test_torch_saves_own_full_disk_error_is_recognised_before_the_written_files_are_removed(tmp_path, monkeypatch):
    """torch.save on a full disk raises RuntimeError('... unexpected pos 64 vs 0'), not ENOSPC; the disk is
    nearly full only until the temporary folder's files are removed."""
    import shutil

    from reinforge.trainer import checkpoint

    manager = saved_run(tmp_path, steps=1)
    usage = shutil.disk_usage

    def disk_usage(path):
        filled = any(manager.root.glob(".tmp-*/big.bin"))
        return usage(path)._replace(free=1024 if filled else 2**40)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", disk_usage)

    def full_disk(folder: Path) -> None:
        (folder / "big.bin").write_bytes(b"0" * 1024)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    with pytest.raises(OSError, match=r"no space left on device while writing .*step 2"):
        manager.save(2, full_disk, {"step": 2})
    assert not list(manager.root.glob(".tmp-*"))


def test_a_second_run_on_a_locked_folder_is_refused_and_a_dead_owner_is_taken_over(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.read()"], stdin=subprocess.PIPE)
    (tmp_path / ".lock").write_text(f"{holder.pid}\n")
    with pytest.raises(RunFolderInUse, match=f"in use by pid {holder.pid}"):
        RunLock(tmp_path).acquire()
    holder.communicate(b"")  # the owner ends without removing its lock
    with caplog.at_level(logging.WARNING):
        lock = RunLock(tmp_path).acquire()
    assert f"left by pid {holder.pid}" in caplog.text
    with pytest.raises(RunFolderInUse, match="in use by pid"):
        RunLock(tmp_path).acquire()  # held by this process now
    lock.release()
    assert not (tmp_path / ".lock").exists()


def test_a_lock_its_run_has_not_written_yet_or_one_taken_over_meanwhile_is_not_taken_over(tmp_path, monkeypatch):
    """Two runs starting on one folder at once: a lock is created, then written, and a stale one is read, then
    removed; another run between the two steps keeps its lock."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        lock = tmp_path / ".lock"
        lock.touch()  # created by a run that writes its pid a moment later
        writer = threading.Timer(0.2, lambda: lock.write_text(f"{holder.pid}\n"))
        writer.start()
        with pytest.raises(RunFolderInUse, match=f"in use by pid {holder.pid}"):
            RunLock(tmp_path).acquire()
        writer.join()

        lock.write_text("999999999\n")  # a stale lock, which another run takes over while this one checks it
        def taken_over_meanwhile(pid: int) -> bool:
            if pid == 999999999:
                lock.unlink()
                lock.write_text(f"{holder.pid}\n")
                return False
            return alive(pid)

        alive = run_folder._pid_alive
        monkeypatch.setattr(run_folder, "_pid_alive", taken_over_meanwhile)
        with pytest.raises(RunFolderInUse, match=f"in use by pid {holder.pid}"):
            RunLock(tmp_path).acquire()
        assert lock.read_text() == f"{holder.pid}\n" and sorted(path.name for path in tmp_path.iterdir()) == [".lock"]
    finally:
        holder.communicate(b"")


def test_a_run_folder_that_cannot_be_made_names_the_file_in_the_way_and_the_fix(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    for folder in (tmp_path / "file" / "run", tmp_path / "file"):  # under a file, or a file itself
        with pytest.raises(OSError, match=rf"run folder .*{folder.name} \(trainer.output_dir\) cannot be made: "
                                          rf".*file is a file, not a folder; set trainer.output_dir to a folder"):
            RunLock(folder).acquire()
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]  # nothing left behind


def test_config_changes_lists_nested_differences():
    old = {"actor": {"optim": {"lr": 1e-3}}, "trainer": {"seed": 1}}
    new = {"actor": {"optim": {"lr": 2e-3}}, "trainer": {"seed": 1}}
    assert config_changes(old, new) == [("actor.optim.lr", 1e-3, 2e-3)]


def test_resuming_an_older_checkpoint_by_path_keeps_the_newer_ones_aside(tmp_path, caplog):
    manager = saved_run(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert manager.resolve(str(manager.root / "step_000001")) == manager.root / "step_000001"
    assert [path.name for path in manager.step_folders()] == ["step_000001"]
    assert sorted(path.name for path in manager.root.glob("*.superseded")) == ["step_000002.superseded",
                                                                             "step_000003.superseded"]
    assert "not written over" in caplog.text


def test_resuming_from_another_runs_checkpoint_keeps_this_runs_newer_ones_aside(tmp_path, caplog):
    this_run = saved_run(tmp_path / "this")
    other = saved_run(tmp_path / "other", steps=1)
    copied = tmp_path / "elsewhere" / "my_ckpt"  # a name without the step: read from trainer_state.pt
    shutil.copytree(other.root / "step_000001", copied)
    with caplog.at_level(logging.WARNING):
        assert this_run.resolve(str(copied)) == copied
    assert [path.name for path in this_run.step_folders()] == ["step_000001"]
    assert sorted(path.name for path in this_run.root.glob("*.superseded")) == ["step_000002.superseded",
                                                                              "step_000003.superseded"]
    assert "not written over" in caplog.text
    with pytest.raises(CheckpointError) as error:  # the other run's folder named instead of one of its checkpoints
        this_run.resolve(str(tmp_path / "other"))
    assert str(error.value) == (f"trainer.resume={tmp_path / 'other'} is a run folder, not a checkpoint; pass its "
                                f"latest checkpoint, trainer.resume={other.root / 'step_000001'}")
