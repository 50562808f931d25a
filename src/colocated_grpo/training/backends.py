"""The rendezvous of a plain `python train.py` (one process, no launcher): what torchrun would give it.

The colocated engine (and DeepSpeed) form a process group through `env://`, on MASTER_PORT. Left to TRL, a free
port is looked for among fixed ones (29500 first) and bound seconds later, when the engine starts: two runs started
together pick the same one and the second dies after loading its model (EADDRINUSE). Instead this process hosts
the rendezvous store itself, as torchrun's agent does, on a port the kernel picks and this process holds until it
ends; `env://` then connects to it (TORCHELASTIC_USE_AGENT_STORE). A MASTER_PORT given by the user is left alone.
"""

from __future__ import annotations

import os
from datetime import timedelta

from omegaconf import DictConfig

RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

_held = []  # the store this process hosts, alive as long as the process


def single_process_rendezvous(cfg: DictConfig) -> dict[str, str]:
    """Set what a one-process run needs and returns what was set; processes a launcher started are left as they are.
    Every such run gets MASTER_ADDR / MASTER_PORT of a store held here (unless MASTER_PORT is set); ZeRO-3 also gets
    the variables `torchrun --nproc_per_node=1` sets (rank 0 of 1): without them DeepSpeed's init_distributed falls
    back to MPI discovery and fails on `import mpi4py`."""
    if "RANK" in os.environ:
        return {}
    values = {}
    if "MASTER_PORT" not in os.environ:
        values.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_host_store("127.0.0.1")), **{AGENT_STORE: "True"})
    if str(cfg.parallelism.name).startswith("zero3"):
        values.update({k: v for k, v in zip(RENDEZVOUS[:4], ("0", "0", "1", "1"), strict=True) if k not in os.environ})
    os.environ.update(values)
    return values


def _host_store(host: str) -> int:
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, world_size=1, is_master=True, timeout=timedelta(minutes=30), wait_for_workers=False)
    _held.append(store)
    return store.port
