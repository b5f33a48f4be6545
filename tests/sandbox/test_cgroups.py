"""Per-slot cgroups: the limits a slot's program joins, and no group left behind."""

from __future__ import annotations

import dataclasses
import os

import pytest

from reinforge.sandbox import cgroups as cgroup_module
from reinforge.sandbox.cgroups import SlotCgroups


def test_slot_groups_carry_the_limits_and_are_removed():
    cgroups, why_not = SlotCgroups.create(num_slots=2)
    if cgroups is None:
        assert why_not  # says why: not root, no controllers, not allowed
        pytest.skip(f"no cgroups here: {why_not}")
    try:
        procs = cgroups.prepare(1, memory_mb=300, max_processes=17)
        folders = [os.path.dirname(path) for path in procs]
        assert all(os.path.isdir(folder) and folder.endswith("slot-1") for folder in folders)
        limits = {name: open(os.path.join(folder, name)).read().strip() for folder in folders
                  for name in ("memory.limit_in_bytes", "memory.max", "pids.max")
                  if os.path.exists(os.path.join(folder, name))}
        assert limits["pids.max"] == "17"
        assert limits.get("memory.limit_in_bytes", limits.get("memory.max")) == str(300 << 20)
        assert not cgroups.memory_exceeded(1) and cgroups.kill(1) == 0
    finally:
        cgroups.remove()
    assert not any(os.path.exists(os.path.dirname(path)) for path in procs)


def test_groups_of_a_killed_server_are_removed_by_the_next():
    probe, why_not = SlotCgroups.create(num_slots=1)
    if probe is None:
        pytest.skip(f"no cgroups here: {why_not}")
    parents = {top.parent for top in probe._tops}
    probe.remove()
    stale = [parent / "reinforge-sandbox-999999999-0" for parent in parents]  # above pid_max: a dead server
    for top in stale:
        (top / "slot-0").mkdir(parents=True)
    cgroups, _ = SlotCgroups.create(num_slots=1)
    cgroups.remove()
    assert not any(top.exists() for top in stale)


def test_groups_half_made_when_creation_fails_are_removed(tmp_path):
    hierarchies = cgroup_module._hierarchies() if os.geteuid() == 0 else None
    if hierarchies is None or hierarchies[0].folder == hierarchies[1].folder:
        pytest.skip("needs root and cgroup v1's separate memory and pids hierarchies")
    before = set(hierarchies[0].folder.glob("reinforge-sandbox-*"))
    broken = [hierarchies[0], dataclasses.replace(hierarchies[1], folder=tmp_path / "no-such-hierarchy")]
    with pytest.raises(OSError):
        SlotCgroups(broken, num_slots=2)  # the memory groups are made, then the pids ones fail
    assert set(hierarchies[0].folder.glob("reinforge-sandbox-*")) == before
