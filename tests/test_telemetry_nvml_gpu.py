"""NVML sampler on a real GPU (run on a GPU machine: `pytest -m gpu`)."""

import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run with `pytest -m gpu`)"),
]


def test_sampler_sees_a_busy_gpu():
    from colocated_grpo.telemetry.nvml import GpuSampler, cuda_device_uuid

    sampler = GpuSampler({"0": cuda_device_uuid(0)}, interval_s=0.05).start()
    time.sleep(0.5)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    sampler.stop()
    busy = sampler.take(t0 + 0.3, t1)
    assert len(busy) >= 20
    assert sum(s.util for s in busy) / len(busy) > 80
    assert all(s.mem_gb > 0.1 and s.sm_clock_mhz > 0 and s.power_w > 0 for s in busy)
    assert sampler.reads > 40 and sampler.read_s / sampler.reads < 0.01  # a read costs well under 10 ms


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_visible_devices_is_matched_by_uuid():
    import pynvml

    pynvml.nvmlInit()
    want = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(1))
    code = "from colocated_grpo.telemetry.nvml import cuda_device_uuid; print(cuda_device_uuid(0))"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}
    got = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert got == (want.decode() if isinstance(want, bytes) else want)
