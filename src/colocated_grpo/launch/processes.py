"""Child processes that never outlive their parent: each runs in its own process group, its output goes to a
log file, and stopping it stops everything it started (torchrun's workers, vLLM's engine processes)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from subprocess import DEVNULL, STDOUT

from colocated_grpo.provenance import REPO

TRAIN_SCRIPT = REPO / "train.py"
LINUX = sys.platform.startswith("linux")
TORCHRUN = "colocated_grpo.launch.torchrun"  # torchrun that gives its workers the grace below on every torch
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # that grace, in seconds (torch >= 2.12 reads it too)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def train_command(nproc: int, overrides: list[str], script: Path = TRAIN_SCRIPT) -> list[str]:
    """`python train.py …` for one process, else `torchrun --nproc_per_node=N …` on a free rendezvous port."""
    if nproc == 1:
        return [sys.executable, str(script), *overrides]
    return torchrun_command(nproc, overrides, script)


def torchrun_command(
    nproc: int,
    args: list[str],
    script: str | Path = TRAIN_SCRIPT,
    master_port: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """torchrun (launch/torchrun.py) of `script args…` on `nproc` processes per node; a free port by default."""
    port = free_port() if master_port is None else master_port
    nodes = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={nproc}"]
    rendezvous = [f"--master_addr={master_addr}", f"--master_port={port}"]
    return [sys.executable, "-m", TORCHRUN, *nodes, *rendezvous, *extra_args, str(script), *args]


def shutdown_timeout(env: Mapping[str, str]) -> int | None:
    """The grace, in whole seconds, that `env` gives a torchrun's workers after a stop signal; None: torch's own."""
    value = env.get(SHUTDOWN_TIMEOUT_ENV, "").strip()
    return int(value) if value.isdigit() else None


def with_grace(env: Mapping[str, str], grace_s: float) -> dict[str, str]:
    """`env` in which a torchrun gives its workers `grace_s` after a stop signal, or the larger grace it gave."""
    grace = max(math.ceil(grace_s), shutdown_timeout(env) or 0)
    return {**env, SHUTDOWN_TIMEOUT_ENV: str(grace)}


def start(
    cmd: list[str], log_path: Path, env: dict | None = None, cwd: Path | None = None, grace_s: float | None = None
) -> subprocess.Popen:
    """Start `cmd` in a session of its own, output appended to log_path, and bound to this process's life. A torchrun
    in it (torchrun_command) gives its workers `grace_s` after a stop signal before it kills them, or the larger grace
    that `env` gives (its default: 30 s)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if grace_s is not None:
        env = with_grace(os.environ if env is None else env, grace_s)
    argv = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *map(str, cmd)] if LINUX else cmd
    with open(log_path, "ab") as log:  # the child holds its own descriptor
        return subprocess.Popen(
            argv, stdout=log, stderr=STDOUT, stdin=DEVNULL, env=env, cwd=cwd, start_new_session=True
        )


# The child's first instructions, then its command in the same process: SIGTERM when this process dies, even by
# SIGKILL (the parent died already: at once), so nothing is orphaned. Not a preexec_fn, which would run Python between
# fork and exec in a parent whose other threads may hold a lock at the fork.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG (Linux)
    "os.getppid() == int(sys.argv[1]) or os.kill(os.getpid(), signal.SIGTERM); os.execvp(sys.argv[2], sys.argv[2:])"
)


def run(
    cmd: list[str], log_path: Path, env: dict | None = None, grace_s: float = 30.0, first_signal: int = signal.SIGTERM
) -> int:
    """Run `cmd` to the end (see `start`) and return its exit code. Whatever happens (Ctrl-C included), no process
    of it outlives this call: on an exception it is stopped with `first_signal` first."""
    proc = start(cmd, log_path, env, grace_s=grace_s)
    try:
        return proc.wait()
    except BaseException:
        stop(proc, grace_s, first_signal)
        raise
    finally:
        _kill_group(proc.pid, signal.SIGKILL)  # stragglers of a command that ended (none is the usual case)


def stop(proc: subprocess.Popen, grace_s: float = 20.0, first_signal: int = signal.SIGTERM) -> int:
    """`first_signal` to the child's process group, SIGTERM after `grace_s` (when the first was another), then
    SIGKILL to the group and to every descendant, even one that left the group."""
    import psutil

    def descendants():
        try:
            return psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    seen = descendants()
    steps = [(first_signal, grace_s)] + ([(signal.SIGTERM, 10.0)] if first_signal != signal.SIGTERM else [])
    for sig, wait_s in steps:
        _kill_group(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            seen += descendants()
    _kill_group(proc.pid, signal.SIGKILL)
    for p in seen + descendants():
        with contextlib.suppress(psutil.Error):
            p.kill()
    code = proc.wait()
    psutil.wait_procs(seen, timeout=5)
    return code


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def tail(path: Path, lines: int = 30) -> list[str]:
    """The last `lines` lines of a log (read from its end, so a long log costs nothing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200 * lines - 4096))
            return f.read().decode("utf-8", "replace").splitlines()[-lines:]
    except OSError:
        return []
