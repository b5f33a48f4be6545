"""Real sandbox servers (bubblewrap isolation) on free ports, each test process with user ids of its own."""

from __future__ import annotations

import os
import shutil

import pytest

from reinforge.sandbox import SandboxClient, SandboxSettings
from reinforge.sandbox.server import SandboxServer

NO_BWRAP = "bubblewrap is not installed (apt-get install -y bubblewrap; make test installs it when run as root)"


def sandbox_settings(**overrides) -> SandboxSettings:
    """Port 0 and a user-id range of this test process's own, so parallel test workers never share slots."""
    values = {"port": 0, "max_concurrent": 2, "uid_base": 62000 + (os.getpid() % 2000) * 16, **overrides}
    return SandboxSettings(**values)


@pytest.fixture(scope="module")
def sandbox_server():
    if shutil.which("bwrap") is None:
        pytest.skip(NO_BWRAP)
    server = SandboxServer(sandbox_settings()).start()
    yield server
    server.close()


@pytest.fixture()
def client(sandbox_server) -> SandboxClient:
    return SandboxClient(sandbox_server.url, backoff_s=0.05)


@pytest.fixture()
def start_server():
    """``start_server(**settings)`` -> a running SandboxServer (bubblewrap unless isolation='none'), closed after."""
    servers = []

    def start(**overrides) -> SandboxServer:
        if overrides.get("isolation", "bubblewrap") == "bubblewrap" and shutil.which("bwrap") is None:
            pytest.skip(NO_BWRAP)
        servers.append(SandboxServer(sandbox_settings(**overrides)).start())
        return servers[-1]

    yield start
    for server in servers:
        server.close()
