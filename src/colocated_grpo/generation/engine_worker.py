"""What runs inside vLLM's own engine process for placement=colocate_process (engine_process.py is the trainer's side):
our CPU patches, applied by our vLLM plugin (launch/engine_plugin.py), and the worker methods the trainer calls through
`collective_rpc` (vLLM's `worker_extension_cls`). Light to import: no TRL, no vLLM at module level."""

from __future__ import annotations

import os
import signal

# Set by the trainer while it builds its engine (the engine's processes inherit it): "eager" or "compiled", the
# engine's compilation on CPU (placement.cpu_eager). Unset, the plugin does nothing: other vLLM users are untouched.
ENGINE_PROCESS = "COLOCATED_GRPO_ENGINE_PROCESS"
# The trainer's pid, set beside it: vLLM also runs its plugins in the trainer's own process (EngineArgs.__post_init__)
# while that environment is set, and the plugin must leave the trainer alone.
TRAINER_PID = "COLOCATED_GRPO_TRAINER_PID"
# Set beside it: a file into which the engine's processes write the error that stopped their start-up (the trainer sees
# only vLLM's "Engine core initialization failed. See root cause above")
START_ERROR_FILE = "COLOCATED_GRPO_ENGINE_START_ERROR"
WORKER_EXTENSION = f"{__name__}.PolicyWorker"
# The device index among torch's rebuild_cuda_tensor arguments (torch.multiprocessing.reductions.reduce_tensor)
STORAGE_DEVICE = 6


def in_engine_process() -> bool:
    """Whether this process is one of the engine's (started while the trainer built its engine), not the trainer."""
    trainer = os.environ.get(TRAINER_PID)
    return os.environ.get(ENGINE_PROCESS) is not None and trainer is not None and int(trainer) != os.getpid()


def apply_patches(at_engine_core_loop) -> None:
    """Run by our vLLM plugin (launch/engine_plugin.py) in each of the engine's processes before a model loads: bound
    to end with the trainer, their start-up errors written where the trainer reads them, `at_engine_core_loop()` called
    where an engine core starts its loop, tqdm's lock a thread's (no semaphore to leak), and the patches that the
    trainer's own process has too (compat/vllm.py): the broadcast buffer unlinked once mapped and, on CPU, the CPU
    engine's."""
    mode = os.environ[ENGINE_PROCESS]
    _end_with_parent()
    from colocated_grpo.compat import vllm as vllm_internals

    _write_logged_errors(os.environ.get(START_ERROR_FILE), vllm_internals.exception_chain)
    vllm_internals.call_where_engine_core_loop_starts(at_engine_core_loop)

    # the engine's processes end by a signal, which skips vLLM's own unlink of its broadcast buffer
    vllm_internals.unlink_broadcast_memory_once_mapped()
    # and the release of a semaphore: tqdm's lock between processes (vLLM's weight-loading progress bar made one), which
    # Python's resource tracker then reported leaked at the end of every run; one process needs a thread's lock
    import threading

    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())
    import torch

    if torch.cuda.is_available():
        return
    vllm_internals.prepare_cpu()
    if mode == "eager":
        vllm_internals.run_eagerly()


def _end_with_parent() -> None:
    """SIGKILL when the parent process ends, however it ends (the trainer ends with os._exit, or is killed): the
    engine's processes end with their trainer at once, and nothing is left behind (as launch/processes.py binds the
    processes it starts). Not SIGTERM: they ignore it (resilience/signals.py's leave_stops_to_the_trainer), and vLLM's
    own shutdown on it took 2-7 s."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent ended before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def _write_logged_errors(path: str | None, exception_chain) -> None:
    """Each error vLLM logs with its exception in this process (its engine core's "EngineCore failed to start.", its
    worker's) appended to `path` as `Type: message` lines, the innermost cause first: the trainer names it in one line
    when the engine does not start (generation/engine_process.py)."""
    import logging

    if not path:
        return

    class WrittenToFile(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            error = record.exc_info[1] if record.exc_info else None
            if error is None:
                return
            chain = [f"{type(e).__name__}: {e}".replace("\n", " ") for e in exception_chain(error)]
            try:  # not created again once the trainer removed it (the engine started)
                descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
            except FileNotFoundError:
                return
            with os.fdopen(descriptor, "a") as file:
                file.write("".join(f"{line}\n" for line in reversed(chain)))

    logging.getLogger("vllm").addHandler(WrittenToFile(logging.ERROR))


class PolicyWorker:
    """Methods vLLM adds to its worker (`worker_extension_cls`): the policy's weights in and out, and the generator
    its sampler draws from."""

    def load_policy_weights(self, blob: bytes) -> None:
        """Load the trainer's weights, named as in its checkpoint and sent as one safetensors blob (on CPU)."""
        from safetensors.torch import load

        self.model_runner.model.load_weights(list(load(blob).items()))

    def load_policy_weights_from_handles(self, handles: bytes) -> None:
        """Load the trainer's weights from CUDA IPC handles of its own tensors (on GPUs): pickled (name, (rebuild,
        arguments)) pairs of torch's `reduce_tensor`. The engine's process sees only the rank's GPU, so each tensor is
        rebuilt on this process's device instead of the trainer's device index."""
        import pickle

        import torch

        device = torch.cuda.current_device()
        weights = []
        for name, (rebuild, arguments) in pickle.loads(handles):
            arguments = list(arguments)
            arguments[STORAGE_DEVICE] = device
            weights.append((name, rebuild(*arguments)))
        self.model_runner.model.load_weights(weights)
        torch.cuda.synchronize()  # copied before the trainer's tensors may change

    def policy_weight_digest(self) -> dict[str, list]:
        """Per engine parameter: the sum and the sum of squares of its values, in float64, and its dtype (tests
        compare them with the trainer's weights cast to it)."""
        digest = {}
        for name, p in self.model_runner.model.named_parameters():
            values = p.double()
            digest[name] = [values.sum().item(), values.square().sum().item(), str(p.dtype).removeprefix("torch.")]
        return digest

    def get_sampling_rng_state(self) -> bytes:
        return sampling_rng_state()

    def set_sampling_rng_state(self, state: bytes) -> None:
        set_sampling_rng_state(state)


def sampling_rng_state() -> bytes:
    """The state of the generator vLLM's sampler draws from: this process's default one on its device (the trainer's
    own, for an engine in the trainer's process)."""
    import torch

    state = torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()
    return state.numpy().tobytes()


def set_sampling_rng_state(state: bytes) -> None:
    import torch

    tensor = torch.frombuffer(bytearray(state), dtype=torch.uint8)
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor)
    else:
        torch.set_rng_state(tensor)
