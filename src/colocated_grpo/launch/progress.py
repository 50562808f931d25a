"""Progress of jobs run one after another (a sweep, a study): job k/N, the running job's step (from its
metrics.jsonl), the time elapsed and left. On a terminal a rich progress bar with log lines above it; elsewhere plain
lines: one when a job starts and one with the step every `every_s` seconds."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from colocated_grpo import run_files
from colocated_grpo.launch.processes import tail


def latest_step(metrics: Path) -> int | None:
    """The last training step a metrics.jsonl records (its tail is enough: one line per step)."""
    for line in reversed(tail(metrics, lines=60)):
        try:
            step = json.loads(line).get(run_files.STEP_KEY)
        except (ValueError, AttributeError):
            continue  # the first line of the tail may be cut, the last torn by the writer
        if step is not None:
            return int(step)
    return None


def max_steps(run_dir: Path) -> int | None:
    """The run's trainer.max_steps, from the config.yaml it wrote when it started."""
    try:
        cfg = yaml.safe_load((run_dir / run_files.CONFIG).read_text())
        return int(cfg["trainer"]["max_steps"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


def run_step(run_dir: Path) -> tuple[int | None, int | None]:
    """(step reached, max_steps) of a run directory; None where it has not written them yet."""
    return latest_step(run_dir / run_files.METRICS), max_steps(run_dir)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """`with Progress("sweep", n) as p:` then, per job, `with p.job(label, step_of):` around running it, or
    `p.skip(label)` for one not run. `step_of()` gives the running job's (step, max_steps), either may be None."""

    def __init__(self, what: str, total: int, every_s: float = 60.0, say: Callable[[str], None] | None = None):
        self.what, self.total, self.every_s = what, total, every_s
        self.say = say or (lambda line: print(line, flush=True))
        self.tty = sys.stdout.isatty()
        self.done, self.durations = 0, []
        self.t0 = time.monotonic()
        self._job_t0 = None
        self._step: tuple[int | None, int | None] = (None, None)
        self._bar = self._task = None

    def __enter__(self) -> Progress:
        self._exits = contextlib.ExitStack()
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
            columns += [TextColumn("{task.fields[job]}"), TimeElapsedColumn(), TextColumn("~{task.fields[left]} left")]
            bar = Bar(*columns, redirect_stdout=True, redirect_stderr=True)
            self._bar = self._exits.enter_context(bar)  # started here, stopped on exit
            self._task = self._bar.add_task(self.what, total=self.total, job="", left="?")
            self._exits.enter_context(_logs_to_current_streams())
        return self

    def __exit__(self, *exc) -> None:
        self._exits.__exit__(*exc)

    def skip(self, label: str) -> None:
        self.done += 1
        self._refresh(label)

    @contextlib.contextmanager
    def job(self, label: str, step_of: Callable[[], tuple[int | None, int | None]] = lambda: (None, None)):
        self._job_t0, self._step = time.monotonic(), (None, None)
        if not self.tty:
            self.say(f"[{self.done + 1}/{self.total}] {label}: {self._times()}")
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(label, step_of, stop), daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()
            self.durations.append(time.monotonic() - self._job_t0)
            self._job_t0, self.done = None, self.done + 1
            self._refresh("")

    def _watch(self, label: str, step_of, stop: threading.Event) -> None:
        last_line = time.monotonic()
        while not stop.wait(1.0 if self.tty else min(self.every_s, 5.0)):
            self._step = step_of()
            if self.tty:
                self._refresh(label)
            elif time.monotonic() - last_line >= self.every_s:
                last_line = time.monotonic()
                self.say(f"    {label}: {self._step_text()}; {self._times()}")

    def _step_text(self) -> str:
        step, steps = self._step
        if step is None:
            return "starting"
        return f"step {step}/{steps}" if steps else f"step {step}"

    def remaining_s(self) -> float | None:
        """The running job's time left (from its step rate, else the mean job) plus the mean job for each after it."""
        running = self._job_t0 is not None
        elapsed = time.monotonic() - self._job_t0 if running else 0.0
        per_job = sum(self.durations) / len(self.durations) if self.durations else None
        step, steps = self._step
        current = None
        if running and step and steps:
            current = elapsed / step * max(steps - step, 0)
            per_job = per_job or elapsed + current
        elif running and per_job is not None:
            current = max(per_job - elapsed, 0.0)
        if per_job is None or (running and current is None):
            return None
        after = self.total - self.done - (1 if running else 0)
        return (current or 0.0) + per_job * after

    def _times(self) -> str:
        return f"{duration(time.monotonic() - self.t0)} elapsed, ~{duration(self.remaining_s())} left"

    def _refresh(self, label: str) -> None:
        if self._bar is None:
            return
        job = f"{label}: {self._step_text()}" if label else ""
        self._bar.update(self._task, completed=self.done, job=job, left=duration(self.remaining_s()))


@contextlib.contextmanager
def _logs_to_current_streams() -> Iterator[None]:
    """While the bar is shown, logging handlers of the terminal write through rich's redirected stdout/stderr, so
    that their lines go above the bar, not into it."""
    swapped = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            for original, current in ((sys.__stdout__, sys.stdout), (sys.__stderr__, sys.stderr)):
                if handler.stream is original and current is not original:
                    swapped.append((handler, handler.setStream(current)))
    try:
        yield
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)
