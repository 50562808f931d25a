"""Python's garbage collector around the imports of torch, transformers, TRL and vLLM (a run's, a sweep's parent)."""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def paused_for_imports():
    """The libraries make ~700,000 objects that live as long as the process, which the collector would scan again
    each time a full pass comes due while they arrive (~2 s of CPU a run: docs/development.md). Paused meanwhile,
    then frozen out of its passes (gc.freeze; vLLM freezes its engine's likewise). The cycles made meanwhile stay
    (~12,000 small objects)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
