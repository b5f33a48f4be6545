"""A failure inside a worker reaches the user as its own last line, with the switch for the full traceback."""

from __future__ import annotations

import pytest

from reinforge.cli_errors import one_line_report
from reinforge.controller import Worker, WorkerGroup
from reinforge.controller.register import Dispatch, register


class Failing(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def explode(self) -> None:
        try:
            raise KeyError("inner detail")
        except KeyError as error:
            raise ValueError("line one of the story\nthe last line: bad value 3") from error

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def oom(self) -> None:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139 GiB")


def failure_of(method: str) -> BaseException:
    group = WorkerGroup(Failing, name="actor_rollout")
    try:
        with pytest.raises(Exception) as raised:
            getattr(group, method)()
        return raised.value
    finally:
        group.shutdown()


def test_a_worker_error_is_its_own_last_line_with_where_it_happened():
    report = one_line_report(failure_of("explode"))
    assert report == ("error: worker group 'actor_rollout' (Failing) rank 0 of 1 raised in explode: ValueError: the "
                      "last line: bad value 3 (REINFORGE_DEBUG=1 shows the full traceback)")


def test_out_of_memory_names_the_settings_that_lower_memory():
    report = one_line_report(failure_of("oom"))
    assert report.startswith("error: out of memory: worker group 'actor_rollout' (Failing) rank 0 of 1 raised in oom: "
                             "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "actor.max_tokens_per_micro_batch" in report and "REINFORGE_DEBUG=1" in report and "\n" not in report


def test_a_ray_style_remote_traceback_gives_its_last_line():
    remote = RuntimeError("ray::Member.update() (pid=12, ip=10.0.0.1)\n  File \"x.py\", line 3, in update\n"
                          "    raise ZeroDivisionError('scorer bug')\nZeroDivisionError: scorer bug")
    assert one_line_report(remote) == "error: ZeroDivisionError: scorer bug (REINFORGE_DEBUG=1 shows the full traceback)"
