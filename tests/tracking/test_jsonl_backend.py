"""metrics.jsonl / samples.jsonl on a full disk: one line naming the file."""

from __future__ import annotations

import errno
import io

import pytest

from reinforge.tracking.jsonl import append_json_line


class FullDisk(io.StringIO):
    name = "/runs/x/metrics.jsonl"

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_names_the_log_file():
    with pytest.raises(OSError) as raised:
        append_json_line(FullDisk(), {"step": 1})
    assert raised.value.errno == errno.ENOSPC
    assert str(raised.value) == ("no space left on device while writing /runs/x/metrics.jsonl; free space there "
                                 "and run the same command to resume")


def test_a_quota_exceeded_names_the_log_file_as_a_full_disk_does():
    class OverQuota(io.StringIO):
        name = "/runs/x/metrics.jsonl"

        def flush(self) -> None:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

    with pytest.raises(OSError) as raised:
        append_json_line(OverQuota(), {"step": 1})
    assert raised.value.errno == errno.EDQUOT
    assert str(raised.value) == ("disk quota exceeded while writing /runs/x/metrics.jsonl; free space there and run "
                                 "the same command to resume")


def test_other_write_errors_name_the_log_file_too():
    class ReadOnly(io.StringIO):
        name = "/runs/x/metrics.jsonl"

        def flush(self) -> None:
            raise OSError(errno.EROFS, "Read-only file system")

    with pytest.raises(OSError) as raised:
        append_json_line(ReadOnly(), {"step": 1})
    assert raised.value.errno == errno.EROFS
    assert str(raised.value) == ("cannot write /runs/x/metrics.jsonl (a log line): Read-only file system; set "
                                 "trainer.output_dir to a folder this user can write")
