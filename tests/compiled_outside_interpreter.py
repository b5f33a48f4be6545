"""Run a script in a fresh Python without Triton's interpreter (so kernels compile for a real target) and read the
JSON list it prints last: the Hopper compile tests of the swapped kernels build their report this way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def compile_report(script: str) -> list[dict]:
    """What ``script`` printed on its last line, as JSON; fails the test with its stderr when it fails."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])
