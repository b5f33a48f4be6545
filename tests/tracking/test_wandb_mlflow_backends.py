"""W&B (offline) and MLflow (the run folder's database, a chosen store) receive the metrics; skipped where they are
not installed."""

import importlib.machinery
import json
import shutil
import sys
import types

import pytest

from reinforge.config import ConfigError
from reinforge.tracking import Tracker
from reinforge.tracking.external import mlflow_metric_name
from reinforge.trainer.preflight import require_logger_packages


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


@pytest.mark.slow  # MLflow creates its database's tables: 4-6 s
def test_mlflow_writes_into_the_run_folder_and_nothing_into_the_working_directory(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    working = tmp_path / "cwd"
    working.mkdir()
    (working / "mlruns").mkdir()  # MLflow's own default is this folder's file store once it exists
    monkeypatch.chdir(working)
    run_dir = tmp_path / "run"
    with Tracker(run_dir, ["mlflow"], config={"actor": {"optim": {"lr": 1e-6}}}, project="p", experiment="e") as tracker:
        tracker.log({"critic/score/mean": 0.5}, step=1)
        tracker.log({"critic/score/mean": 0.75}, step=2)
    assert sorted(path.name for path in working.rglob("*")) == ["mlruns"]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("p").experiment_id])
    assert run.info.run_name == "e" and run.info.status == "FINISHED" and run.data.params == {"actor.optim.lr": "1e-06"}
    history = client.get_metric_history(run.info.run_id, "critic/score.mean")
    assert [(metric.step, metric.value) for metric in history] == [(1, 0.5), (2, 0.75)]
    assert sorted(path.name for path in working.rglob("*")) == ["mlruns"]


@pytest.mark.slow  # MLflow creates its database's tables: 4-6 s
def test_mlflow_uses_the_database_named_by_mlflow_tracking_uri(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    database = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", database)
    monkeypatch.chdir(tmp_path)
    with Tracker(tmp_path / "run", ["mlflow"], experiment="demo") as tracker:
        tracker.log({"critic/score/mean": 0.5}, step=1)
    runs = mlflow.MlflowClient(tracking_uri=database).search_runs(
        [mlflow.MlflowClient(tracking_uri=database).get_experiment_by_name("reinforge").experiment_id])
    assert [run.data.metrics for run in runs] == [{"critic/score.mean": 0.5}]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run", "shared.db"]


def test_a_file_store_this_mlflow_refuses_is_named_before_the_run_starts(tmp_path, monkeypatch):
    environment = pytest.importorskip("mlflow.environment_variables")
    if not hasattr(environment, "MLFLOW_ALLOW_FILE_STORE"):
        pytest.skip("this MLflow keeps its file store without asking")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError) as refused:
        require_logger_packages(["jsonl", "mlflow"])
    assert str(refused.value) == (
        f"trainer.loggers names mlflow: MLFLOW_TRACKING_URI={(tmp_path / 'mlruns').as_uri()} (environment) is MLflow's "
        "file store, which this MLflow refuses (maintenance mode); unset MLFLOW_TRACKING_URI to keep the metrics in "
        f"RUN_DIR/mlflow.db, point it at a database (sqlite:///{tmp_path / 'mlruns'}.db) or a server, or set "
        "MLFLOW_ALLOW_FILE_STORE=true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    require_logger_packages(["mlflow"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    require_logger_packages(["mlflow"])


@pytest.mark.parametrize("key, name", [("timing_s/gen/gc", "timing_s/gen.gc"), ("timing_s/gen", "timing_s/gen"),
                                       ("val-core/gsm8k/acc/mean@4", "val-core/gsm8k.acc.mean_at_4"),
                                       ("step", "step"), ("perf/mfu(actor)", "perf/mfu_actor_")])
def test_mlflow_metric_names(key, name):
    assert mlflow_metric_name(key) == name


def test_a_resumed_mlflow_run_continues_the_same_mlflow_run_and_a_restart_starts_a_new_one(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "run"
    with Tracker(run_dir, ["mlflow"], config={"lr": 1}, experiment="demo") as tracker:
        tracker.truncate_after(-1)  # a fresh run folder: the run just started is kept
        for step in (1, 2, 3):
            tracker.log({"loss": float(step)}, step=step)
    with Tracker(run_dir, ["mlflow"], config={"lr": 2, "seed": 5}, experiment="demo") as tracker:
        tracker.truncate_after(2)  # resumed from the checkpoint of step 2
        tracker.log({"loss": 30.0}, step=3)
    client = mlflow.MlflowClient()
    [run] = client.search_runs([client.get_experiment_by_name("reinforge").experiment_id])
    assert json.loads((run_dir / "tracking_ids.json").read_text())["mlflow"]["run_id"] == run.info.run_id
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "1", "seed": "5"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")][-1] == (3, 30.0)
    assert run.data.metrics == {"loss": 30.0}
    with Tracker(run_dir, ["mlflow"], experiment="demo") as tracker:
        tracker.truncate_after(-1)  # started over in the same folder: a new MLflow run
        tracker.log({"loss": 7.0}, step=1)
    runs = client.search_runs([client.get_experiment_by_name("reinforge").experiment_id], order_by=["start_time"])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    assert json.loads((run_dir / "tracking_ids.json").read_text())["mlflow"]["run_id"] == runs[-1].info.run_id
    assert runs[-1].data.metrics == {"loss": 7.0}


class FakeWandbRun:
    def __init__(self, kwargs):
        self.kwargs, self.id, self.logged, self.finished = kwargs, kwargs.get("id") or f"run{id(self)}", [], False

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


def fake_wandb(monkeypatch, api_key=None):
    """A stand-in for the wandb module (not installed in the test environment)."""
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.runs = []
    module.init = lambda **kwargs: module.runs.append(FakeWandbRun(kwargs)) or module.runs[-1]
    module.api = types.SimpleNamespace(api_key=api_key)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_a_resumed_wandb_run_continues_the_same_wandb_run_and_a_restart_starts_a_new_one(tmp_path, monkeypatch):
    wandb = fake_wandb(monkeypatch)
    with Tracker(tmp_path, ["wandb"], project="p") as tracker:
        tracker.truncate_after(-1)
        tracker.log({"loss": 1.0}, step=1)
    first = wandb.runs[0]
    assert "id" not in first.kwargs and first.finished and len(wandb.runs) == 1
    with Tracker(tmp_path, ["wandb"], project="p") as tracker:
        tracker.truncate_after(1)
        tracker.log({"loss": 2.0}, step=2)
    assert wandb.runs[1].kwargs["id"] == first.id and wandb.runs[1].kwargs["resume"] == "allow"
    assert wandb.runs[1].logged == [(2, {"loss": 2.0})] and len(wandb.runs) == 2
    with Tracker(tmp_path, ["wandb"], project="p") as tracker:
        tracker.truncate_after(-1)  # started over: the continued run is finished, a new one holds the steps
        tracker.log({"loss": 3.0}, step=1)
    assert wandb.runs[2].kwargs["id"] == first.id and wandb.runs[2].finished and not wandb.runs[2].logged
    assert "id" not in wandb.runs[3].kwargs and wandb.runs[3].logged == [(1, {"loss": 3.0})]
    assert json.loads((tmp_path / "tracking_ids.json").read_text())["wandb"] == {
        "run_id": wandb.runs[3].id, "project": "p", "run_dir": str(tmp_path.resolve())}
    with Tracker(tmp_path, ["wandb"], project="other"):  # another project: a new run there
        pass
    assert "id" not in wandb.runs[4].kwargs
    shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}-copy")
    with Tracker(tmp_path.parent / f"{tmp_path.name}-copy", ["wandb"], project="other") as tracker:
        tracker.truncate_after(3)  # a copy resumed elsewhere: its own run, the original's is left alone
    assert "id" not in wandb.runs[5].kwargs and len(wandb.runs) == 6


def test_wandb_without_an_api_key_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    wandb = fake_wandb(monkeypatch)
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    with pytest.raises(ConfigError) as refused:
        require_logger_packages(["jsonl", "wandb"])
    message = str(refused.value)
    assert message.startswith("trainer.loggers names wandb: W&B has no API key here") and "\n" not in message
    assert all(fix in message for fix in ("wandb login", "WANDB_API_KEY", "WANDB_MODE=offline"))
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled"), ("WANDB_API_KEY", "k" * 40)):
        monkeypatch.setenv(name, value)
        require_logger_packages(["wandb"])
        monkeypatch.delenv(name)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    require_logger_packages(["wandb"])
    (tmp_path / ".netrc").unlink()
    wandb.api.api_key = "k" * 40  # a key wandb knows of otherwise (its settings, wandb.login in this process)
    require_logger_packages(["wandb"])
