"""One step under torch.profiler (`telemetry.profile_step=K`): where the host and the GPU spend each phase of step K.
Every op is charged to the innermost phase that ran it (generate inside TRL's input preparation, `other`, inside the
training step, `train`); rank 0 writes profile/step_K.txt (per phase: wall time, GPU busy time, the ops that took the
most GPU time, else host time) and profile/step_K.trace.json.gz (a Chrome / Perfetto trace), and logs one line per
phase. Profiling slows the step it watches: leave that step out of timings (it is logged as usual)."""

from __future__ import annotations

import gzip
import logging
import shutil
from collections import defaultdict
from pathlib import Path

from transformers import TrainerCallback

log = logging.getLogger(__name__)

DIRECTORY = "profile"
LABEL = "phase:"
# TRL's methods whose calls mark a phase, outermost first (each runs inside the one before).
MARKED = (("train", "training_step"), ("other", "_prepare_inputs"), ("generate", "_generate"))
OTHER_THREADS = "outside the phases (other threads: the engine's, data loading)"
TOP_OPS = 15


class ProfileStep(TrainerCallback):
    """Profiles optimizer step `step` of `trainer`; rank 0 (`main`) writes the files into run_dir/profile."""

    def __init__(self, trainer, run_dir: Path, step: int, main: bool):
        self.step, self.dir, self.main = step, Path(run_dir) / DIRECTORY, main
        self.profiler = None
        for phase, method in MARKED:
            _label(trainer, method, phase)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 != self.step:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profiler = profile(activities=activities)
        self.profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        if not self.main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        phases = by_phase(profiler.events())
        text = report(self.step, phases)
        (self.dir / f"step_{self.step}.txt").write_text(text)
        trace = self.dir / f"step_{self.step}.trace.json"
        profiler.export_chrome_trace(str(trace))
        with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
        for line in text.splitlines():
            if line.startswith("phase "):
                log.info("profile of step %d: %s", self.step, line.removeprefix("phase "))
        log.info("profile of step %d: %s and %s.gz", self.step, self.dir / f"step_{self.step}.txt", trace)


def _label(trainer, method: str, phase: str) -> None:
    """Each call of trainer.`method` runs inside a profiler range named phase:`phase` (a no-op when not profiling)."""
    import functools

    from torch.profiler import record_function

    original = getattr(trainer, method)

    @functools.wraps(original)
    def labelled(*args, **kwargs):
        with record_function(LABEL + phase):
            return original(*args, **kwargs)

    setattr(trainer, method, labelled)


def _device_us(event) -> float:
    return float(getattr(event, "self_device_time_total", 0.0) or 0.0)


def by_phase(events) -> dict[str, dict]:
    """Per phase: its wall time (its own ranges, less the phases nested in them), the host and GPU time of the ops it
    ran itself, and those ops by name. Times in microseconds, as torch.profiler gives them."""
    phases: dict[str, dict] = defaultdict(lambda: {"wall_us": 0.0, "cpu_us": 0.0, "device_us": 0.0, "ops": {}})
    for event in events:
        if event.name.startswith(LABEL):
            inner = sum(c.cpu_time_total for c in event.cpu_children if c.name.startswith(LABEL))
            phases[event.name.removeprefix(LABEL)]["wall_us"] += event.cpu_time_total - inner
            continue
        phase = _innermost_phase(event)
        entry = phases[phase]
        entry["cpu_us"] += event.self_cpu_time_total
        entry["device_us"] += _device_us(event)
        op = entry["ops"].setdefault(event.name, [0, 0.0, 0.0])
        op[0] += 1
        op[1] += event.self_cpu_time_total
        op[2] += _device_us(event)
    return dict(phases)


def _innermost_phase(event) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(LABEL):
            return parent.name.removeprefix(LABEL)
        parent = parent.cpu_parent
    return OTHER_THREADS


def report(step: int, phases: dict[str, dict]) -> str:
    """The text of profile/step_K.txt: one `phase …` summary line per phase, then its top ops."""
    lines = [f"torch.profiler, step {step}: ops charged to the innermost phase that ran them (times in ms)", ""]
    marked = [phase for phase, _ in MARKED[::-1]]
    order = marked + [p for p in phases if p not in marked]
    for name in order:
        if name not in phases:
            continue
        p = phases[name]
        busy = f", GPU busy {p['device_us'] / 1e3:.1f} ms" if p["device_us"] else ""
        if p["device_us"] and p["wall_us"]:
            busy += f" ({100 * p['device_us'] / p['wall_us']:.0f} % of its wall time)"
        wall = f"wall {p['wall_us'] / 1e3:.1f} ms, " if p["wall_us"] else ""
        lines.append(f"phase {name}: {wall}host ops {p['cpu_us'] / 1e3:.1f} ms{busy}")
        key = 2 if p["device_us"] else 1
        top = sorted(p["ops"].items(), key=lambda item: item[1][key], reverse=True)[:TOP_OPS]
        lines.append(f"  {'op':<60} {'calls':>7} {'host ms':>9} {'GPU ms':>9}")
        lines += [f"  {op[:60]:<60} {n:>7} {cpu / 1e3:>9.2f} {dev / 1e3:>9.2f}" for op, (n, cpu, dev) in top]
        lines.append("")
    return "\n".join(lines)
