"""The ReTool converter: GSM8K rows for the tool_agent loop, asking for a boxed answer the scorer reads."""

from pathlib import Path

import pyarrow.parquet as pq

from reinforge.data.commands import data_main
from reinforge.data.retool import AGENT_NAME, DATA_SOURCE, INSTRUCTION
from reinforge.reward.registry import get_scorer

SAMPLE = Path(__file__).parent / "gsm8k"  # the first 20 rows of each GSM8K split


def test_retool_rows_name_the_tool_agent_and_ask_for_a_boxed_answer(tmp_path, capsys):
    assert data_main(["retool", "--src", str(SAMPLE), "--out", str(tmp_path)]) == 0
    assert "wrote train rows" in capsys.readouterr().out
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(train) == 20 and pq.read_table(tmp_path / "test.parquet").num_rows == 20
    first = train[0]
    assert (first["agent_name"], first["data_source"]) == (AGENT_NAME, DATA_SOURCE) == ("tool_agent", "gsm8k_boxed")
    assert first["prompt"] == [{"role": "user", "content": first["extra_info"]["question"] + "\n\n" + INSTRUCTION}]
    assert "\\boxed{}" in INSTRUCTION and "code_interpreter" in INSTRUCTION
    assert first["reward_model"] == {"style": "rule", "ground_truth": "72"}
    # the scorer of these rows reads the boxed answer, and only that
    scorer = get_scorer(first["data_source"])
    assert scorer("48 + 24 = 72, so the answer is \\boxed{72}.", "72")["acc"] is True
    assert scorer("48 + 24 = 72", "72")["acc"] is False
