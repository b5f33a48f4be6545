"""The device's busy fraction while a benchmark runs: ``nvidia-smi``'s utilization.gpu sampled every 50 ms.

utilization.gpu is the share of a sample period in which some kernel ran; averaged over a window it says
how much of that window the device computed, whatever the host thought it was doing. None without a
CUDA device or ``nvidia-smi``.
"""

from __future__ import annotations

import subprocess
import threading
import time

import torch


class GpuBusy:
    """utilization.gpu from ``nvidia-smi -lms 50`` in the background, averaged over time windows."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.process = None
        if torch.cuda.is_available():
            try:
                self.process = subprocess.Popen(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "50",
                     "-i", str(torch.cuda.current_device())], stdout=subprocess.PIPE, text=True)
            except FileNotFoundError:
                self.process = None
        if self.process is not None:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.strip()) / 100))
            except ValueError:
                continue

    def mean(self, start: float, end: float) -> float | None:
        values = [value for stamp, value in self.samples if start <= stamp <= end]
        return sum(values) / len(values) if values else None

    def close(self) -> None:
        if self.process is not None:
            self.process.terminate()
