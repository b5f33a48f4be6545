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


@pytest.mark.parametrize("code, reason, message", [
    (errno.EDQUOT, "Disk quota exceeded", "disk quota exceeded while writing /runs/x/metrics.jsonl; free space there "
                                          "and run the same command to resume"),
    (errno.EROFS, "Read-only file system", "cannot write /runs/x/metrics.jsonl (a log line): Read-only file system; "
                                           "set trainer.output_dir to a folder this user can write"),
])
def test_a_quota_exceeded_or_another_write_error_names_the_log_file(code, reason, message):
    class Failing(io.StringIO):
        name = "/runs/x/metrics.jsonl"

        def flush(self) -> None:
            raise OSError(code, reason)

    with pytest.raises(OSError) as raised:
        append_json_line(Failing(), {"step": 1})
    assert raised.value.errno == code and str(raised.value) == message
