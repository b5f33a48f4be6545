"""Per-slot cgroups: the limits a slot's program joins, and no group left behind."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

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


def _fake_v2_host(monkeypatch, tmp_path, own: str, files: dict[str, str]):
    """A cgroup v2 tree under ``tmp_path`` (the root offering memory and pids) with the server in group ``own``,
    holding ``files``; the server taken for root."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text("1\n")
    folder = root / own.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    (tmp_path / "self_cgroup").write_text(f"0::{own}\n")
    monkeypatch.setattr(cgroup_module, "CGROUP_ROOT", root)
    monkeypatch.setattr(cgroup_module, "PROC_SELF_CGROUP", tmp_path / "self_cgroup")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    return root, folder


@pytest.mark.parametrize(("files", "reason"), [
    # a service's group (systemd, a container's namespace root) holding the server: no internal processes
    ({"cgroup.type": "domain\n", "cgroup.controllers": "memory pids\n", "cgroup.subtree_control": "",
      "cgroup.procs": "4242\n"}, "holds processes (the server's own), and a group that does cannot hand memory and "
                                 "pids down"),
    # the parent gave the group no memory controller
    ({"cgroup.type": "domain\n", "cgroup.controllers": "cpu pids\n", "cgroup.subtree_control": "",
      "cgroup.procs": ""}, "the controllers cpu pids, not memory and pids (no delegation)"),
])
def test_a_cgroup_v2_host_without_delegation_falls_back_to_rlimits_with_the_reason(monkeypatch, tmp_path, files,
                                                                                   reason):
    """On such a host the server wrote to cgroup.subtree_control first and fell back on the kernel's bare EBUSY or
    ENOENT; the reason is now read before anything is written, and nothing is made."""
    root, own = _fake_v2_host(monkeypatch, tmp_path, "/system.slice/sandbox.service", files)
    cgroups, why_not = SlotCgroups.create(num_slots=2)
    assert cgroups is None and reason in why_not and "\n" not in why_not, why_not
    assert not list(root.rglob("reinforge-sandbox-*")) and (own / "cgroup.subtree_control").read_text() == ""


def test_a_cgroup_v2_root_group_or_a_delegated_one_gets_slot_groups_with_the_limits(monkeypatch, tmp_path):
    # the root group may hold processes and still hand controllers down
    root, _ = _fake_v2_host(monkeypatch, tmp_path, "/", {})
    cgroups, why_not = SlotCgroups.create(num_slots=2)
    assert cgroups is not None and cgroups.v2, why_not
    procs = cgroups.prepare(1, memory_mb=300, max_processes=17)
    (slot,) = {Path(path).parent for path in procs}
    assert slot.name == "slot-1" and slot.parent.parent == root
    assert (slot / "memory.max").read_text() == str(300 << 20) and (slot / "pids.max").read_text() == "17"
    assert "+memory +pids" in (root / "cgroup.subtree_control").read_text()
