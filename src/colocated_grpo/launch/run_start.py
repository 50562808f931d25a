"""The start time that names a run directory, the same on every rank of a launch.

Hydra's `${now:…}` is resolved by each process, so the ranks of one torchrun that start in different seconds would
write to different directories. `${run_start:FORMAT}` is the start of the torchrun agent all of a node's ranks share
(their parent), or of the process itself when it was not started by torchrun.
"""

from __future__ import annotations

import os
import time

from colocated_grpo.resilience import process_end


def started_at() -> float:
    import psutil

    return psutil.Process(os.getppid() if process_end.torchrun_worker() else os.getpid()).create_time()


def register() -> None:
    """Make `${run_start:FORMAT}` (strftime FORMAT, local time) available to the configs."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver(
        "run_start", lambda fmt: time.strftime(fmt, time.localtime(started_at())), replace=True, use_cache=True
    )
