import io
import json
import sys

import numpy as np
import pytest
import torch
from rich.console import Console

from reinforge.tracking import Tracker, read_json_lines, to_float, truncate_after_step


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def quiet_console():
    return Console(file=io.StringIO(), width=200)


def test_jsonl_appends_one_line_per_step_with_plain_floats(tmp_path):
    with Tracker(tmp_path, ["jsonl"]) as tracker:
        tracker.log({"critic/score/mean": torch.tensor(0.5), "actor/entropy": np.float32(1.25), "count": 3}, step=1)
        # each line is on disk before the tracker closes
        assert read_lines(tmp_path / "metrics.jsonl") == [
            {"step": 1, "critic/score/mean": 0.5, "actor/entropy": 1.25, "count": 3.0}]
        tracker.log({"critic/score/mean": 0.75}, step=2)
    assert [line["step"] for line in read_lines(tmp_path / "metrics.jsonl")] == [1, 2]


def test_truncate_after_resume_drops_later_steps_and_keeps_appending(tmp_path):
    with Tracker(tmp_path, ["jsonl"]) as tracker:
        for step in range(1, 6):
            tracker.log({"loss": step}, step=step)
            tracker.log_samples(step, [{"prompt": "p", "response": f"r{step}"}])
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 6, "lo')  # a run killed mid-line
    with Tracker(tmp_path, ["jsonl"]) as tracker:
        tracker.truncate_after(3)
        tracker.log({"loss": 40}, step=4)
    assert [(line["step"], line["loss"]) for line in read_lines(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert [line["response"] for line in read_lines(tmp_path / "samples.jsonl")] == ["r1", "r2", "r3"]


def test_a_line_a_kill_cut_short_costs_only_itself_when_the_file_is_opened_again(tmp_path):
    with Tracker(tmp_path, ["jsonl"]) as tracker:
        tracker.log({"loss": 1}, step=1)
        tracker.log_samples(1, [{"response": "r1"}])
    for name in ("metrics.jsonl", "samples.jsonl"):
        with (tmp_path / name).open("a") as handle:
            handle.write('{"step": 2, "lo')
    with Tracker(tmp_path, ["jsonl"]) as tracker:  # appended to as it is, no truncate_after
        tracker.log({"loss": 2}, step=2)
        tracker.log_samples(2, [{"response": "r2"}])
    with pytest.warns(UserWarning, match="line 2"):
        assert [row["loss"] for row in read_json_lines(tmp_path / "metrics.jsonl")] == [1.0, 2.0]
    with pytest.warns(UserWarning, match="line 2"):
        assert [row["response"] for row in read_json_lines(tmp_path / "samples.jsonl")] == ["r1", "r2"]


def test_nan_and_infinite_values_are_written_as_strict_json_null(tmp_path):
    def strict(line):
        return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not JSON: {line}"))

    with Tracker(tmp_path, ["jsonl"]) as tracker:
        tracker.log({"actor/grad_norm": float("inf"), "loss": float("nan"), "kl": -np.inf, "score": 0.5}, step=1)
        tracker.log_samples(1, [{"response": "r", "score": float("nan"), "scores": [1.0, float("inf")]}])
        tracker.log({"loss": 1.0}, step=2)
    assert [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "actor/grad_norm": None, "loss": None, "kl": None, "score": 0.5}, {"step": 2, "loss": 1.0}]
    assert [strict(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [
        {"step": 1, "response": "r", "score": None, "scores": [1.0, None]}]
    truncate_after_step(tmp_path / "metrics.jsonl", 1)  # rewritten as strict JSON too
    assert [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "actor/grad_norm": None, "loss": None, "kl": None, "score": 0.5}]


def test_a_metric_or_sample_column_named_step_leaves_the_rows_step_as_it_is(tmp_path):
    with Tracker(tmp_path, ["jsonl"]) as tracker:
        tracker.log({"loss": 1.0, "step": 0.5}, step=3)  # a reward function's log_metric("step", ...)
        tracker.log_samples(3, [{"response": "r", "step": 7}])
    assert read_lines(tmp_path / "metrics.jsonl") == [{"loss": 1.0, "step": 3}]
    assert read_lines(tmp_path / "samples.jsonl") == [{"response": "r", "step": 3}]


def test_truncate_after_step_reports_removed_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step}) + "\n" for step in range(4)))
    assert truncate_after_step(path, 1) == 2
    assert truncate_after_step(path, 1) == 0
    assert truncate_after_step(tmp_path / "absent.jsonl", 1) == 0
    with path.open("ab") as handle:  # what a crash may leave at the end: bytes that are no UTF-8
        handle.write(b'{"step": 1, "a": 1}\n\xff\xfe{"st')
    with pytest.warns(UserWarning, match="skipping malformed line 4"):
        assert read_json_lines(path) == [{"step": 0}, {"step": 1}, {"step": 1, "a": 1}]
    assert truncate_after_step(path, 1) == 1
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n{"step": 1, "a": 1}\n'


def test_console_backend_and_progress_print_key_metrics(tmp_path):
    console = quiet_console()
    tracker = Tracker(tmp_path, ["console"], console=console)
    with tracker.progress(3, initial=1) as progress:
        for step in (2, 3):
            metrics = {"critic/score/mean": 0.25 * step, "val-core/gsm8k/reward/mean@4": 0.5, "other": 1.0}
            tracker.log(metrics, step=step)
            progress.advance(metrics)
    tracker.log({"only/unknown": 7}, step=4)
    tracker.close()
    text = console.file.getvalue()
    assert "step 2 │ score 0.5 │ gsm8k/reward/mean@4 0.5" in text
    assert "only/unknown 7" in text
    assert progress.completed == 3
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3, 4]  # the run folder keeps metrics.jsonl whatever trainer.loggers names


def test_progress_without_console_backend_only_counts(tmp_path):
    console = quiet_console()
    with Tracker(tmp_path, ["jsonl"], console=console) as tracker, tracker.progress(2) as progress:
        progress.advance()
    assert progress.completed == 1 and console.file.getvalue() == ""


def test_unknown_backend_lists_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown tracking backend\(s\) \['neptune'\].*known backends: \[.*'jsonl'"):
        Tracker(tmp_path, ["jsonl", "neptune"])


@pytest.mark.parametrize("backend", ["wandb", "mlflow", "tensorboard"])
def test_missing_package_names_the_extra(tmp_path, monkeypatch, backend):
    for module in ("wandb", "mlflow", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)  # import of a None entry raises ImportError
    with pytest.raises(ImportError, match=rf"'{backend}' needs the .* pip install 'reinforge\[tracking\]'"):
        Tracker(tmp_path, ["jsonl", backend])


def test_non_scalar_metric_names_its_key():
    with pytest.raises(ValueError, match="metric 'actor/loss' is a tensor of shape"):
        to_float("actor/loss", torch.ones(3))
    with pytest.raises(ValueError, match="metric 'name' has a str value"):
        to_float("name", "gsm8k")


def test_a_data_source_with_brackets_is_printed_as_it_is(tmp_path):
    # rich read it as markup: "[hard]" vanished from the line, "[/hard]" raised a MarkupError mid-run
    console = quiet_console()
    tracker = Tracker(tmp_path, ["console"], console=console)
    with tracker.progress(2) as progress:
        for step, source in ((1, "math[hard]"), (2, "math[/hard]")):
            metrics = {f"val-core/{source}/reward/mean@1": 0.5}
            tracker.log(metrics, step=step)
            progress.advance(metrics)
    tracker.close()
    text = console.file.getvalue()
    assert "math[hard]/reward/mean@1 0.5" in text and "math[/hard]/reward/mean@1 0.5" in text


def test_every_kind_of_one_number_is_a_metric():
    # a numpy bool (np.all(...), a comparison) stopped the run after its step: "has a bool value; metrics are numbers"
    values = [True, 3, 2.5, np.bool_(True), np.int64(4), np.float32(1.5), np.array([2.0]), torch.tensor(True),
              torch.tensor([0.5])]
    assert [to_float("k", value) for value in values] == [1.0, 3.0, 2.5, 1.0, 4.0, 1.5, 2.0, 1.0, 0.5]
