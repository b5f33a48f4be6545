"""One memory and process cgroup per slot: a limit on the whole sandbox, not on each of its processes.

rlimits are per process: with RLIMIT_AS at 1 GiB, 60 forked children may hold 60 GiB, and
files in memory (``memfd_create``, tmpfs) are outside the address space altogether (a
program held 600 MB of memfds under a 128 MB limit). A cgroup counts all of it: every
process's pages, its tmpfs and memfd files, kernel memory. When the server can create
cgroups (as root, cgroup v1's ``memory`` and ``pids`` hierarchies, or cgroup v2 with those
controllers) each slot gets a group under the server's own: ``memory_limit_MB`` becomes the
group's limit (swap included) and ``max_processes`` its ``pids.max``; the program joins it
before ``bwrap`` starts, so everything it forks is inside. Without cgroups the rlimits alone
apply, and the server logs a warning that says so.

Where the ``cpu`` controller is there too (v1's ``cpu`` hierarchy, or v2's), each slot is also a
group of its own for CPU time, of equal weight: the scheduler shares the CPUs between slots,
not between processes, so a program that forks 60 busy children (each ``setsid``, an autogroup
of its own) no longer slowed another slot's program thirteenfold; alone, a slot may still use
every CPU. Without it the slots simply share the CPUs process by process.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
_SERVERS = itertools.count()
"""Numbers the servers of this process, so each has groups of its own."""


@dataclass(frozen=True)
class _Hierarchy:
    """Where one controller's groups live, and its file names (v1 and v2 differ)."""

    folder: Path
    limit_files: tuple[str, ...]
    """memory: the limit, then the limit with swap; pids: pids.max."""
    events_file: str
    """The file with an ``oom_kill N`` line (memory only)."""


def _own_path(controller: str) -> str | None:
    """This process's cgroup path for ``controller`` ('' for cgroup v2's unified line)."""
    for line in PROC_SELF_CGROUP.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):  # '' matches v2's line alone; 'cpu' also a 'cpu,cpuacct' one
            return path
    return None


def _under(mount: Path, path: str | None) -> Path:
    """The server's own group inside ``mount`` (the mount's root when that path is not there: a cgroup namespace)."""
    own = mount / (path or "/").lstrip("/")
    return own if own.is_dir() else mount


def _hierarchies() -> list[_Hierarchy] | None:
    """memory and pids, on cgroup v1 or v2; None where neither is mounted with both controllers."""
    v1_memory, v1_pids = CGROUP_ROOT / "memory", CGROUP_ROOT / "pids"
    if (v1_memory / "memory.limit_in_bytes").exists() and (v1_pids / "cgroup.procs").exists():
        return [_Hierarchy(_under(v1_memory, _own_path("memory")),
                           ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"), "memory.oom_control"),
                _Hierarchy(_under(v1_pids, _own_path("pids")), ("pids.max",), "")]
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists() and {"memory", "pids"} <= set(controllers.read_text().split()):
        own = _under(CGROUP_ROOT, _own_path(""))
        return [_Hierarchy(own, ("memory.max", "memory.swap.max"), "memory.events"),
                _Hierarchy(own, ("pids.max",), "")]
    return None


def _cpu_folder(hierarchies: list[_Hierarchy]) -> Path | None:
    """The server's group in a hierarchy with the cpu controller (v1's own, or v2's), None where there is none."""
    memory = hierarchies[0].folder
    if memory == hierarchies[1].folder:  # v2: one hierarchy; cpu must have been given to the server's group
        with contextlib.suppress(OSError):
            if "cpu" in (memory / "cgroup.controllers").read_text().split():
                return memory
        return None
    v1_cpu = CGROUP_ROOT / "cpu"
    if (v1_cpu / "cpu.shares").exists():
        return _under(v1_cpu, _own_path("cpu"))
    return None


def _v2_why_not(own: Path) -> str | None:
    """Why cgroup v2 lets the server make no slot groups with memory and pids limits below its group ``own``
    (None: it does). Two rules of the kernel's: a group hands down only the controllers its parent gave it, and a group
    other than the root that holds processes (the server itself) hands down none ("no internal processes"). Read
    before anything is written, so a host without delegation falls back at once, with the reason."""
    given = set((own / "cgroup.controllers").read_text().split())
    if not {"memory", "pids"} <= given:
        return (f"cgroup v2 gives the server's group {own} the controllers {' '.join(sorted(given)) or '(none)'}, "
                "not memory and pids (no delegation)")
    handed_down = set((own / "cgroup.subtree_control").read_text().split())
    is_root = not (own / "cgroup.type").exists()  # the root group alone has no type (a namespace's root has one)
    if not is_root and not {"memory", "pids"} <= handed_down and (own / "cgroup.procs").read_text().split():
        return (f"the server's cgroup v2 group {own} holds processes (the server's own), and a group that does cannot "
                "hand memory and pids down to groups below it; start the server in a group of its own whose parent "
                "delegates memory and pids (systemd-run --scope -p Delegate=yes, or a container's own cgroup "
                "namespace) for per-sandbox limits")
    return None


def _write(path: Path, value: str) -> None:
    with open(path, "w") as file:
        file.write(value)


def _oom_kills(folder: Path, events_file: str) -> int:
    with contextlib.suppress(OSError):
        for line in (folder / events_file).read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


class SlotCgroups:
    """``slot-N`` groups under ``reinforge-sandbox-<pid>-<n>`` in the server's own cgroup(s)."""

    def __init__(self, hierarchies: list[_Hierarchy], num_slots: int, cpu: Path | None = None) -> None:
        """``cpu``: the server's group in a hierarchy with the cpu controller, for slots of equal CPU weight."""
        self._memory, self._pids = hierarchies
        self.v2 = self._memory.folder == self._pids.folder
        folders = [hierarchy.folder for hierarchy in hierarchies] + ([cpu] if cpu is not None else [])
        _remove_stale(list(dict.fromkeys(folders)))
        name = f"reinforge-sandbox-{os.getpid()}-{next(_SERVERS)}"
        self._tops = list(dict.fromkeys(folder / name for folder in folders))
        self._slots = [[top / f"slot-{slot}" for top in self._tops] for slot in range(num_slots)]
        try:
            for top in self._tops:
                top.mkdir(exist_ok=True)
                if self.v2:  # v2: controllers are handed down explicitly; the top group holds no process itself
                    self._hand_down(top, cpu is not None)
            for folders in self._slots:
                for folder in folders:
                    folder.mkdir(exist_ok=True)
        except OSError:  # leave nothing half made behind
            _remove_groups([folder for folders in self._slots for folder in folders] + self._tops, wait_s=0.0)
            raise
        self._oom_before = [0] * num_slots

    def _hand_down(self, top: Path, cpu: bool) -> None:
        """v2: enable memory and pids (and cpu where it may be had) for the groups below the server's and ``top``."""
        for folder in (self._memory.folder, top):
            try:
                _write(folder / "cgroup.subtree_control", "+memory +pids +cpu" if cpu else "+memory +pids")
            except OSError:
                if not cpu:
                    raise
                cpu = False  # e.g. a real-time thread in the tree: the slots share the CPUs without weights
                _write(folder / "cgroup.subtree_control", "+memory +pids")

    @classmethod
    def create(cls, num_slots: int) -> tuple[SlotCgroups | None, str]:
        """The slots' groups, or None and why not (no cgroup hierarchy with memory and pids, not allowed)."""
        if os.geteuid() != 0:
            return None, "the server is not root"
        try:
            hierarchies = _hierarchies()
            if hierarchies is None:
                return None, f"no cgroup hierarchy with the memory and pids controllers under {CGROUP_ROOT}"
            why_not = _v2_why_not(hierarchies[0].folder) if hierarchies[0].folder == hierarchies[1].folder else None
            if why_not is not None:
                return None, why_not
        except OSError as error:
            return None, f"cannot read the cgroup hierarchies: {error}"
        try:
            return cls(hierarchies, num_slots, _cpu_folder(hierarchies)), ""
        except OSError as error:  # e.g. cgroup v2 refusing controllers below a group that holds processes
            return None, f"cannot create cgroups: {error}"

    def _folder(self, slot: int, hierarchy: _Hierarchy) -> Path:
        return self._slots[slot][0 if self.v2 or hierarchy is self._memory else 1]

    def prepare(self, slot: int, memory_mb: int, max_processes: int) -> list[str]:
        """Set slot ``slot``'s limits; the ``cgroup.procs`` files a program writes "0" to, to join."""
        self.kill(slot)
        memory = self._folder(slot, self._memory)
        limit = str(memory_mb << 20)
        limit_file, swap_file = self._memory.limit_files
        if self.v2:
            _write(memory / limit_file, limit)
            if (memory / swap_file).exists():  # absent where swap is not accounted
                _write(memory / swap_file, "0")
        else:  # v1: the limit with swap may never be below the plain limit; write in the order that keeps it so
            try:
                _write(memory / limit_file, limit)
                if (memory / swap_file).exists():
                    _write(memory / swap_file, limit)
            except OSError:
                _write(memory / swap_file, limit)
                _write(memory / limit_file, limit)
        _write(self._folder(slot, self._pids) / "pids.max", str(max_processes))
        self._oom_before[slot] = _oom_kills(memory, self._memory.events_file)
        return [str(folder / "cgroup.procs") for folder in self._slots[slot]]

    def memory_exceeded(self, slot: int) -> bool:
        """Whether the kernel killed a process of this slot for its memory limit since ``prepare``."""
        return _oom_kills(self._folder(slot, self._memory), self._memory.events_file) > self._oom_before[slot]

    def kill(self, slot: int) -> int:
        """SIGKILL every process still in slot ``slot``'s groups; returns how many."""
        killed = 0
        for folder in self._slots[slot]:
            with contextlib.suppress(OSError):
                for pid in (folder / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                        killed += 1
        return killed

    def remove(self) -> None:
        """Remove the groups (best effort: a group whose process will not die within 2 s stays)."""
        for slot in range(len(self._slots)):
            self.kill(slot)
        _remove_groups([folder for folders in self._slots for folder in folders] + self._tops)


def _remove_groups(folders: list[Path], wait_s: float = 2.0) -> None:
    """rmdir each group once the processes just killed have left it (rmdir fails while one is exiting)."""
    deadline = time.monotonic() + wait_s
    for folder in folders:
        while True:
            try:
                folder.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)


def _remove_stale(parents: list[Path]) -> None:
    """Groups left by servers of this host that were killed (their pid is gone): empty ones are removed."""
    for parent in parents:
        for top in parent.glob("reinforge-sandbox-*-*"):
            pid = top.name.split("-")[2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _remove_groups([*top.glob("slot-*"), top], wait_s=0.0)
