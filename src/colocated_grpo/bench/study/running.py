"""Running a study: for each model, its cases interleaved (repeat 1 of every case in the order listed, then repeat
2, …: a case and its baseline run next to each other, so a drift of the machine over the study reaches both), each
repeat a one-job sweep through the torchrun launcher; then the standalone generation benchmarks. One step after
another, with a progress bar (step k/N, the running job's training step, time elapsed and left); finished steps are
kept, so running again continues the study (an interrupted repeat resumes, a failed one is run again)."""

from __future__ import annotations

import fnmatch
import shlex
import signal
import sys
import time
from pathlib import Path

from colocated_grpo.bench.study import definition, host, portable
from colocated_grpo.bench.study.definition import bench_command, case_command, case_status, describe, repeat_dir
from colocated_grpo.launch import processes
from colocated_grpo.launch.progress import Progress, run_step
from colocated_grpo.provenance import RESULTS_DIR, checkout
from colocated_grpo.resilience.signals import sigterm_as_interrupt
from colocated_grpo.run_files import write_json


def run(study_file: str | Path, out: str | Path, only: list[str] | None = None, trial: bool = False) -> None:
    """Run the study's steps into `out`, those matching `only` (MODEL/CASE patterns) when given. A study kept with
    the code (`out` under sweeps/results/) runs from a committed tree only, unless `trial`, which its report marks."""
    repo = checkout()  # refuses at once when there is no train.py to run
    study = definition.load(study_file)
    steps = plan(study, only)
    out = Path(out).resolve()  # jobs write where this process means, whatever their cwd
    env = definition.environment(repo, trial)
    refuse_uncommitted(out, repo, env)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.yaml").write_text(Path(study_file).read_text())
    earlier = definition.environments(out)  # a continued study may change machine

    def record(key: str, load: dict) -> None:
        env["runs"][key] = {"load_average": load}
        write_json(out / "env.json", [*earlier, env])

    write_json(out / "env.json", [*earlier, env])
    started = time.monotonic()
    try:
        with sigterm_as_interrupt():  # SIGTERM (kill, a scheduler) stops the study as Ctrl-C does
            _run_steps(study, out, steps, repo, record)
    except KeyboardInterrupt:  # the job in flight was stopped with SIGINT and recorded as interrupted
        print(
            f"study interrupted after {time.monotonic() - started:.0f} s; run the same command again to continue",
            file=sys.stderr,
        )
        sys.exit(130)
    finally:
        # The study's files can be kept with the code; a run that did not finish keeps its own paths, which its
        # resume compares its config against.
        outcome = {step: _step(study, out, step, repo) for step in plan(study)}
        unfinished = [job_dir for _, done, _, _, job_dir in outcome.values() if job_dir and not done]
        portable.rewrite(out, portable.machine_roots(out), keep=unfinished)
    if left := [(what, log, job_dir) for what, done, _, log, job_dir in map(outcome.get, steps) if not done]:
        said = "; ".join(f"{what}: {describe(job) if job else f'no result, see {log}'}" for what, log, job in left)
        print(
            f"study not done: {len(left)} of {len(steps)} steps did not finish ({said}); run the same command "
            "again to run them again",
            file=sys.stderr,
        )
        sys.exit(1)
    print(f"study done in {time.monotonic() - started:.0f} s; report: colocated-grpo study report {out}")


def refuse_uncommitted(out: Path, repo: Path, env: dict) -> None:
    """Refuse to run a kept study (one under the checkout's sweeps/results/) from code that is not a commit's: its
    results would name a commit that did not make them. A trial run (--trial) goes on, marked as one."""
    kept = repo / RESULTS_DIR
    if env.get("trial") or not out.is_relative_to(kept.resolve()):
        return
    git = env["git"]
    if git.get("dirty") is False:
        return
    if git.get("dirty"):
        shown = ", ".join(git.get("changed", []))
        more = git.get("changed_count", 0) - len(git.get("changed", []))
        why = f"the checkout has uncommitted changes ({shown}{f' and {more} more' if more > 0 else ''})"
    else:
        why = f"the checkout's state is unknown ({definition.tree_note(git)})"
    raise SystemExit(
        f"{out}: a study kept in {RESULTS_DIR}/ runs from a committed tree, and {why}. Run it from a git checkout "
        "with its changes committed, or with --trial: the report then marks every run of it as a trial, not as a "
        "result of the commit"
    )


def plan(study: dict, only: list[str] | None = None) -> list[tuple[str, str, str, int | None]]:
    """The study's steps in the order they run: (model, "case", case, repeat) and (model, "bench", name, None).
    `only`: shell patterns of MODEL/CASE (or MODEL/BENCH), or of MODEL/CASE/rep<k> for one repeat; a step matching
    none of them is left out, and a pattern that matches no step is refused (a typo would otherwise run nothing, or
    everything)."""
    steps = [
        step
        for m in study["models"]
        for step in (
            *((m, "case", name, k) for k in range(1, study["repeats"] + 1) for name in definition.cases_of(study, m)),
            *((m, "bench", name, None) for name in study["bench"]),
        )
    ]
    if not only:
        return steps

    def matches(step, pattern: str) -> bool:
        model, _, name, repeat = step
        keys = (f"{model}/{name}", definition.step_key(model, name, repeat))
        return any(fnmatch.fnmatchcase(key, pattern) for key in keys)

    if unmatched := [p for p in only if not any(matches(s, p) for s in steps)]:
        names = sorted({f"{m}/{name}" for m, _, name, _ in steps})
        raise SystemExit(f"--only {' '.join(unmatched)}: no step of this study matches; its steps: {', '.join(names)}")
    return [s for s in steps if any(matches(s, p) for p in only)]


def show(study_file: str | Path, out: str | Path | None = None, only: list[str] | None = None) -> None:
    """Print the steps `run` would take, in order, each with its command; with `out`, a step that finished there
    earlier is shown as kept. Nothing runs."""
    repo = checkout()
    study = definition.load(study_file)
    steps = plan(study, only)
    root = Path(out).resolve() if out is not None else Path("OUT")
    left = 0
    for i, step in enumerate(steps, 1):
        what, done, command, _, job_dir = _step(study, root, step, repo)
        done = done and out is not None
        left += not done
        print(f"[{i}/{len(steps)}] {what}: {_kept(job_dir) if done else shlex.join(command)}")
    print(f"{left} of {len(steps)} steps to run")


def _step(study: dict, out: Path, step: tuple[str, str, str, int | None], repo: Path):
    """What a step is called, whether it finished in `out` earlier, its command, its log, and its job directory
    (None for a bench)."""
    model, kind, name, repeat = step
    if kind == "case":
        case_dir = out / "runs" / model / name
        job_dir = repeat_dir(case_dir, repeat)
        command = case_command(study, model, name, case_dir, repo, repeat)
        return (
            f"{model} {name} rep{repeat}",
            case_status(job_dir) == "finished",
            command,
            case_dir / f"sweep_rep{repeat}.log",
            job_dir,
        )
    path = out / "bench" / model / f"{name}.json"
    command = bench_command(model, study["bench"][name], path)
    return f"{model} {name}", path.exists(), command, path.with_suffix(".log"), None


def _kept(job_dir: Path | None) -> str:
    return f"{'finished' if job_dir else 'measured'} earlier, kept"


def _run_steps(study: dict, out: Path, steps: list[tuple[str, str, str, int | None]], repo: Path, record) -> None:
    """Run each step not finished earlier; `record(key, load)` keeps the host's load during each step that ran."""
    with Progress("study", len(steps)) as shown:
        for i, step in enumerate(steps, 1):
            what, done, command, log, job_dir = _step(study, out, step, repo)
            label = f"[{i}/{len(steps)}] {what}"
            if done:
                print(f"{label}: {_kept(job_dir)}", flush=True)
                shown.skip(label)
                continue
            model, _, name, repeat = step
            with (
                shown.job(what, lambda d=job_dir: run_step(d)) if job_dir else shown.job(what),
                host.LoadDuringStep() as load,
            ):
                _run_logged(command, log, label)
            record(definition.step_key(model, name, repeat), load.record)
            if job_dir:
                print(f"    {describe(job_dir)}", flush=True)


def _run_logged(command: list[str], log: Path, label: str) -> None:
    """Run one step of the study; on Ctrl-C it gets SIGINT (a sweep then records its job as interrupted)."""
    print(f"{label}: {shlex.join(command)}", flush=True)
    t0 = time.monotonic()
    log.unlink(missing_ok=True)
    # the sweep gets its job's grace and time to record it; a failed case is in its job.json
    code = processes.run(command, log, grace_s=definition.STOP_GRACE_S + 30, first_signal=signal.SIGINT)
    print(f"    exit {code} after {time.monotonic() - t0:.0f} s (log: {log})", flush=True)
