"""What walls a program runs behind: the bubblewrap command line, rlimits and user ids.

A program runs as ``bwrap`` builds it: new user, PID, network, IPC, UTS and cgroup
namespaces (the network one holds only a loopback of its own), a root that is an empty tmpfs
holding read-only binds of /usr and the loader's folders and then remounted read-only, a
private size-limited tmpfs at /tmp as its working folder, /proc of its own PID namespace, a
minimal /dev without terminals, a seccomp filter (``seccomp_filter``), no further user
namespaces, its own session, and death with its parent. The program is the PID namespace's
init itself (``--as-pid-1``): bwrap's own init would exit without being
reaped by bwrap, leaving a zombie on the host's PID 1 after every run (forever, where that is
this server in a container). That init is a shell that runs the program as its child and exits
with its status (128 + N for signal N): as init itself, a signal without a handler (SIGTERM to
itself, ``signal.alarm``) would be ignored, and code that relies on one would run on. Code
and files are copied in from in-memory files (memfd), so nothing of the host's disk is
writable or even visible beyond those binds. The server's files, the project and /etc are not
there at all.

rlimits cap address space, CPU seconds, processes, file size and open files. When the server
runs as root each concurrency slot has its own user id, so one program's fork bomb cannot use
up another's process limit and no program can signal or read another's processes.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import resource
import shutil
import signal
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from reinforge.sandbox.settings import SandboxSettings

SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Host folders a program needs to start an interpreter; on a merged-/usr system all but /usr are links."""
ETC_ENTRIES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
BLAS_THREADS = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
"""numpy's BLAS would start a thread per host CPU at import: on a 128-core host that is past the
64-process limit (threads count) and the import fails; one program, one thread."""
UNBUFFERED = {"PYTHONUNBUFFERED": "1"}
"""Python block-buffers stdout written to a pipe, and a program killed at its timeout (or by the memory limit) loses
the buffer: the caller saw none of what it had printed. Each write goes through instead, as on a terminal; the
output cap bounds what a print loop can cost."""
MALLOC_ARENAS = {"MALLOC_ARENA_MAX": "2"}
"""glibc reserves a 64 MiB malloc arena for each new thread (up to 8 per CPU), and reserved address space counts
against the memory limit (RLIMIT_AS): under the default 1 GiB a thread pool failed after 14 threads. Two arenas
bound that reservation whatever the number of threads."""
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONPATH": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg", **BLAS_THREADS, **UNBUFFERED,
               **MALLOC_ARENAS}
CODE_FOLDER = "/code"
INIT = ("/bin/sh", "-c", '"$@"; exit $?', "sandbox-init")
"""PID 1 of each sandbox: runs the program (the arguments after it) as a child, exits with its status."""
SHM_MB = 64
"""Size of /dev/shm (multiprocessing's locks live there); the rest of /dev is read-only."""
WORK_FOLDER = "/tmp"
NO_PTYS = ("--size", "4096", "--perms", "0555", "--tmpfs", "/dev/pts", "--remount-ro", "/dev/pts")
"""An empty read-only /dev/pts over bwrap's devpts (/dev/ptmx links into it): every devpts but the host's own shares
one pool of ``kernel.pty.max`` - ``kernel.pty.reserve`` terminals (3072 by default), and one program holding 64 x
1024 of them left none to other sandboxes, or to the host's containers, until it ended. Programs get no terminals."""


SECCOMP_ARCHES = {"x86_64": (0xC000003E, 206), "aarch64": (0xC00000B7, 0)}
"""Machine -> (the kernel's audit arch, the number of io_setup there)."""
X32_SYSCALL_BIT = 0x40000000
ENOSYS = 38


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """A classic-BPF seccomp program for ``bwrap --seccomp``: io_setup fails with ENOSYS, as do system calls of another
    ABI (32-bit x86, x32) that would get round it; None on a machine not listed in ``SECCOMP_ARCHES``.

    aio contexts come from one pool for the whole host (``fs.aio-max-nr``, 65536 events): a program holding them
    made io_setup fail with EAGAIN for the host's own processes until it ended. Programs use threads for I/O instead.
    """
    arch = SECCOMP_ARCHES.get(machine or os.uname().machine)
    if arch is None:
        return None
    audit_arch, io_setup = arch
    load_word, jump_eq, jump_ge, ret = 0x20, 0x15, 0x35, 0x06
    errno, allow = 0x00050000 | ENOSYS, 0x7FFF0000
    program = [
        (load_word, 0, 0, 4),  # seccomp_data.arch
        (jump_eq, 1, 0, audit_arch),
        (ret, 0, 0, errno),
        (load_word, 0, 0, 0),  # seccomp_data.nr
        (jump_ge, 2, 0, X32_SYSCALL_BIT),
        (jump_eq, 1, 0, io_setup),
        (ret, 0, 0, allow),
        (ret, 0, 0, errno),
    ]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


class IsolationError(RuntimeError):
    """The sandbox cannot isolate programs on this machine; the server refuses to start."""


def find_bwrap() -> str:
    """Path of ``bwrap``, or an IsolationError saying how to install it or what the unsafe flag gives up."""
    path = shutil.which("bwrap")
    if path is None:
        raise IsolationError(
            "bubblewrap (bwrap) is not installed, so model-written code cannot be isolated; install it "
            "(Debian/Ubuntu: apt-get install -y bubblewrap) or pass --unsafe-no-isolation to run code with "
            "this machine's files and network in reach")
    return path


def default_python() -> str:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("python3")
    if found is None:
        raise IsolationError("no python3 found for sandboxed programs; pass --python /path/to/python3")
    return found


def check_interpreter_visible(interpreter: str, settings: SandboxSettings) -> None:
    """IsolationError naming ``--read-only-path`` when ``interpreter`` lies outside every folder the sandbox shows.

    Only /usr (and the loader's folders) and the ``read_only_paths`` are inside: a conda or virtualenv python
    elsewhere is "not found" there, which read as a problem of bubblewrap or of the kernel.
    """
    path = os.path.abspath(interpreter)
    shown = [*SYSTEM_FOLDERS, *(os.path.abspath(folder) for folder in settings.read_only_paths)]
    if any(os.path.commonpath([path, folder]) == folder for folder in shown):
        return
    folder = os.path.dirname(path)
    if os.path.basename(folder) == "bin":  # an environment's root holds its libraries too
        folder = os.path.dirname(folder)
    which = f"--python {interpreter}" if settings.python else f"the python3 found on PATH, {interpreter},"
    raise IsolationError(f"{which} is outside the sandbox, which shows only /usr and the --read-only-path folders; "
                         f"add --read-only-path {folder} (or pass --python with a python under /usr)")


def _mount_arguments(extra_read_only: list[str]) -> list[str]:
    arguments: list[str] = []
    for folder in SYSTEM_FOLDERS:
        path = Path(folder)
        if path.is_symlink():
            arguments += ["--symlink", os.readlink(path), folder]
        elif path.is_dir():
            arguments += ["--ro-bind", folder, folder]
    for entry in ETC_ENTRIES:
        arguments += ["--ro-bind-try", entry, entry]
    for folder in extra_read_only:
        arguments += ["--ro-bind", folder, folder]
    return arguments


def bwrap_command(bwrap: str, settings: SandboxSettings, program: list[str], file_fds: list[tuple[int, str]],
                  status_fd: int, seccomp_fd: int | None = None) -> list[str]:
    """The full argv: bwrap's options, then ``program``; each (fd, path) is copied to that sandbox path; the
    program runs under the seccomp filter read from ``seccomp_fd`` (``seccomp_filter``) when there is one.

    bwrap writes JSON lines to ``status_fd``: the child's pid, then ``{"exit-code": N}`` once
    the program ends (absent when bwrap itself failed to set up the sandbox).
    """
    arguments = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                 "--new-session", "--as-pid-1", "--json-status-fd", str(status_fd), *_mount_arguments(settings.read_only_paths),
                 "--dev", "/dev", "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm", *NO_PTYS, "--remount-ro", "/dev",
                 "--proc", "/proc", "--size", str(settings.tmp_size_mb << 20), "--tmpfs", WORK_FOLDER,
                 "--dir", CODE_FOLDER]
    made = {WORK_FOLDER, CODE_FOLDER}
    for fd, path in file_fds:
        parent = os.path.dirname(path)
        missing = []
        while parent not in made and parent != "/":
            missing.append(parent)
            parent = os.path.dirname(parent)
        for folder in reversed(missing):
            arguments += ["--dir", folder]
            made.add(folder)
        arguments += ["--file", str(fd), path]
    if seccomp_fd is not None:
        arguments += ["--seccomp", str(seccomp_fd)]
    return [*arguments, "--remount-ro", "/", "--chdir", WORK_FOLDER, *program]


def slot_identity(slot: int, settings: SandboxSettings) -> tuple[int, int] | None:
    """(uid, gid) a slot's programs run as: uid_base + slot as root, None (the server's own) otherwise."""
    if os.geteuid() != 0:
        return None
    return settings.uid_base + slot, settings.uid_base + slot


UID_LOCK_FOLDERS = ("/run/lock", tempfile.gettempdir())
MAX_UID_SHIFTS = 256


class UidRange:
    """An exclusive hold, for this server's life, on the user ids its slots run as (root only).

    Two servers on one host with the same ids would share their programs' process limit, and
    one's clean-up (kill every process of a slot's id) would kill the other's running program.
    Each id is held by an flock on ``reinforge-sandbox-uid-<id>.lock``; a range with an id held by
    another server is passed over for the next one up. The locks go with the process, even killed.
    So is a range with an id of a user of this host (in the passwd database) or of a running
    process: the clean-up after each run kills every process of the slot's id, which with
    ``--uid-base 0`` was every root process, the server's own included.
    """

    def __init__(self, wanted_base: int, count: int) -> None:
        folder = next((path for path in UID_LOCK_FOLDERS if os.access(path, os.W_OK)), None)
        if folder is None:
            raise IsolationError(f"no writable folder among {', '.join(UID_LOCK_FOLDERS)} to lock sandbox user ids in")
        self._fds: list[int] = []
        in_use = _uids_in_use()
        for shift in range(MAX_UID_SHIFTS):
            self.base = wanted_base + shift * count
            if in_use.isdisjoint(range(self.base, self.base + count)) and all(
                    self._lock(os.path.join(folder, f"reinforge-sandbox-uid-{self.base + slot}.lock"))
                    for slot in range(count)):
                return
            self.release()
        raise IsolationError(f"user ids {wanted_base}..{self.base + count - 1} are all held by other sandbox "
                             "servers or used by users or processes of this host; pass --uid-base with a free range")

    def _lock(self, path: str) -> bool:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fds.append(fd)
        return True

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _uids_in_use() -> set[int]:
    """User ids of this host's passwd users and of its running processes: never a slot's (it would kill them)."""
    return {entry.pw_uid for entry in pwd.getpwall()} | {uid for _, uid in _process_uids()}


def _process_uids() -> Iterator[tuple[int, int]]:
    """(PID as the host sees it, real user id) of every running process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                for line in status:
                    if line.startswith("Uid:"):
                        yield int(entry), int(line.split()[1])
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue


def processes_of_user(uid: int) -> list[int]:
    """PIDs (as the host sees them) of every process whose real user id is ``uid``."""
    return [pid for pid, owner in _process_uids() if owner == uid]


def kill_user_processes(uid: int) -> int:
    """SIGKILL every process of a slot's dedicated user id (left over after its sandbox ended); returns the count."""
    killed = 0
    for pid in processes_of_user(uid):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def child_setup(memory_mb: int, cpu_seconds: int, settings: SandboxSettings, identity: tuple[int, int] | None,
                cgroup_procs: list[str]) -> Callable[[], None]:
    """A ``preexec_fn`` run in the child before it execs bwrap: join the slot's cgroups (as root, so first),
    take the slot's user id, lower the rlimits (the program inherits all three).

    Without a dedicated user id (server not root) RLIMIT_NPROC counts this user's other
    processes too, so the cap is set that many above them.
    """
    max_processes = settings.max_processes
    if identity is None:
        max_processes += len(processes_of_user(os.getuid()))
    limits = [
        (resource.RLIMIT_AS, memory_mb << 20),
        (resource.RLIMIT_CPU, cpu_seconds),
        (resource.RLIMIT_NPROC, max_processes),
        (resource.RLIMIT_FSIZE, settings.max_file_mb << 20),
        (resource.RLIMIT_NOFILE, 1024),
        (resource.RLIMIT_CORE, 0),
    ]

    def set_up() -> None:
        for procs in cgroup_procs:
            with open(procs, "w") as file:
                file.write("0")
        if identity is not None:
            os.setgroups([])
            os.setgid(identity[1])
            os.setuid(identity[0])
        for kind, value in limits:
            # one CPU second of grace between SIGXCPU (soft) and SIGKILL (hard)
            resource.setrlimit(kind, (value, value + 1 if kind == resource.RLIMIT_CPU else value))

    return set_up
