"""A real sandbox server per test module (bubblewrap isolation), on a free port, with its own user ids."""

from __future__ import annotations

import os
import shutil

import pytest

from reinforge.sandbox import SandboxClient, SandboxSettings
from reinforge.sandbox.server import SandboxServer

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (apt-get install -y bubblewrap; make test does it as root)")


def sandbox_settings(**overrides) -> SandboxSettings:
    """Port 0 and a user-id range of this test process's own, so parallel test workers never share slots."""
    values = {"port": 0, "max_concurrent": 2, "uid_base": 62000 + (os.getpid() % 2000) * 16, **overrides}
    return SandboxSettings(**values)


@pytest.fixture(scope="module")
def sandbox_server():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap; make test does it as root)")
    server = SandboxServer(sandbox_settings()).start()
    yield server
    server.close()


@pytest.fixture()
def client(sandbox_server) -> SandboxClient:
    return SandboxClient(sandbox_server.url, backoff_s=0.05)
