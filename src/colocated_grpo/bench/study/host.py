"""The host a study runs on: its CPU and how loaded it is. A step's host work (vLLM's scheduler and output
processing, Python between the kernels) slows down on a busy host, plain TRL's more than ours, so the load during
each run is recorded beside its step times."""

from __future__ import annotations

import os
import platform
import threading
from pathlib import Path

SAMPLE_EVERY_S = 5.0  # how often the load is read while a step runs


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo, else what the platform says); None when nothing says it."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def load_average() -> list[float] | None:
    """The host's load average over 1, 5 and 15 minutes (runnable processes, the study's own included); None where
    the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class LoadDuringStep:
    """The load average over one step: at its start and end, and the highest 1-minute average read every
    `every_s` seconds in between. `record` is what env.json keeps of it."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S):
        self.every_s = every_s
        self.start = self.end = None
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="host-load", daemon=True)

    def __enter__(self) -> LoadDuringStep:
        self.start = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = self._read()

    def _read(self) -> list[float] | None:
        found = load_average()
        if found is not None:
            self.peak = max(found[0], self.peak if self.peak is not None else found[0])
        return found

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self._read()

    @property
    def record(self) -> dict:
        return {"start": self.start, "peak_1min": self.peak, "end": self.end}
