"""Python processes forked from a server that has imported torch, transformers and reinforge once.

A test that runs ``reinforge train`` or a gloo rank's script as a process of its own pays the
interpreter's imports every time: about 10 s of CPU on a 2-core CI machine, which made the tests
that start several processes the slowest of the suite. ``ForkedPython`` starts such a process as a
fork of a multiprocessing fork server of this module's own, which preloaded those modules (not the
global one that the reward scoring pool also starts), and is waited for like
``subprocess.Popen``: ``returncode`` (negative for a signal: -9 after SIGKILL), ``communicate``,
``kill``. The process gets its own argv, environment (replaced, as ``Popen(env=...)`` does), working
directory and output, and runs ``-c CODE``, ``-m MODULE`` or a script path as ``python`` would.

What differs from a fresh interpreter: the preloaded modules are imported already, with the
environment of the server's start (this test process's, after conftest.py set its variables), and
the hash seed is the server's, the same for every fork made by one pytest process. Tests of what a
fresh process does at startup, or of a process group's signals, keep using ``subprocess``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing import forkserver, popen_forkserver
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "transformers", "reinforge.cli", "reinforge.trainer.rl_trainer",
           "reinforge.workers.actor_rollout", "reinforge.engine.fsdp", "reinforge.rollout.hf",
           "reinforge.rollout.native.engine", "reinforge.stop_signals", "reinforge.cli_errors",
           "reinforge.models.random_weights", "pandas", "pyarrow.parquet", "triton", "cloudpickle", "psutil",
           "forked_python_warmup"]
"""What a ``reinforge train`` run imports (a run's first second on a 2-core machine when a fork imports it again),
then ``forked_python_warmup``: the first config a process loads costs it several times what the next ones do."""

_server = None
_launch_lock = threading.Lock()


def _forkserver():
    """This module's own fork server (started on first use), preloaded with PRELOAD.

    Not multiprocessing's global one: a test that ran earlier in this process may have started that
    one without these modules (the reward scoring pool starts it), and each fork of it would then pay
    the imports again (about 10 s of CPU a process on a 2-core machine).
    """
    global _server
    if _server is None:
        tests = str(Path(__file__).parent)
        if tests not in sys.path:  # the server unpickles _child from this module by name
            sys.path.insert(0, tests)
        server = forkserver.ForkServer()
        server.set_forkserver_preload(PRELOAD)
        # the server imports PRELOAD before it takes this process's sys.path: it finds forked_python_warmup, which
        # is in tests/, through PYTHONPATH
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(path for path in (tests, saved) if path)
        try:
            server.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        _server = server
    return _server


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj):
        # popen_forkserver asks the module-level connect_to_new_process (the global server's) for the fork
        server = _forkserver()
        with _launch_lock:
            global_connect = forkserver.connect_to_new_process
            forkserver.connect_to_new_process = server.connect_to_new_process
            try:
                super()._launch(process_obj)
            finally:
                forkserver.connect_to_new_process = global_connect


class _Process(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


def _child(argv: list[str], env: dict[str, str], cwd: str | None, stdout: str, stderr: str) -> None:
    """Runs in the forked process: python's command line ``argv`` (without the interpreter)."""
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


def _remove(folder: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a fork of the test process that exits
        shutil.rmtree(folder, ignore_errors=True)


class ForkedPython:
    """``subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd)`` on a forked, preloaded interpreter.

    stdout / stderr: None keeps the output for ``communicate`` and ``output``; ``subprocess.DEVNULL``
    drops it; ``subprocess.STDOUT`` (for stderr) sends it to stdout's file.
    """

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 stdout: int | None = None, stderr: int | None = None):
        devnull = os.devnull
        kept = stdout != subprocess.DEVNULL or stderr not in (subprocess.DEVNULL, subprocess.STDOUT)
        # the output files' folder, only when some output is kept: removed by communicate, or else when this object
        # is collected or the test process exits
        self._folder = tempfile.mkdtemp(prefix="forked-python-") if kept else None
        self._remove_folder = weakref.finalize(self, _remove, self._folder, os.getpid()) if kept else None
        self._stdout = devnull if stdout == subprocess.DEVNULL else os.path.join(self._folder, "stdout")
        if stderr == subprocess.STDOUT:
            self._stderr = self._stdout
        else:
            self._stderr = devnull if stderr == subprocess.DEVNULL else os.path.join(self._folder, "stderr")
        for path in {self._stdout, self._stderr} - {devnull}:
            Path(path).touch()
        self._process = _Process(
            # env=None is this process's environment now, as for Popen (the server's is that of its start)
            target=_child, args=(list(map(str, argv)), dict(os.environ if env is None else env),
                                 None if cwd is None else str(cwd), self._stdout, self._stderr), daemon=False)
        self._process.start()
        self.pid = self._process.pid
        self.args = argv

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def _read(self, path: str) -> str:
        return "" if path == os.devnull else Path(path).read_text(errors="replace")

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) written so far."""
        return self._read(self._stdout), ("" if self._stderr == self._stdout else self._read(self._stderr))

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        try:
            return self.output()
        finally:
            if self._remove_folder is not None:
                self._remove_folder()

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(argv: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`` on a forked interpreter."""
    process = ForkedPython(argv, env=env, cwd=cwd)
    started = time.monotonic()
    try:
        stdout, stderr = process.communicate(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(30)
        raise subprocess.TimeoutExpired(argv, time.monotonic() - started) from None
    completed = subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
    if check:
        completed.check_returncode()
    return completed
