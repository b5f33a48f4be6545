"""Code execution for tool-using agents: a SandboxFusion-compatible server, its isolation, and a client.

``reinforge sandbox serve`` runs the server (``server.py``); each program runs under
bubblewrap with rlimits and a wall-clock timeout (``isolation.py``, ``runner.py``) behind a
token-bucket rate limit and a bounded queue (``admission.py``). ``SandboxClient`` talks to it
or to a real SandboxFusion deployment. This layer imports nothing else from reinforge.
"""

from reinforge.sandbox.client import SandboxClient
from reinforge.sandbox.protocol import CommandRunResult, RunCodeRequest, RunCodeResponse
from reinforge.sandbox.settings import SandboxSettings

__all__ = ["CommandRunResult", "RunCodeRequest", "RunCodeResponse", "SandboxClient", "SandboxSettings"]
