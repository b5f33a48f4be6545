"""W&B (offline) and MLflow (local file store) receive the metrics; skipped where they are not installed."""

import pytest

from reinforge.tracking import Tracker


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
    runs = mlflow.search_runs(search_all_experiments=True)
    assert runs["metrics.critic/score/mean"].tolist() == [0.5]
    assert [name for name in runs.columns if name.startswith("metrics.val-core")]
