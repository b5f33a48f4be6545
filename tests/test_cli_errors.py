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
            raise ValueError("bad value 3 in the story\nmore about it") from error


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
    assert report == ("error: worker group 'actor_rollout' (Failing) rank 0 of 1 raised in explode: ValueError: bad "
                      "value 3 in the story (REINFORGE_DEBUG=1 shows the full traceback)")


def test_a_ray_style_remote_traceback_gives_its_last_line():
    remote = RuntimeError("ray::Member.update() (pid=12, ip=10.0.0.1)\n  File \"x.py\", line 3, in update\n"
                          "    raise ZeroDivisionError('scorer bug')\nZeroDivisionError: scorer bug")
    assert one_line_report(remote) == "error: ZeroDivisionError: scorer bug (REINFORGE_DEBUG=1 shows the full traceback)"


def test_a_died_member_gives_the_first_line_of_its_story():
    died = RuntimeError("the member process died during generate (killed); it ran on node 10.0.0.1, pid 12; "
                        "its log's last lines:\n| Writing model shards: 100%")
    assert one_line_report(died).startswith("error: RuntimeError: the member process died during generate (killed)")
