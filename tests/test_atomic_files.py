"""A file replaced through ``replaced_atomically`` holds its old content or its new one, never a part, and nothing is
left beside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reinforge.atomic_files import replaced_atomically, temporary_beside


@pytest.mark.parametrize("durable", [True, False])
def test_the_new_content_replaces_the_old_and_nothing_is_left_beside_it(tmp_path, durable):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    with replaced_atomically(path, durable=durable) as temporary:
        assert temporary.parent == tmp_path and temporary.name.endswith(".tmp") and str(os.getpid()) in temporary.name
        temporary.write_text("new\n")
        assert path.read_text() == "old\n"  # a reader sees the old file until the block ends
    assert path.read_text() == "new\n"
    assert sorted(tmp_path.iterdir()) == [path]


def test_an_error_in_the_block_keeps_the_old_file_and_removes_the_part_written(tmp_path):
    path = tmp_path / "latest"
    path.write_text("step_000002\n")
    with pytest.raises(OSError, match="No space left"), replaced_atomically(path) as temporary:
        temporary.write_text("step_0000")
        raise OSError(28, "No space left on device")
    assert path.read_text() == "step_000002\n"
    assert sorted(tmp_path.iterdir()) == [path]


def test_a_file_that_did_not_exist_stays_absent_after_an_error(tmp_path):
    path = tmp_path / "table.json"
    with pytest.raises(KeyboardInterrupt), replaced_atomically(path) as temporary:
        temporary.write_text("{")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_a_block_that_writes_nothing_fails_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "reference.pt"
    path.write_bytes(b"kept")
    with pytest.raises(FileNotFoundError), replaced_atomically(path):
        pass
    assert path.read_bytes() == b"kept"


def test_two_processes_write_the_same_file_through_temporaries_of_their_own(tmp_path):
    path = tmp_path / "plot.png"
    script = ("import sys; from pathlib import Path; from reinforge.atomic_files import temporary_beside; "
              "print(temporary_beside(Path(sys.argv[1])))")
    other = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert Path(other.stdout.strip()) != temporary_beside(path)
    assert Path(other.stdout.strip()).parent == temporary_beside(path).parent == tmp_path
