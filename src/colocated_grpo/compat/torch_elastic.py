"""torchrun's agent (torch.distributed.elastic): how long it waits for its workers after a stop signal. Written for
torch 2.11.0 (the GPU and CPU pin) and 2.12; docs/resilience.md says which torch reads which setting."""

from __future__ import annotations


def honour_shutdown_timeout(grace_s: int | None) -> None:
    """Make torchrun's agent wait at least `grace_s` (None: torch's own) for its workers after a stop signal, then
    SIGKILL them. Torch 2.11's agent closes its workers with PContext.close(death_sig), whose timeout defaults to
    30 s; 2.12 and later pass the shutdown timeout they read (LocalElasticAgent._shutdown)."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    if grace_s is None:
        return
    close = PContext.close
    torch_default_s = close.__defaults__[-1]  # the timeout torch waits when none is given (30 s)

    def close_after_the_grace(self, death_sig=None, timeout: int | None = None) -> None:
        close(self, death_sig, max(torch_default_s if timeout is None else timeout, grace_s))

    PContext.close = close_after_the_grace
