import gc
import threading
import time

import pytest

from reinforge.rollout.native import collector


@pytest.fixture
def collector_on():
    """The collector on and no pause held; as found afterwards. An engine an earlier test served through may still be
    ending its last step on its thread, holding the pause for a moment: waited for."""
    deadline = time.monotonic() + 30
    while collector.holders() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert collector.holders() == 0, "a pause an earlier test took is still held"
    was_enabled = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was_enabled else gc.disable)()


def test_overlapping_pauses_restore_the_collector_when_the_last_lets_go(collector_on):
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first():
        with collector.paused():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    assert first_in.wait(10)
    with collector.paused():  # taken while the first holds it, let go after the first did
        second_in.set()
        assert first_out.wait(10)
        seen["after the first let go"] = gc.isenabled()
    thread.join(10)
    assert seen == {"after the first let go": False}  # not turned back on under the second holder's feet
    assert gc.isenabled() and collector.holders() == 0


def test_a_collector_switched_off_before_the_pause_stays_off(collector_on):
    gc.disable()
    with collector.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_pause_let_go_on_an_error_restores_the_collector(collector_on):
    with pytest.raises(ValueError), collector.paused():
        raise ValueError("the step failed")
    assert gc.isenabled() and collector.holders() == 0


def test_letting_go_of_a_pause_never_taken_is_an_error(collector_on):
    with pytest.raises(RuntimeError, match="let go more times than it was taken"):
        collector.resume()
