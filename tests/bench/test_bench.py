"""`reinforge bench`: its benchmarks by name, `rollout` when none is named."""

from __future__ import annotations

from reinforge.cli import main


def test_bench_lists_its_benchmarks_and_names_an_unknown_one(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name}" in out for name in ("rollout", "train", "agent", "modes", "table"))
    assert main(["bench", "trian"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("reinforge bench: unknown benchmark 'trian'; give one of rollout, train, agent, modes")
