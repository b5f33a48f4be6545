"""The order in which ``make test`` hands out its work units (tests/conftest.py) names files that exist."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_units_handed_out_first_are_test_files_or_one_workers_units(pytestconfig):
    [conftest] = [plugin for plugin in pytestconfig.pluginmanager.get_plugins()
                  if getattr(plugin, "__file__", None) == str(ROOT / "tests" / "conftest.py")]
    units = set(conftest.ONE_WORKER.values())
    missing = [name for name in (*conftest.LONGEST_FIRST, *conftest.ONE_WORKER)
               if name not in units and not (ROOT / name).is_file()]
    assert not missing, f"tests/conftest.py names files that are gone: {missing}"
    assert len(set(conftest.LONGEST_FIRST)) == len(conftest.LONGEST_FIRST)
