"""Background NVML sampler: utilisation, memory, power and SM clock of the GPUs this process uses, every
`interval_s` (W&B's system monitor: every 15 s). GPUs are matched to CUDA devices by UUID, whatever the numbering."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)
# Comma-separated NVML UUIDs of a vLLM server's GPUs (server placement), set by its launcher: rank 0 samples them.
SERVER_GPUS_ENV = "COLOCATED_GRPO_SERVER_GPUS"
GIVE_UP_AFTER = 10  # failed reads in a row that stop the sampler; fewer (a transient NVML error) skip their samples


@dataclass(frozen=True)
class Sample:
    t: float  # time.perf_counter() of this process
    gpu: str  # label of the GPU in metric names (gpu/{label}/util)
    util: float  # % of the last sample period in which a kernel ran (NVML's utilization.gpu)
    mem_gb: float
    power_w: float
    sm_clock_mhz: float


def unavailable() -> str | None:
    """Why NVML cannot sample this machine's GPUs, in words a user can act on; None when it can."""
    try:
        import pynvml
    except ImportError:
        return "pynvml is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        return _explain(pynvml, exc)
    except Exception as exc:  # a broken install: say what it raised rather than guess
        return f"NVML failed: {type(exc).__name__}: {exc}"
    return None if count > 0 else "NVML sees no GPU (0 devices)"


def cuda_devices() -> int:
    """CUDA devices on this machine: 0 where NVML sees no NVIDIA GPU (without torch's import, ~2 s of CPU)."""
    if unavailable():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _explain(pynvml, exc) -> str:
    known = {
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so not found (no NVIDIA driver, or not on the library path)",
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA driver is not loaded",
        pynvml.NVML_ERROR_NO_PERMISSION: "no permission to open the GPUs",
    }
    why = known.get(getattr(exc, "value", None))
    return f"{why} (NVMLError: {exc})" if why else f"NVML failed: {exc}"


def cuda_device_uuid(device_index: int) -> str:
    """NVML-style UUID ("GPU-…") of a CUDA device as this process numbers it."""
    import torch

    return "GPU-" + str(torch.cuda.get_device_properties(device_index).uuid)


class GpuSampler:
    """Samples the GPUs given as {label: NVML UUID} in a daemon thread; `take(t0, t1)` hands out samples."""

    def __init__(self, gpus: dict[str, str], interval_s: float = 0.2):
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self.handles = {label: pynvml.nvmlDeviceGetHandleByUUID(uuid) for label, uuid in gpus.items()}
        self.interval_s = interval_s
        self._samples: deque[Sample] = deque(maxlen=100_000)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
        self.read_s = 0.0  # total time spent reading NVML: the sampler's own cost
        self.reads = 0

    def start(self) -> GpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 1)

    def read(self) -> list[Sample]:
        nv = self._nvml
        t0 = time.perf_counter()
        out = []
        for label, h in self.handles.items():
            try:
                power = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
            except nv.NVMLError:
                power = float("nan")
            util = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            mem_gb = nv.nvmlDeviceGetMemoryInfo(h).used / 1e9
            clock = float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
            out.append(Sample(t0, label, util, mem_gb, power, clock))
        self.read_s += time.perf_counter() - t0
        self.reads += 1
        return out

    def _loop(self) -> None:
        next_t, failed = time.perf_counter(), 0
        while not self._stop.is_set():
            try:
                samples, failed = self.read(), 0
            except Exception as exc:  # a failed read skips its sample; a GPU that stops answering stops the sampler
                failed, samples = failed + 1, []
                if failed in (1, GIVE_UP_AFTER):
                    log.warning("GPU sampling: %s (%s)", exc, "stopped" if failed == GIVE_UP_AFTER else "skipped")
                if failed == GIVE_UP_AFTER:
                    return
            with self._lock:
                self._samples.extend(samples)
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.perf_counter()))

    def take(self, t0: float, t1: float) -> list[Sample]:
        """Samples with t0 <= t <= t1; older ones are dropped."""
        with self._lock:
            while self._samples and self._samples[0].t < t0:
                self._samples.popleft()
            return [s for s in self._samples if s.t <= t1]
