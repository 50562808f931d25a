"""The torchrun this project starts (launch/torchrun.py): its workers get the grace the caller gives after a stop
signal on every torch, and it ends a stop with 128 + the signal and one line, not torch's exit 1 and traceback."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.api import PContext

from colocated_grpo.compat import torch_elastic
from colocated_grpo.launch import processes

# A worker that takes `argv[1]` seconds to finish its step and save after SIGTERM or Ctrl-C, as the runner does.
WORKER = """
import signal, sys, time
def stop(signum, frame):
    time.sleep(float(sys.argv[1]))
    print("worker saved", flush=True)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
print("worker ready", flush=True)
time.sleep(120)
"""
# Our torchrun on torch's own agent (torch 2.11's LocalElasticAgent._shutdown calls PContext.close(death_sig) without a
# timeout), with torch's default wait of 30 s shortened to 1 s to keep the test short.
SHORT_DEFAULT = """
import sys
from torch.distributed.elastic.multiprocessing.api import PContext
from colocated_grpo.launch import torchrun
PContext.close.__defaults__ = (None, 1)
sys.exit(torchrun.main())
"""


def _stopped(cmd: list[str], log: Path, env: dict, grace_s: float | None, signum: int) -> int:
    """Start `cmd` as our launchers do, send `signum` once its worker is ready, and return its exit code."""
    proc = processes.start(cmd, log, env, grace_s=grace_s)
    deadline = time.monotonic() + 60
    while "worker ready" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert "worker ready" in log.read_text(), log.read_text()
    return processes.stop(proc, 30, signum)


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if k != processes.SHUTDOWN_TIMEOUT_ENV}


@pytest.mark.parametrize("grace_s", [8, None], ids=["grace", "torch_default"])
def test_torchrun_gives_its_workers_the_grace_even_where_torch_gives_its_own_default(tmp_path, grace_s):
    """The worker needs 3 s to save; torch's agent waits its default, 1 s here (30 s in torch). With the caller's
    grace of 8 s the worker saves; without it (the check that the short default bites) it is killed unsaved."""
    worker, driver, log = tmp_path / "worker.py", tmp_path / "short_default.py", tmp_path / "log"
    worker.write_text(WORKER)
    driver.write_text(SHORT_DEFAULT)
    args = processes.torchrun_command(1, ["3"], worker)[3:]  # after `python -m colocated_grpo.launch.torchrun`
    code = _stopped([sys.executable, str(driver), *args], log, _environment(), grace_s, signal.SIGTERM)
    output = log.read_text()
    assert code == 143, output
    assert ("worker saved" in output) == (grace_s is not None), output


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_torchrun_stopped_by_a_signal_exits_with_it_in_one_line_without_a_traceback(tmp_path, signum):
    """After its workers' clean stop (exit 143 or 130) torchrun exits as they did, one line saying so; torch's own
    ends with 1 and its SignalException's traceback. A sweep sends SIGINT first, server placement SIGTERM."""
    worker, log = tmp_path / "worker.py", tmp_path / "log"
    worker.write_text(WORKER)
    code = _stopped(processes.torchrun_command(1, ["1"], worker), log, _environment(), 10, signum)
    output = log.read_text()
    assert code == 128 + signum and "worker saved" in output, output
    name = signal.Signals(signum).name
    assert f"torchrun: stopped by {name}, which it passed to the workers" in output
    assert "Traceback" not in output and "SignalException" not in output, output


def test_the_agent_waits_the_larger_of_the_callers_grace_and_its_own_timeout(monkeypatch):
    """Torch 2.11 closes the workers without a timeout (30 s by default): the grace holds. Torch 2.12 passes the
    timeout it read (`--shutdown_timeout`, TORCH_ELASTIC_SHUTDOWN_TIMEOUT): a larger one holds."""
    waited = []
    monkeypatch.setattr(PContext, "close", lambda self, death_sig=None, timeout=30: waited.append(timeout))
    torch_elastic.honour_shutdown_timeout(None)
    PContext.close(None, signal.SIGTERM)
    torch_elastic.honour_shutdown_timeout(45)
    PContext.close(None, signal.SIGTERM)
    PContext.close(None, signal.SIGTERM, 200)
    PContext.close(None, signal.SIGTERM, timeout=10)
    assert waited == [30, 45, 200, 45]


def test_a_users_larger_shutdown_timeout_is_kept_and_a_smaller_one_raised_to_the_grace(tmp_path):
    show = [sys.executable, "-c", f"import os; print(os.environ['{processes.SHUTDOWN_TIMEOUT_ENV}'])"]
    for held, grace_s, given in (("200", 45, "200"), ("30", 44.5, "45"), ("", 60, "60"), ("soon", 60, "60")):
        log = tmp_path / f"log_{held}"
        assert processes.run(show, log, {**os.environ, processes.SHUTDOWN_TIMEOUT_ENV: held}, grace_s=grace_s) == 0
        assert log.read_text().split() == [given], (held, grace_s)
    assert processes.shutdown_timeout({processes.SHUTDOWN_TIMEOUT_ENV: "200"}) == 200
    assert processes.shutdown_timeout({}) is None
