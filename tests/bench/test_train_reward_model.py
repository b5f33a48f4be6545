"""``reinforge bench train --reward-model SIZE``: the step scores with a reward model and reports its share."""

import json

import pytest

from reinforge.cli import main


@pytest.mark.slow
def test_bench_train_with_a_reward_model_reports_its_time_and_share(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "train", "--cpu", "--steps", "2", "--reward-model", "0.5b", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    median = results["median"]
    assert 0 < median["reward_model_s"] < median["step_s"]
    assert median["reward_model_share"] == pytest.approx(
        sum(step["reward_model_s"] / step["step_s"] for step in results["steps"][1:]) / len(results["steps"][1:]))
    assert "reward model (0.5b):" in capsys.readouterr().out


def test_an_unknown_reward_model_shape_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "train", "--cpu", "--reward-model", "2b"])
    assert "unknown reward model shape '2b'" in capsys.readouterr().err
