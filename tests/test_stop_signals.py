"""SIGINT and SIGTERM under ``install_stop_handlers``, in a fresh interpreter each: what the process prints and its
exit status."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LATE_SIGNAL = {
    # the signal comes from an atexit hook, while the interpreter runs them
    "atexit": "atexit.register(lambda: os.kill(os.getpid(), SIGNUM))",
    # from a thread the interpreter is joining once the main thread has finished
    "thread join": "threading.Thread(target=lambda: (time.sleep(0.2), os.kill(os.getpid(), SIGNUM), time.sleep(5)))"
                   ".start()",
}


@pytest.mark.parametrize("when", LATE_SIGNAL)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda signum: signum.name)
def test_a_signal_while_the_interpreter_shuts_down_exits_at_once_with_130_and_no_traceback(when, signum):
    script = textwrap.dedent(f"""
        import atexit, os, threading, time
        from reinforge.stop_signals import install_stop_handlers
        install_stop_handlers()
        SIGNUM = {int(signum)}
        {LATE_SIGNAL[when]}
        print("finished")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 130, done.stderr
    assert done.stdout == "finished\n"  # printed before the signal: flushed, not lost with the exit
    assert done.stderr == f"\n{signum.name} while exiting: exiting at once\n"


def test_a_second_run_in_one_process_is_told_of_its_own_stop_only():
    """Two runs stopped in one interpreter (a notebook, a script calling the CLI twice): the second's line names its
    own signal, not the first's, and nothing the first dropped."""
    script = textwrap.dedent("""
        import os, signal
        from reinforge import stop_signals
        for signum, dropped in ((signal.SIGTERM, "the generation under way"), (signal.SIGINT, None)):
            stop_signals.install_stop_handlers()
            try:
                os.kill(os.getpid(), signum)
            except KeyboardInterrupt:
                if dropped:
                    stop_signals.note_abandoned(dropped)
                print(stop_signals.stopped_message())
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30)
    first, second = done.stdout.splitlines()
    assert first.startswith("stopped by SIGTERM") and "the generation under way" in first
    assert second.startswith("stopped by SIGINT") and "the generation under way" not in second
