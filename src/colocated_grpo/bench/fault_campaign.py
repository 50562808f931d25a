"""A fault campaign: one run interrupted again and again, resumed each time with the same command, then checked.

    python -m colocated_grpo.bench.fault_campaign --out outputs/fault_campaign [--steps 40] [--faults 5] [--seed 0]

The run (`train.py`, CPU or GPU, W&B offline) is stopped `--faults` times at moments drawn from `--seed`: SIGKILL,
SIGTERM or SIGINT to its process group (as a scheduler or a terminal sends them), during start-up, between steps, or
while a checkpoint is being written (a `checkpoint-N/` without its trainer_state.json yet). After each stop the same
command runs again; the last attempt runs to the end. Then the campaign checks what a run promises:

- metrics.jsonl holds every step exactly once, in order;
- run.json lists every attempt that got as far as recording itself, each with the status its stop implies (SIGKILL:
  died, SIGTERM/SIGINT: interrupted, the last: finished); an attempt stopped before it recorded itself (early in
  start-up) is reported as such;
- the offline W&B run (every segment of the id in run.json) holds each step once;
- no process of any attempt is left (psutil).

It prints a table of the attempts and the checks, writes them to `<out>/fault_campaign.json`, and exits 1 when a
check fails.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from colocated_grpo import run_files
from colocated_grpo.launch import processes
from colocated_grpo.provenance import checkout, command_parser
from colocated_grpo.resilience.checkpoints import latest as latest_checkpoint
from colocated_grpo.run_files import STEP_KEY, read_json, read_jsonl, write_json

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
MOMENTS = ("startup", "step", "save")
EXPECTED_STATUS = {"SIGKILL": "died", "SIGTERM": "interrupted", "SIGINT": "interrupted", None: "finished"}


@dataclass
class Attempt:
    number: int
    signal: str | None  # None: the last attempt, run to its end
    moment: str | None  # what was aimed at: startup, step or save
    hit: str = ""  # what the signal really hit (e.g. a save that ended before it could be caught)
    exit_code: int | None = None
    steps_before: int = 0
    steps_after: int = 0
    seconds: float = 0.0
    recorded: bool = False  # run.json lists it
    status: str | None = None  # its status in run.json
    leftover: list[str] = field(default_factory=list)  # processes of it still alive after it ended


# The checks (also run by the tests on synthetic run files)


def check_steps(run_dir: Path, steps: int) -> tuple[bool, str]:
    found = [r.get(STEP_KEY) for r in read_jsonl(Path(run_dir) / run_files.METRICS)]
    want = list(range(1, steps + 1))
    if found == want:
        return True, f"steps 1..{steps}, each once"
    missing = sorted(set(want) - set(found))
    repeated = sorted({s for s in found if found.count(s) > 1})
    return False, f"{len(found)} rows; missing {missing or 'none'}; repeated {repeated or 'none'}; order {found}"


def check_attempts(run_dir: Path, attempts: list[Attempt]) -> tuple[bool, str]:
    """Every attempt that recorded itself is in run.json, in order, with the status its stop implies; the others
    were stopped in start-up. Fills each attempt's `status`."""
    listed = _run_record(run_dir).get("attempts", [])
    recorded = [a for a in attempts if a.recorded]
    problems = []
    if len(listed) != len(recorded):
        problems.append(f"run.json lists {len(listed)} attempts, {len(recorded)} recorded themselves")
    for attempt, entry in zip(recorded, listed, strict=False):
        attempt.status = entry.get("status")
        if attempt.status != EXPECTED_STATUS[attempt.signal]:
            problems.append(f"attempt {attempt.number} ({attempt.signal}): status {attempt.status}")
    unrecorded = [a for a in attempts if not a.recorded]
    problems += [
        f"attempt {a.number} ({a.signal} at {a.hit}) trained steps but is not in run.json"
        for a in unrecorded
        if a.steps_after > a.steps_before
    ]
    note = f"; {len(unrecorded)} stopped in start-up before recording" if unrecorded else ""
    return not problems, "; ".join(problems) or f"{len(listed)} attempts, statuses as expected{note}"


def check_wandb(run_dir: Path, steps: int) -> tuple[bool, str]:
    from colocated_grpo.compat import wandb as wandb_log
    from colocated_grpo.resilience import wandb_rewind

    run_id = _run_record(run_dir).get("wandb_id")
    if not run_id:
        return False, "run.json names no W&B run"
    segments = wandb_rewind.segments(Path(run_dir) / "wandb", run_id)
    rows = [
        r["train/global_step"]
        for segment in segments
        for r in wandb_log.history(next(segment.glob("run-*.wandb")))
        if "train/loss" in r
    ]
    if rows == list(range(1, steps + 1)):
        return True, f"run {run_id}: {len(segments)} segments, steps 1..{steps} each once"
    return False, f"run {run_id}: {len(segments)} segments, step rows {rows}"


def leftover_processes(pgids: list[int], marker: str) -> list[str]:
    """Processes still alive in any of `pgids`, or whose command line names `marker` (the run directory)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            in_group = os.getpgid(p.pid) in pgids
            named = marker in " ".join(p.info["cmdline"] or [])
            alive = p.status() != psutil.STATUS_ZOMBIE
        except (OSError, psutil.Error):
            continue
        if (in_group or named) and alive and p.pid != os.getpid():
            found.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
    return found


# The campaign


def plan_faults(faults: int, seed: int) -> list[tuple[str, str]]:
    """(signal, moment) for each fault: every signal and every moment at least once when there are enough faults."""
    rng = random.Random(seed)
    signals = (list(SIGNALS) * faults)[:faults]
    moments = (list(MOMENTS) * faults)[:faults]
    rng.shuffle(signals)
    rng.shuffle(moments)
    return list(zip(signals, moments, strict=True))


def _steps(run_dir: Path) -> int:
    return len(read_jsonl(run_dir / run_files.METRICS))


def resume_choice(run_dir: Path) -> list[str]:
    """The override a user gives the next launch: none, or, after a kill before the first complete checkpoint (steps
    logged, nothing to resume from, which a resume refuses), the explicit choice to start over."""
    return ["run.resume=restart"] if _steps(run_dir) and latest_checkpoint(run_dir) is None else []


def _saving(run_dir: Path) -> bool:
    return any(p.is_dir() and not (p / "trainer_state.json").exists() for p in run_dir.glob("checkpoint-*"))


def _run_record(run_dir: Path) -> dict:
    return read_json(Path(run_dir) / run_files.RUN) or {}


def _attempts_listed(run_dir: Path) -> int:
    return len(_run_record(run_dir).get("attempts", []))


def _wait_for_moment(proc, run_dir: Path, moment: str, rng: random.Random, start_steps: int) -> str:
    """Return when the moment has come (or the run ended); says what was hit."""
    if moment == "startup":
        time.sleep(rng.uniform(1.0, 20.0))
        return "startup" if _steps(run_dir) == start_steps else f"after step {_steps(run_dir)} (aimed at start-up)"
    if moment == "step":
        target = start_steps + rng.randint(1, 4)
        while proc.poll() is None and _steps(run_dir) < target:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        return f"after step {_steps(run_dir)}"
    while proc.poll() is None and not _saving(run_dir):
        time.sleep(0.002)
    return f"during the save after step {_steps(run_dir)}" if _saving(run_dir) else "end (no save caught)"


def run_attempt(attempt: Attempt, cmd, env, run_dir: Path, log: Path, rng: random.Random, pgids: list[int]) -> None:
    attempt.steps_before = _steps(run_dir)
    listed_before = _attempts_listed(run_dir)
    started = time.monotonic()
    proc = processes.start(cmd, log, env, cwd=run_dir.parent)
    pgids.append(proc.pid)
    if attempt.signal is None:
        attempt.hit = "ran to the end"
    else:
        attempt.hit = _wait_for_moment(proc, run_dir, attempt.moment, rng, attempt.steps_before)
        if proc.poll() is None:
            os.killpg(proc.pid, SIGNALS[attempt.signal])
    try:
        attempt.exit_code = proc.wait(timeout=300 if attempt.signal else 3600)
    except subprocess.TimeoutExpired:
        attempt.hit += "; did not stop within 300 s"
        attempt.exit_code = processes.stop(proc, grace_s=5)
    time.sleep(2)  # what the run's own shutdown still ends (vLLM workers, W&B's service) has ended by now
    attempt.leftover = leftover_processes([proc.pid], str(run_dir))
    for line in attempt.leftover:  # found and reported; ended so that the next attempt starts clean
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    attempt.seconds = round(time.monotonic() - started, 1)
    attempt.steps_after = _steps(run_dir)
    attempt.recorded = _attempts_listed(run_dir) > listed_before


def campaign(out: Path, steps: int, save_steps: int, faults: int, seed: int, overrides: list[str]) -> dict:
    run_dir = (out / "run").resolve()
    saving = ["trainer.save_strategy=steps", f"trainer.save_steps={save_steps}"]
    overrides = [f"hydra.run.dir={run_dir}", f"trainer.max_steps={steps}", *saving, *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    rng = random.Random(seed)
    plan = [*plan_faults(faults, seed), (None, None)]  # the last attempt runs to the end
    attempts = [Attempt(i, sig, moment) for i, (sig, moment) in enumerate(plan, 1)]
    pgids: list[int] = []
    for attempt in attempts:
        log = out / f"attempt-{attempt.number}.log"
        cmd = processes.train_command(1, [*overrides, *resume_choice(run_dir)], checkout() / "train.py")
        run_attempt(attempt, cmd, env, run_dir, log, rng, pgids)
        print(
            f"attempt {attempt.number}: {attempt.signal or '-'} at {attempt.hit}: exit {attempt.exit_code}, steps "
            f"{attempt.steps_before} -> {attempt.steps_after} ({attempt.seconds} s)",
            flush=True,
        )
    checks = {
        "metrics.jsonl": check_steps(run_dir, steps),
        "run.json": check_attempts(run_dir, attempts),
        "W&B offline run": check_wandb(run_dir, steps),
        "no process left": _check_leftovers(attempts, pgids, run_dir),
    }
    return {
        "command": cmd,
        "seed": seed,
        "steps": steps,
        "save_steps": save_steps,
        "attempts": [asdict(a) for a in attempts],
        "checks": {name: {"ok": ok, "detail": detail} for name, (ok, detail) in checks.items()},
        "ok": all(ok for ok, _ in checks.values()),
    }


def _check_leftovers(attempts: list[Attempt], pgids: list[int], run_dir: Path) -> tuple[bool, str]:
    problems = [f"attempt {a.number}: {line}" for a in attempts for line in a.leftover]
    problems += [f"at the end: {line}" for line in leftover_processes(pgids, str(run_dir))]
    return not problems, "; ".join(problems) or "none after any attempt"


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    columns = ("#", "signal", "hit", "exit", "steps", "s", "run.json status", "left over")
    table = Table(*columns, title=f"fault campaign: {report['steps']} steps, seed {report['seed']}")
    for a in report["attempts"]:
        table.add_row(
            str(a["number"]),
            a["signal"] or "-",
            a["hit"],
            str(a["exit_code"]),
            f"{a['steps_before']} -> {a['steps_after']}",
            str(a["seconds"]),
            a["status"] or ("not recorded" if not a["recorded"] else "?"),
            str(len(a["leftover"])),
        )
    checks = Table("check", "ok", "detail", title="checks")
    for name, c in report["checks"].items():
        checks.add_row(name, "yes" if c["ok"] else "NO", c["detail"])
    Console(width=160).print(table, checks)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = command_parser("colocated_grpo.bench.fault_campaign", __doc__, prog)
    parser.add_argument("--out", type=Path, required=True, help="directory for the run, the logs and the report")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="more train.py overrides (after --)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = campaign(args.out, args.steps, args.save_steps, args.faults, args.seed, args.overrides)
    write_json(args.out / "fault_campaign.json", report)
    print_report(report)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
