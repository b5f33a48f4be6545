import pytest

from reinforge.tracking import Tracker


def test_tensorboard_receives_the_same_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(tmp_path, ["jsonl", "tensorboard"]) as tracker:
        tracker.log({"critic/score/mean": 0.25}, step=1)
        tracker.log({"critic/score/mean": 0.75}, step=2)
    [event_dir] = {path.parent for path in tmp_path.rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(event_dir))
    accumulator.Reload()
    events = accumulator.Scalars("critic/score/mean")
    assert [(event.step, event.value) for event in events] == [(1, 0.25), (2, 0.75)]
