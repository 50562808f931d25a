"""vLLM's `vllm.general_plugins` entry point (pyproject.toml), which vLLM runs in each of its processes: in the
engine's own processes of placement=colocate_process (their environment says so; not in the trainer's, where vLLM
runs it too), each writes its stacks when the trainer asks and leaves stops to the trainer (resilience/signals.py),
and gets our engine patches (generation/engine_worker.py); elsewhere it does nothing, so other vLLM users are untouched.
Light to import: no torch, TRL or vLLM."""

from __future__ import annotations

import functools

from colocated_grpo.generation import engine_worker
from colocated_grpo.resilience import signals


def load() -> None:
    if not engine_worker.in_engine_process():  # other vLLM users, and the trainer's own process
        return
    signals.write_stacks_when_asked()  # where it waits, should it not start in time
    signals.leave_stops_to_the_trainer(terminate_too=False)
    # SIGTERM too where vLLM's engine core starts its loop, after it installed its own handlers
    engine_worker.apply_patches(at_engine_core_loop=functools.partial(signals.leave_stops_to_the_trainer, True))
