"""tests/forked_python.py leaves no folder of its own behind, whichever way a process's output is read."""

from __future__ import annotations

import gc
import subprocess
import sys
import tempfile
from multiprocessing import forkserver
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import forked_python  # noqa: E402


@pytest.fixture
def plain_server(monkeypatch, tmp_path):
    """A fork server without the preloaded modules (what is checked here needs none of them), and a temporary folder
    of the test's own, where the processes' folders are counted."""
    server = forkserver.ForkServer()
    monkeypatch.setattr(forked_python, "_server", server)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path
    server._stop()


def test_no_output_folder_is_left_behind(plain_server):
    completed = forked_python.run(["-c", "import sys; print('out'); print('err', file=sys.stderr)"])
    assert (completed.returncode, completed.stdout, completed.stderr) == (0, "out\n", "err\n")

    quiet = forked_python.ForkedPython(["-c", "pass"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert quiet.wait(60) == 0
    assert not list(plain_server.glob("forked-python-*"))  # nothing kept, no folder made

    killed = forked_python.ForkedPython(["-c", "import time; print('started', flush=True); time.sleep(60)"],
                                        stdout=None, stderr=subprocess.DEVNULL)
    killed.kill()
    assert killed.wait(60) == -9
    killed.output()
    [folder] = plain_server.glob("forked-python-*")
    del killed  # read by wait and output, never by communicate: the folder goes with the object
    gc.collect()
    assert not folder.exists()
