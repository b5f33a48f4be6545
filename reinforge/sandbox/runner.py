"""Run one request's program to completion, or stop it: capture, caps and the wall-clock timeout.

The program runs in a PID namespace of its own, under a shell as its init (isolation.INIT); at the deadline, or once it writes more
than ``max_output_bytes`` to a stream, it is killed, which kills every process of the
namespace, and bwrap reaps it and exits (bwrap's whole process group is killed if it has not
within a grace period). As root the slot's user id is dedicated, so anything of that id still alive
afterwards is killed too before the slot is handed to the next request.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from reinforge.sandbox.cgroups import SlotCgroups
from reinforge.sandbox.isolation import (
    CODE_FOLDER,
    INIT,
    SANDBOX_ENV,
    WORK_FOLDER,
    IsolationError,
    bwrap_command,
    check_interpreter_visible,
    child_setup,
    default_python,
    find_bwrap,
    kill_user_processes,
    seccomp_filter,
    slot_identity,
)
from reinforge.sandbox.protocol import (
    ERROR,
    FINISHED,
    TIME_LIMIT_EXCEEDED,
    CommandRunResult,
    RunCodeRequest,
    RunCodeResponse,
)
from reinforge.sandbox.settings import SandboxSettings

KILL_GRACE_S = 2.0
SIGXCPU_EXIT = 128 + signal.SIGXCPU
SIGKILL_EXIT = 128 + signal.SIGKILL
PROGRAM_FILES = {"python": "main.py", "bash": "main.sh"}


@dataclass
class _Outcome:
    return_code: int | None = None
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    status_json: bytearray = field(default_factory=bytearray)
    timed_out: bool = False
    output_exceeded: bool = False
    seconds: float = 0.0
    cpu_seconds: float | None = None
    """CPU time of bwrap and the processes it reaped (the program, its init), from wait4; None if not known."""


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _child_pid(status_json: bytearray) -> int | None:
    """The host pid of the program, its namespace's init (bwrap's ``child-pid``), once bwrap has written it."""
    for line in status_json.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "child-pid" in record:
            return int(record["child-pid"])
    return None


def _stop(process: subprocess.Popen, outcome: _Outcome, status_fd: int | None) -> None:
    """Kill the program (its namespace's init), which ends the namespace and lets bwrap reap it; else the group.

    Killing bwrap first would orphan the program to the host's PID 1, a zombie until that reaps it.
    """
    if status_fd is not None and _child_pid(outcome.status_json) is None:
        # bwrap wrote child-pid before the program started; it may still sit unread in the pipe
        while select.select([status_fd], [], [], 0)[0]:
            chunk = os.read(status_fd, 1 << 16)
            if not chunk:
                break
            outcome.status_json += chunk
    child_pid = _child_pid(outcome.status_json)
    if child_pid is None or process.poll() is not None:
        _kill_group(process)
        return
    try:
        os.kill(child_pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _kill_group(process)


def _wait(process: subprocess.Popen, outcome: _Outcome, timeout_s: float) -> int:
    """``process.wait(timeout_s)``, through wait4 so that the CPU time of the program is known too.

    SIGXCPU (the CPU rlimit) and ``exit(152)`` both read 152 from the init shell; only the CPU time used tells
    a program stopped at its CPU limit from one that chose that exit code.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid == process.pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            outcome.cpu_seconds = usage.ru_utime + usage.ru_stime
            return process.returncode
        if time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(process.args, timeout_s)
        time.sleep(0.005)


def _supervise(argv: list[str], settings: SandboxSettings, *, timeout_s: float, stdin_fd: int, pass_fds: tuple[int, ...],
               status_fd: int | None, cwd: str | None, env: dict[str, str], preexec) -> _Outcome:
    outcome = _Outcome()
    start = time.monotonic()
    try:
        process = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   pass_fds=pass_fds, cwd=cwd, env=env, start_new_session=True, preexec_fn=preexec)
    finally:
        for fd in pass_fds:
            os.close(fd)  # the child holds its copies; the status pipe reaches EOF only once ours is closed
    streams = {process.stdout.fileno(): outcome.stdout, process.stderr.fileno(): outcome.stderr}
    if status_fd is not None:
        streams[status_fd] = outcome.status_json
    selector = selectors.DefaultSelector()
    for fd in streams:
        selector.register(fd, selectors.EVENT_READ)
    deadline, killed_at = start + timeout_s, None
    try:
        while selector.get_map():
            now = time.monotonic()
            if killed_at is None and now >= deadline:
                outcome.timed_out, killed_at = True, now
                _stop(process, outcome, status_fd)
            if killed_at is not None and now - killed_at > KILL_GRACE_S:
                break
            wait = deadline - now if killed_at is None else KILL_GRACE_S - (now - killed_at)
            for key, _ in selector.select(timeout=max(wait, 0.01)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = streams[key.fd]
                room = settings.max_output_bytes - len(buffer) if key.fd != status_fd else len(chunk)
                buffer += chunk[:room]
                if len(chunk) > room and killed_at is None:
                    outcome.output_exceeded, killed_at = True, time.monotonic()
                    _stop(process, outcome, status_fd)
        try:  # a program may close its output and run on: it still has until the deadline
            wait_s = KILL_GRACE_S if killed_at is not None else max(deadline - time.monotonic(), 0.0)
            outcome.return_code = _wait(process, outcome, wait_s)
        except subprocess.TimeoutExpired:
            outcome.timed_out = outcome.timed_out or killed_at is None
            _stop(process, outcome, status_fd)
            try:
                outcome.return_code = _wait(process, outcome, KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                outcome.return_code = process.wait()
    finally:
        selector.close()
        process.stdout.close()
        process.stderr.close()
        if process.poll() is None:
            _kill_group(process)
            process.wait()
    outcome.seconds = time.monotonic() - start
    return outcome


def _exit_code(outcome: _Outcome) -> int | None:
    """The program's exit code as a shell reports it (128 + signal); None if bwrap never started it."""
    if outcome.status_json:
        for line in outcome.status_json.decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "exit-code" in record:
                return int(record["exit-code"])
        return None
    code = outcome.return_code
    return 128 - code if code is not None and code < 0 else code


def _result(outcome: _Outcome, isolated: bool, settings: SandboxSettings, cpu_limit_s: int) -> CommandRunResult:
    stdout = outcome.stdout.decode("utf-8", errors="replace")
    stderr = outcome.stderr.decode("utf-8", errors="replace")
    seconds = round(outcome.seconds, 4)
    if outcome.timed_out:
        return CommandRunResult(TIME_LIMIT_EXCEEDED, seconds, None, stdout, stderr)
    if outcome.output_exceeded:
        stderr += (f"\n[reinforge sandbox: the program wrote more than {settings.max_output_bytes} bytes to one "
                   "stream and was stopped]")
        return CommandRunResult(FINISHED, seconds, SIGKILL_EXIT, stdout, stderr)
    exit_code = _exit_code(outcome) if isolated else _exit_code(_Outcome(return_code=outcome.return_code))
    if exit_code is None:
        return CommandRunResult(ERROR, seconds, None, stdout, f"the sandbox failed to start the program: {stderr}")
    if exit_code == SIGXCPU_EXIT and (outcome.cpu_seconds is None or outcome.cpu_seconds >= cpu_limit_s):
        return CommandRunResult(TIME_LIMIT_EXCEEDED, seconds, None, stdout, stderr + "\n[CPU time limit exceeded]")
    return CommandRunResult(FINISHED, seconds, exit_code, stdout, stderr)


def _memfd(name: str, content: bytes) -> int:
    """An in-memory file holding ``content``, read from its start."""
    fd = os.memfd_create(name)
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_request(request: RunCodeRequest, settings: SandboxSettings, slot: int,
                cgroups: SlotCgroups | None = None) -> RunCodeResponse:
    """Run ``request`` in slot ``slot`` under the server's limits (and its cgroups); always returns a response."""
    timeout_s = min(max(request.run_timeout, 0.0), settings.max_run_timeout_s)
    memory_mb = request.memory_limit_MB if request.memory_limit_MB > 0 else settings.default_memory_mb
    memory_mb = min(memory_mb, settings.max_memory_mb)
    interpreter = (settings.python or default_python()) if request.language == "python" else "/bin/bash"
    program_file = PROGRAM_FILES[request.language]
    identity = slot_identity(slot, settings)
    files = request.decoded_files()
    opened: list[int] = []  # closed here; the fds passed to the child are closed by _supervise once it runs
    try:
        cgroup_procs = cgroups.prepare(slot, memory_mb, settings.max_processes) if cgroups is not None else []
        cpu_limit_s = int(timeout_s) + 1
        preexec = child_setup(memory_mb, cpu_limit_s, settings, identity, cgroup_procs)
        stdin_fd = _memfd("stdin", (request.stdin or "").encode())
        opened.append(stdin_fd)
        if settings.isolation == "bubblewrap":
            file_fds = [(_memfd("code", request.code.encode()), f"{CODE_FOLDER}/{program_file}")]
            file_fds += [(_memfd("file", content), f"{WORK_FOLDER}/{path}") for path, content in files.items()]
            seccomp = seccomp_filter()
            seccomp_fds = [_memfd("seccomp", seccomp)] if seccomp is not None else []
            status_read, status_write = os.pipe()
            opened.append(status_read)
            argv = bwrap_command(find_bwrap(), settings, [*INIT, interpreter, f"{CODE_FOLDER}/{program_file}"],
                                 file_fds, status_write, seccomp_fds[0] if seccomp_fds else None)
            outcome = _supervise(argv, settings, timeout_s=timeout_s, stdin_fd=stdin_fd,
                                 pass_fds=(status_write, *seccomp_fds, *(fd for fd, _ in file_fds)),
                                 status_fd=status_read,
                                 cwd=None, env=SANDBOX_ENV, preexec=preexec)
        else:
            # no isolation, but as root still the slot's own user id, so a kill(-1) reaches only that id;
            # the program sits in a folder of its own, as /code is under bubblewrap: a file named main.py in
            # `files` must not replace it
            with tempfile.TemporaryDirectory(prefix="reinforge-unsafe-") as folder, \
                    tempfile.TemporaryDirectory(prefix="reinforge-unsafe-code-") as code_folder:
                (Path(code_folder) / program_file).write_bytes(request.code.encode())
                for path, content in files.items():
                    (Path(folder) / path).parent.mkdir(parents=True, exist_ok=True)
                    (Path(folder) / path).write_bytes(content)
                if identity is not None:
                    for entry in [Path(code_folder), Path(folder), *Path(code_folder).iterdir(),
                                  *Path(folder).rglob("*")]:
                        os.chown(entry, *identity)
                env = {**SANDBOX_ENV, "HOME": folder, "TMPDIR": folder, "PYTHONPATH": folder}
                outcome = _supervise([interpreter, str(Path(code_folder) / program_file)], settings,
                                     timeout_s=timeout_s, stdin_fd=stdin_fd, pass_fds=(), status_fd=None, cwd=folder,
                                     env=env, preexec=preexec)
    except OSError as error:
        return RunCodeResponse.from_run(CommandRunResult(ERROR, stderr=f"the sandbox could not run the program: {error}"))
    finally:
        for fd in opened:
            os.close(fd)
        if identity is not None:
            kill_user_processes(identity[0])
        if cgroups is not None:
            cgroups.kill(slot)
    result = _result(outcome, settings.isolation == "bubblewrap", settings, cpu_limit_s)
    if cgroups is not None and cgroups.memory_exceeded(slot):
        result.stderr = (result.stderr or "") + (f"\n[reinforge sandbox: the program's processes and files held more "
                                                 f"than its memory limit of {memory_mb} MB; one was killed]")
    return RunCodeResponse.from_run(result)


def check_isolation(settings: SandboxSettings, cgroups: SlotCgroups | None = None) -> None:
    """Run ``print(6 * 7)`` the way requests will run; IsolationError with the reason if that fails."""
    if settings.isolation == "bubblewrap":
        find_bwrap()
        check_interpreter_visible(settings.python or default_python(), settings)
    probe = run_request(RunCodeRequest(code="print(6 * 7)", run_timeout=20), settings, slot=0, cgroups=cgroups)
    run = probe.run_result
    if run is None or run.stdout is None or run.stdout.strip() != "42":
        detail = " ".join(((run.stderr if run else "") or probe.message or probe.status).split())[:500]
        hint = ("; if bwrap reports a permission error, this kernel may forbid unprivileged user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1)") if settings.isolation == "bubblewrap" else ""
        raise IsolationError(f"a test program did not run in the {settings.isolation} sandbox: {detail}{hint}")
