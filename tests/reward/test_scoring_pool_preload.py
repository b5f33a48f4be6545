"""Scorer processes fork from a forkserver that has imported the scoring pool's module already."""

from __future__ import annotations

import json
from multiprocessing import forkserver

from reinforge.reward.scoring_pool import ScoringJob, ScoringPool


def test_the_forkserver_preloads_the_scoring_module_after_what_the_process_asked_for(monkeypatch):
    server = forkserver._forkserver
    monkeypatch.setattr(server, "_preload_modules", ["__main__", "json"])  # what the process set for itself
    pool = ScoringPool(num_workers=1, timeout_s=60.0)
    try:
        [result] = pool.run([ScoringJob(json.loads, {"s": "2.5"})])
    finally:
        pool.close()
    assert result.value == 2.5, result
    assert server._preload_modules == ["__main__", "json", "reinforge.reward.scoring_pool"]
