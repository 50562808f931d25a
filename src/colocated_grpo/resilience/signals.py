"""Every signal handler of the package, one per process role and phase; no other module installs one (a test checks
it). What each does is the table "What a signal does, by process and phase" in docs/resilience.md, whose rows name
these functions. Standard library only at import: train.py installs the start-up handler before anything heavy is
imported.

- a trainer (`python train.py`, a torchrun worker, the server placement's orchestrator, the plain-TRL bench):
  - start-up and loading, `run_main`: SIGTERM unwinds as StoppedAtOnce (exit 143, one line); Ctrl-C is Python's own
    KeyboardInterrupt;
  - training, `during_training`: SIGTERM and SIGINT go to the preemption callback (preemption.py), which stops every
    rank at the end of the step with a checkpoint (`stopping_at_once` for the plain-TRL bench: stopped at once);
  - the ending, `ending`: SIGTERM lets the ending go on, and stops one that hangs ENDING_GRACE_S after it began;
  - under torchrun, `stop_with_torchrun_agent`: SIGTERM when the torchrun agent dies, even by SIGKILL.
- an orchestrator of jobs (a sweep, a study), `sigterm_as_interrupt`: SIGTERM stops it as Ctrl-C does, so that the
  running job is stopped and recorded, not orphaned.
  - with the engine in processes of its own (placement=colocate_process), `fail_when_any_ends`: when one of them
    has ended and the main thread waits on it, SIGUSR2 from a watching thread raises the error that says so there.
- an engine's own process (placement=colocate_process), `write_stacks_when_asked`: SIGUSR1, from the trainer when
  the engine has not started in time, writes where its threads are into the run's output before the trainer ends it;
  `leave_stops_to_the_trainer`: out of the trainer's process group, SIGINT ignored, and SIGTERM in its engine core
  (the trainer stops).
- the torchrun this project starts (launch/torchrun.py), `torchrun_agent`: torch's own handler passes the signal to
  the workers and waits for them; then the agent exits 128 + the signal in one line, not 1 with a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from colocated_grpo.resilience.process_end import exit_now, torchrun_worker

ENDING_GRACE_S = 10.0  # how long a run's ending may take before a SIGTERM received in it is honoured
_ending_since: float | None = None


class StoppedAtOnce(KeyboardInterrupt):
    """A signal stopped the process where it was, without a checkpoint; `code` is the exit status, str() says so."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.code = 128 + signum


class TrainingInterrupted(SystemExit):
    """Training stopped on a signal, with a checkpoint; `code` is the exit status, str() says how to resume."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.code = 128 + signum


def run_main(main: Callable[[], None]) -> None:
    """Call `main` with SIGTERM unwinding as StoppedAtOnce until training installs its own handler; a stop before
    the run can report it (Hydra still composing or writing its record) ends here, in one line."""
    signal.signal(signal.SIGTERM, _stop_in_start_up)
    try:
        main()
    except StoppedAtOnce as stop:
        print(stop, file=sys.stderr, flush=True)
        exit_now(stop.code)


def _stop_in_start_up(signum, frame) -> None:
    raise StoppedAtOnce(signum, "SIGTERM during start-up: stopped before the first step, nothing trained")


def during_training(handler: Callable[[int, object], None]):
    """SIGTERM and SIGINT go to `handler` while the block runs (main thread only); the previous handlers come back
    after it, or when `handler` calls the `restore` this yields."""
    return _handled(handler, (signal.SIGTERM, signal.SIGINT))


def stopping_at_once():
    """For a trainer that saves nothing on a signal (the plain-TRL bench): SIGTERM and Ctrl-C while the block runs
    stop it at once (StoppedAtOnce), saying that it was in training."""
    return _handled(_stop_in_training, (signal.SIGTERM, signal.SIGINT))


def _stop_in_training(signum, frame) -> None:
    name = signal.Signals(signum).name
    raise StoppedAtOnce(signum, f"{name} during training: stopped at once, without a checkpoint (none is saved)")


@contextlib.contextmanager
def _handled(handler: Callable[[int, object], None], signums: tuple[int, ...]) -> Iterator[Callable[[], None]]:
    previous = {sig: signal.signal(sig, handler) for sig in signums}

    def restore() -> None:
        while previous:
            signal.signal(*previous.popitem())

    try:
        yield restore
    finally:
        restore()


def ending() -> None:
    """The run is ending (run files, W&B, process group, failure report): a SIGTERM no longer cuts it short, but
    stops an ending that hangs ENDING_GRACE_S after it began, exit 143. Ctrl-C still stops at once."""
    global _ending_since
    if _ending_since is None:
        _ending_since = time.monotonic()
    signal.signal(signal.SIGTERM, _during_ending)


def _during_ending(signum, frame) -> None:
    left = ENDING_GRACE_S - (time.monotonic() - _ending_since)
    if left <= 0:
        _stop_ending()
    else:  # the process normally ends first, and the timer with it
        timer = threading.Timer(left, _stop_ending)
        timer.daemon = True
        timer.start()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one timer is enough


def _stop_ending() -> None:
    said = f"SIGTERM: the run's ending (run files, W&B, process group) took over {ENDING_GRACE_S:.0f} s; stopped"
    print(said, file=sys.stderr, flush=True)
    exit_now(128 + signal.SIGTERM)


def stop_with_torchrun_agent() -> None:
    """Under torchrun, receive SIGTERM when the agent (this process's parent) dies, even by SIGKILL, and stop as a
    preempted run does, rather than train on orphaned in a session of its own. Linux only."""
    import ctypes
    import os

    if not torchrun_worker() or not sys.platform.startswith("linux"):
        return
    agent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != agent:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def torchrun_agent(run_torchrun: Callable[[], object]) -> int:
    """Run torchrun's agent and return its exit status. Torch's own handler raises SignalException on SIGTERM,
    SIGINT, SIGHUP and SIGQUIT; the agent passes the signal to the workers, waits for them and raises it again: that
    stop ends here, 128 + the signal and one line, rather than exit 1 with torch's traceback. The workers' own lines
    above it say what they saved."""
    from torch.distributed.elastic.multiprocessing import SignalException

    try:
        run_torchrun()
    except SignalException as stop:
        name = signal.Signals(stop.sigval).name
        said = f"torchrun: stopped by {name}, which it passed to the workers (their own lines say where they stopped)"
        print(said, file=sys.stderr, flush=True)
        return 128 + stop.sigval
    return 0


def sigterm_as_interrupt():
    """SIGTERM (kill, a scheduler) stops an orchestrator of jobs as Ctrl-C does: the running job is stopped, not
    orphaned."""
    return _handled(_interrupt, (signal.SIGTERM,))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# The trainer sends it to the engine's processes that have not started in time (write_stacks_when_asked, run by our vLLM
# plugin in each of them, has each write its stacks on it).
WRITE_STACKS_SIGNAL = signal.SIGUSR1
# A process of its own that the trainer depends on ended: raised in the main thread, which may be waiting for it with
# no timeout (vLLM's SyncMPClient.get_output waits on a queue that a dead engine never fills).
PROCESS_ENDED_SIGNAL = signal.SIGUSR2
WATCH_INTERVAL_S = 1.0


def fail_when_any_ends(processes: list, error: Callable[[], BaseException], waiting: Callable[[], bool]) -> None:
    """From the main thread: raise `error()` there when one of `processes` (psutil.Process) has ended before this
    process and the main thread is `waiting()` on them (a signal elsewhere could cut one of its collectives short, and
    their next call waits there); a watching thread checks every WATCH_INTERVAL_S and signals the main thread."""
    import psutil

    main = threading.main_thread().ident

    def raise_error(signum, frame) -> None:
        raise error()

    def watch() -> None:
        while all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes) or not waiting():
            time.sleep(WATCH_INTERVAL_S)
        signal.pthread_kill(main, PROCESS_ENDED_SIGNAL)

    if processes:
        signal.signal(PROCESS_ENDED_SIGNAL, raise_error)
        threading.Thread(target=watch, name="watch-processes", daemon=True).start()


def leave_stops_to_the_trainer(terminate_too: bool) -> None:
    """In an engine's own process: a stop (Ctrl-C in a terminal, torchrun's SIGTERM to its worker's process group,
    SLURM's to every process of the job) is the trainer's, which finishes the step with the engine it needs, saves a
    checkpoint and exits; the engine ends with it (its parent-death signal). So the process leaves the trainer's
    process group, which a terminal and torchrun signal, and ignores SIGINT; with `terminate_too` (vLLM's engine core,
    once running) SIGTERM too, on which vLLM would shut the engine down."""
    import os

    os.setpgid(0, 0)
    for stop in (signal.SIGINT, signal.SIGTERM) if terminate_too else (signal.SIGINT,):
        signal.signal(stop, signal.SIG_IGN)


def write_stacks_when_asked() -> None:
    """In an engine's own process: on the signal the trainer sends when the engine has not started in time, write
    every thread's stack to stderr (Python's faulthandler, which writes even while the process waits in C code)."""
    import faulthandler

    faulthandler.register(WRITE_STACKS_SIGNAL, all_threads=True)
