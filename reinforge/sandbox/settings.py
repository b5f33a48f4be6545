"""The sandbox server's settings: one dataclass, the only home of each default."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from reinforge.sandbox.protocol import MIN_MEMORY_MB

ISOLATIONS = ("bubblewrap", "none")
MAX_UID_BASE = 1 << 30
"""Far below the 2**32 - 1 that means no id, with room for any range of slots (and shifts past held ones)."""


@dataclass
class SandboxSettings:
    host: str = "127.0.0.1"
    """Address to listen on; keep 127.0.0.1 unless trainers on other hosts call this server."""
    port: int = 8080
    max_concurrent: int = 0
    """Programs running at once; 0 means the number of CPUs."""
    max_queued: int = 64
    """Requests waiting for a free slot; one more is answered 503 at once (back-pressure)."""
    queue_timeout_s: float = 30.0
    """A queued request that waits longer is answered 503."""
    rate_per_s: float = 50.0
    """Token-bucket refill: requests admitted per second on average (0 turns the rate limit off)."""
    burst: int = 100
    """Token-bucket size: requests admitted at once after a quiet spell; past it, 429."""
    max_request_bytes: int = 16 << 20
    isolation: str = "bubblewrap"
    """bubblewrap, or none (only with the server's --unsafe-no-isolation flag)."""
    python: str = ""
    """Interpreter for language=python inside the sandbox; empty: /usr/bin/python3, else python3 on PATH."""
    read_only_paths: list[str] = field(default_factory=list)
    """Host folders visible (read-only) inside the sandbox besides /usr and the loader's folders."""
    max_run_timeout_s: float = 60.0
    """A request's run_timeout is capped at this."""
    default_memory_mb: int = 1024
    """Address-space limit when a request sends memory_limit_MB <= 0."""
    max_memory_mb: int = 8192
    max_processes: int = 64
    """Processes and threads of one program (RLIMIT_NPROC of its own user id when the server runs as root)."""
    max_file_mb: int = 64
    """Largest file a program may write (RLIMIT_FSIZE)."""
    tmp_size_mb: int = 256
    """Size of each program's private /tmp (a tmpfs; its working folder)."""
    max_output_bytes: int = 1 << 20
    """Bytes kept of stdout and of stderr each; a program that writes more is stopped."""
    uid_base: int = 61000
    """As root, slot i runs as user and group uid_base + i, so programs share no files or process limits."""

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation={self.isolation!r} is not one of {', '.join(ISOLATIONS)}")
        for name in ("max_queued", "burst", "max_processes", "max_file_mb", "tmp_size_mb", "max_output_bytes",
                     "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("default_memory_mb", "max_memory_mb"):  # below it every program fails at start-up
            if getattr(self, name) < MIN_MEMORY_MB:
                raise ValueError(f"{name}={getattr(self, name)} is too little for a program to start (python3 needs "
                                 f"about 14 MB); set it to at least {MIN_MEMORY_MB}")
        for name in ("max_run_timeout_s", "queue_timeout_s"):  # 0 or less: every program, or every queued request, fails
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be above 0 seconds")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is not a TCP port; use 0..65535 (0: any free port)")
        if not 1 <= self.uid_base <= MAX_UID_BASE:  # 0 is root: the clean-up of slot 0 would kill every root process
            raise ValueError(f"uid_base={self.uid_base} is not a user id for sandboxed programs; use an unused range "
                             f"in 1..{MAX_UID_BASE} such as the default {SandboxSettings.uid_base}")
        if self.max_concurrent < 0 or self.rate_per_s < 0:
            raise ValueError("max_concurrent and rate_per_s must be >= 0 (0: number of CPUs / no rate limit)")

    @property
    def num_slots(self) -> int:
        return self.max_concurrent or os.cpu_count() or 1
