import pytest

from reinforge.trainer.validation import summarize_validation


def test_mean_best_and_majority_at_n():
    records = [
        {"data_source": "gsm8k", "uid": "a", "reward": 1.0, "acc": True, "pred": "4"},
        {"data_source": "gsm8k", "uid": "a", "reward": 0.0, "acc": False, "pred": "5"},
        {"data_source": "gsm8k", "uid": "a", "reward": 0.0, "acc": False, "pred": "5"},
        {"data_source": "gsm8k", "uid": "b", "reward": 0.0, "acc": False, "pred": "1"},
        {"data_source": "gsm8k", "uid": "b", "reward": 1.0, "acc": True, "pred": "2"},
        {"data_source": "gsm8k", "uid": "b", "reward": 1.0, "acc": True, "pred": "2"},
        {"data_source": "math", "uid": "c", "reward": 0.5, "pred": "x"},
        {"data_source": "math", "uid": "c", "reward": 0.5, "pred": "x"},
        {"data_source": "math", "uid": "c", "reward": 0.5, "pred": "x"},
    ]
    metrics = summarize_validation(records, num_samples=3)
    assert metrics["val-core/gsm8k/acc/mean@3"] == pytest.approx(0.5)
    assert metrics["val-core/gsm8k/acc/best@3"] == pytest.approx(1.0)
    assert metrics["val-core/gsm8k/acc/maj@3"] == pytest.approx(0.5)  # a votes 5 (wrong), b votes 2 (right)
    assert metrics["val-core/gsm8k/reward/mean@3"] == pytest.approx(0.5)
    assert metrics["val-core/math/reward/maj@3"] == pytest.approx(0.5)
    assert "val-core/math/acc/mean@3" not in metrics


def test_single_sample_reports_mean_only():
    records = [{"data_source": "d", "uid": str(i), "reward": float(i % 2)} for i in range(4)]
    assert summarize_validation(records, num_samples=1) == {"val-core/d/reward/mean@1": 0.5}


@pytest.mark.parametrize("data_source", [None, ""])
def test_rows_without_a_data_source_count_under_default(data_source):
    """The Python API's rows (and a CLI run's rows without the column) name no data source."""
    records = [{"data_source": data_source, "uid": str(i), "reward": float(i % 2)} for i in range(4)]
    assert summarize_validation(records, num_samples=1) == {"val-core/default/reward/mean@1": 0.5}
