import gc
import json
import math
from pathlib import Path

import pytest

from reinforge.tracking.plots import load_run_metrics, plot_main, plot_runs, smooth


def write_run(folder, num_steps, offset=0.0, tail=""):
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": step, "critic/score/mean": offset + step / num_steps, "actor/entropy": 1.0 / step,
                         "val-core/gsm8k/reward/mean@1": offset, "timing_s/step": 1.0})
             for step in range(1, num_steps + 1)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)
    return folder


def is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_run_writes_default_keys_into_run_plots(tmp_path):
    run = write_run(tmp_path / "run_a", 12, tail='{"step": 13, "critic/sc')
    with pytest.warns(UserWarning, match="skipping malformed line 13"):
        written = plot_runs([run])
    assert sorted(path.name for path in written) == [
        "actor_entropy.png", "critic_score_mean.png", "val-core_gsm8k_reward_mean@1.png"]
    assert all(path.parent == run / "plots" and is_png(path) for path in written)


@pytest.mark.parametrize("record, charts", [
    ({"train/loss": 2.0, "train/lr": 1e-5, "val/loss": 2.1}, ["train_loss.png", "val_loss.png"]),  # sft
    ({"train/loss": 0.7, "accuracy": 0.5, "margin": 0.1, "eval_accuracy": 0.5, "eval_loss": 0.69},  # rm
     ["accuracy.png", "eval_accuracy.png", "eval_loss.png", "margin.png", "train_loss.png"]),
    ({"train/loss": 0.69, "rewards/accuracies": 0.5, "rewards/margins": 0.0, "eval_rewards/margins": 0.0},  # dpo
     ["eval_rewards_margins.png", "rewards_accuracies.png", "rewards_margins.png", "train_loss.png"]),
])
def test_supervised_and_preference_runs_plot_their_loss_and_validation_by_default(tmp_path, record, charts):
    run = tmp_path / "run"  # was: "nothing to plot" for every run but RL's
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, **record}) + "\n" for step in (1, 2, 3)))
    assert sorted(path.name for path in plot_runs([run])) == charts


def test_two_runs_share_charts_and_keys_can_be_chosen(tmp_path):
    runs = [write_run(tmp_path / "a", 8), write_run(tmp_path / "b", 5, offset=0.5)]
    written = plot_runs(runs, out_dir=tmp_path / "compare", keys=["timing_s/step"], smoothing=0.0)
    assert written == [tmp_path / "compare" / "timing_s_step.png"] and is_png(written[0])


def test_plot_main_reports_a_missing_metrics_file(tmp_path, capsys):
    (tmp_path / "empty_run").mkdir()
    assert plot_main([str(tmp_path / "empty_run")]) == 2  # a usage error, as for every command; 1 is a failed run
    assert f"{tmp_path / 'empty_run'} has no metrics.jsonl" in capsys.readouterr().err


def test_plot_main_writes_and_prints_paths(tmp_path, capsys):
    run = write_run(tmp_path / "run", 4)
    assert plot_main([str(run), "--keys", "actor/entropy", "--smoothing", "0.9"]) == 0
    assert capsys.readouterr().out.strip() == str(run / "plots" / "actor_entropy.png")


def test_plot_main_names_unknown_keys_with_a_guess_in_one_line(tmp_path, capsys):
    run = write_run(tmp_path / "run", 4)
    gc.collect()  # objects an earlier test of this process left unclosed warn when collected, not the plot's lines
    capsys.readouterr()
    assert plot_main([str(run), "--keys", "critic/score/maen"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("reinforge plot: no run has the key critic/score/maen (did you "
                                                    "mean critic/score/mean?); the runs have: actor/entropy, ")
    assert plot_main([str(run), "--keys", "nosuch,actor/entropy"]) == 0  # the known key is drawn, the other named
    captured = capsys.readouterr()
    assert captured.err == "reinforge plot: no run has the key nosuch; skipping it\n"
    assert captured.out.strip() == str(run / "plots" / "actor_entropy.png")


def test_plot_main_on_a_run_without_metrics_yet_or_without_default_keys_says_so_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    for keys in ([], ["--keys", "critic/score/mean"]):
        assert plot_main([str(run), *keys]) == 1
        assert capsys.readouterr().err == (f"reinforge plot: {run / 'metrics.jsonl'} holds no metrics yet (no step has "
                                           "ended); draw the charts once the run has logged a step\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "my/metric": 1.0}\n')
    assert plot_main([str(run)]) == 1
    assert capsys.readouterr().err.endswith("; pass --keys with some of: my/metric\n")
    assert plot_main([str(run), "--keys", " , "]) == 2  # was taken as no key at all, and nothing drawn
    assert capsys.readouterr().err == ("reinforge plot: --keys ' , ' names no key; give metric keys separated by "
                                       "commas, or leave --keys out for the default charts\n")


def test_keys_that_name_the_same_file_each_get_a_chart_and_nan_or_null_values_draw(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "a/b": 1.0, "a_b": 2.0, "x y": null}\n'
                                       '{"step": 2, "a/b": NaN, "a_b": Infinity, "x y": 1.0}\n')
    assert plot_main([str(run), "--keys", "a/b,a_b,x y,a/b"]) == 0
    written = capsys.readouterr().out.split("\n")[:-1]
    assert [Path(path).name for path in written] == ["a_b.png", "a_b-2.png", "x y.png"]
    assert all(is_png(Path(path)) for path in written)
    assert load_run_metrics(run)["x y"][1] == (2, 1.0) and math.isnan(load_run_metrics(run)["x y"][0][1])


def test_smoothing_is_debiased_and_validated():
    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert smooth([0.0, 1.0], 0.5) == pytest.approx([0.0, 2 / 3])
    with pytest.raises(ValueError, match="smoothing=1.0 must be in"):
        smooth([1.0], 1.0)


def test_a_failed_redraw_leaves_the_last_good_png(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run", 6)
    [first] = plot_runs([run], keys=["timing_s/step"])
    good = first.read_bytes()
    from matplotlib.figure import Figure

    def cut_off(self, target, **kwargs):  # a kill or a full disk in the middle of the write
        with open(target, "wb") as handle:
            handle.write(good[:10])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", cut_off)
    with pytest.raises(OSError):
        plot_runs([run], keys=["timing_s/step"])
    assert first.read_bytes() == good and sorted(path.name for path in first.parent.iterdir()) == [first.name]


def test_the_plots_logger_draws_a_runs_charts_when_it_ends_and_a_failure_costs_one_line(tmp_path, monkeypatch,
                                                                                          caplog):
    from reinforge.tracking import plots as plots_module
    from reinforge.tracking.tracker import Tracker

    with Tracker(tmp_path / "run", ["jsonl", "plots"]) as tracker:
        for step in (1, 2, 3):
            tracker.log({"critic/score/mean": step / 3, "timing_s/step": 1.0}, step)
        assert not (tmp_path / "run" / "plots").exists()  # drawn when the run ends
    assert sorted(path.name for path in (tmp_path / "run" / "plots").iterdir()) == ["critic_score_mean.png"]

    with Tracker(tmp_path / "quiet", ["jsonl", "plots"]):
        pass  # nothing logged: no charts
    assert not (tmp_path / "quiet" / "plots").exists()

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots_module, "plot_runs", broken)
    with Tracker(tmp_path / "full", ["jsonl", "plots"]) as tracker:
        tracker.log({"critic/score/mean": 1.0}, 1)
    assert [record.getMessage() for record in caplog.records] == [
        f"the plots logger drew no charts into {tmp_path / 'full' / 'plots'}: [Errno 28] No space left on device; "
        f"reinforge plot {tmp_path / 'full'} draws them from metrics.jsonl"]
    assert (tmp_path / "full" / "metrics.jsonl").read_text().count("\n") == 1


def test_the_charts_draw_after_every_other_logger_closes_and_an_interrupt_leaves_those_closed(tmp_path, monkeypatch):
    from reinforge.tracking import plots as plots_module
    from reinforge.tracking.backends import TRACKING_BACKENDS, TrackingBackend
    from reinforge.tracking.tracker import Tracker

    closed = []

    class Recording(TrackingBackend):
        def __init__(self, run):
            pass

        def log(self, metrics, step):
            pass

        def close(self):
            closed.append("recording")

    def interrupted(*args, **kwargs):  # a second Ctrl-C while the charts draw
        closed.append("plots")
        raise KeyboardInterrupt

    monkeypatch.setitem(TRACKING_BACKENDS, "recording", Recording)
    monkeypatch.setattr(plots_module, "plot_runs", interrupted)
    tracker = Tracker(tmp_path / "run", ["plots", "recording"])
    tracker.log({"critic/score/mean": 1.0}, 1)
    with pytest.raises(KeyboardInterrupt):
        tracker.close()
    assert closed == ["recording", "plots"]  # listed first, drawn last; the other closed before the interrupt


def test_the_plots_logger_draws_at_most_its_cap_of_charts_and_says_so(tmp_path, monkeypatch, caplog):
    from reinforge.tracking import plots as plots_module
    from reinforge.tracking.tracker import Tracker

    monkeypatch.setattr(plots_module.PlotsBackend, "MAX_CHARTS", 3)
    with caplog.at_level("INFO"), Tracker(tmp_path / "run", ["plots"]) as tracker:
        tracker.log({"critic/score/mean": 1.0, **{f"val-core/set{index}/acc/mean@1": 0.5 for index in range(5)}}, 1)
    assert sorted(path.name for path in (tmp_path / "run" / "plots").iterdir()) == [
        "critic_score_mean.png", "val-core_set0_acc_mean@1.png", "val-core_set1_acc_mean@1.png"]
    assert "draws the first 3 of 6 charts" in caplog.text


def test_the_plots_logger_reads_metrics_jsonl_once_and_draws_what_reinforge_plot_draws(tmp_path, monkeypatch):
    from reinforge.tracking import plots as plots_module
    from reinforge.tracking.tracker import Tracker

    reads = []
    read_json_lines = plots_module.read_json_lines
    monkeypatch.setattr(plots_module, "read_json_lines", lambda path: reads.append(path) or read_json_lines(path))
    with Tracker(tmp_path / "run", ["jsonl", "plots"]) as tracker:
        for step in (1, 2, 3):
            tracker.log({"critic/score/mean": step / 3, "actor/entropy": 1.0 / step, "val/loss": 0.5}, step)
    assert reads == [tmp_path / "run" / "metrics.jsonl"]
    drawn = sorted((tmp_path / "run" / "plots").iterdir())
    again = sorted(plot_runs([tmp_path / "run"], out_dir=tmp_path / "again"))
    assert [path.name for path in drawn] == [path.name for path in again] == [
        "actor_entropy.png", "critic_score_mean.png", "val_loss.png"]
    assert [path.read_bytes() for path in drawn] == [path.read_bytes() for path in again]


def test_a_training_runs_failed_chart_names_its_output_dir_not_the_plot_commands_flag(tmp_path, monkeypatch,
                                                                                     caplog):
    """A training run has no --out: its line said to set it."""
    from matplotlib.figure import Figure

    from reinforge.tracking.tracker import Tracker

    def full(self, target, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    with Tracker(tmp_path / "run", ["jsonl", "plots"]) as tracker:
        tracker.log({"critic/score/mean": 1.0}, 1)
    [line] = [record.getMessage() for record in caplog.records]
    assert "set trainer.output_dir to a folder on another disk" in line and "--out" not in line
    with pytest.raises(OSError, match="set --out to a folder on another disk"):
        plot_runs([tmp_path / "run"], keys=["critic/score/mean"])
