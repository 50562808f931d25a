"""vLLM's `vllm.general_plugins` entry point (pyproject.toml), which vLLM runs in each of its processes: in the
engine's own processes of placement=colocate_process (their environment says so), each writes its stacks when the
trainer asks (resilience/signals.py) and gets our engine patches (compat/engine_worker.py); elsewhere it does nothing,
so other vLLM users are untouched. Light to import: no torch, TRL or vLLM."""

from __future__ import annotations

import os

from colocated_grpo.compat import engine_worker
from colocated_grpo.resilience import signals


def load() -> None:
    if os.environ.get(engine_worker.ENGINE_PROCESS) is None:
        return
    signals.write_stacks_when_asked()  # where it waits, should it not start in time
    engine_worker.apply_patches()
