"""Child processes that never outlive their parent: each runs in its own process group, its output goes to a
log file, and stopping it stops everything it started (torchrun's workers, vLLM's engine processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def train_command(nproc: int, overrides: list[str], script: Path = REPO / "train.py") -> list[str]:
    """`python train.py …` for one process, else `torchrun --nproc_per_node=N …` on a free rendezvous port."""
    if nproc == 1:
        return [sys.executable, str(script), *overrides]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            str(script), *overrides]  # fmt: skip


def start(cmd: list[str], log_path: Path, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
    finally:
        log.close()  # the child holds its own descriptor


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> int | None:
    """SIGTERM the child's whole process group, then SIGKILL what is left after `grace_s`."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)  # stragglers of the group, even when the leader has exited
    return proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return ""


def wait(proc: subprocess.Popen, poll_s: float = 0.5) -> int:
    """Wait for the child; on Ctrl-C or any error stop its whole group first, then re-raise."""
    try:
        while proc.poll() is None:
            time.sleep(poll_s)
        return proc.returncode
    except BaseException:
        stop(proc)
        raise
