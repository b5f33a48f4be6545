"""``reinforge bench serve --cpu``: the smoke mode runs both ways and gets the same replies."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("aiohttp")


@pytest.mark.slow
def test_bench_serve_smoke_mode_writes_both_runs_with_the_same_replies(tmp_path):
    from reinforge.bench.serve import serve_bench_main

    out = tmp_path / "serve.json"
    assert serve_bench_main(["--cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["same_replies"] is True and result["num_requests"] == 8
    assert [row["run"] for row in result["rows"]] == ["in process (AsyncEngineClient)", "HTTP /v1/chat/completions"]
    assert all(row["sampled_tokens"] > 0 and row["p99_latency_s"] >= row["p50_latency_s"] for row in result["rows"])
