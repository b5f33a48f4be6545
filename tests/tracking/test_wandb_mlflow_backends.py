"""W&B (offline) and MLflow (local file store) receive the metrics; skipped where they are not installed."""

import pytest

from reinforge.tracking import Tracker
from reinforge.tracking.external import mlflow_metric_name


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Tracker(tmp_path, ["wandb"], config={"actor": {"optim": {"lr": 1e-6}}}) as tracker:
        tracker.log({"critic/score/mean": 0.5}, step=1)
        tracker.log_samples(1, [{"prompt": "p", "response": "r", "score": 1.0}])
    assert list(tmp_path.rglob("*.wandb"))


def test_mlflow_run_holds_the_metrics(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    with Tracker(tmp_path, ["mlflow"], experiment="demo") as tracker:
        tracker.log({"critic/score/mean": 0.5, "val-core/x/acc/mean@1": 0.25}, step=1)
        # one name is the folder of the other in the file store: this crashed MLflow before the renaming
        tracker.log({"timing_s/gen": 2.0, "timing_s/gen/gc": 0.5, "step": 2}, step=2)
    runs = mlflow.search_runs(search_all_experiments=True)
    assert runs["metrics.critic/score.mean"].tolist() == [0.5]
    assert runs["metrics.val-core/x.acc.mean_at_1"].tolist() == [0.25]
    assert runs["metrics.timing_s/gen"].tolist() == [2.0] and runs["metrics.timing_s/gen.gc"].tolist() == [0.5]
    assert runs["metrics.step"].tolist() == [2]


@pytest.mark.parametrize("key, name", [("timing_s/gen/gc", "timing_s/gen.gc"), ("timing_s/gen", "timing_s/gen"),
                                       ("val-core/gsm8k/acc/mean@4", "val-core/gsm8k.acc.mean_at_4"),
                                       ("step", "step"), ("perf/mfu(actor)", "perf/mfu_actor_")])
def test_mlflow_metric_names(key, name):
    assert mlflow_metric_name(key) == name
