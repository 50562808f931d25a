"""What the optional training backends need from the process before anything starts: DeepSpeed (parallelism=zero3*)
in a plain `python train.py` gets the rendezvous that torchrun gives one process."""

from __future__ import annotations

import os
import socket

from omegaconf import DictConfig

RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def single_process_rendezvous(cfg: DictConfig) -> dict[str, str]:
    """For ZeRO-3 outside torchrun, set the variables `torchrun --nproc_per_node=1` sets (rank 0 of 1; a free local
    port unless MASTER_ADDR / MASTER_PORT are set); returns what was set. Without them DeepSpeed's init_distributed
    falls back to MPI discovery and fails on `import mpi4py`. Other backends, and processes a launcher started, are
    left as they are."""
    if not str(cfg.parallelism.name).startswith("zero3") or "RANK" in os.environ:
        return {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    defaults = dict(zip(RENDEZVOUS, ("0", "0", "1", "1", "127.0.0.1", str(port)), strict=True))
    values = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(values)
    return values
