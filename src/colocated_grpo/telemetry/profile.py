"""One step under torch.profiler (`telemetry.profile_step=K`): where the host and the GPU spend each phase of step K.
Every op and kernel is charged to the innermost phase running when it started (generate inside TRL's input
preparation, `other`, inside the training step, `train`), whichever thread ran it; rank 0 writes profile/step_K.txt
(per phase: wall time, host time of its ops, GPU busy time, the kernels and the host ops that took the most) and
profile/step_K.trace.json.gz (a Chrome / Perfetto trace), and logs one line per phase. Profiling slows the step it
watches: leave that step out of timings (it is logged as usual)."""

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
# The phases whose calls run in profiler ranges (TimedGRPOTrainer.profile_label), outermost first: TRL's
# training_step, _prepare_inputs and _generate, each running inside the one before.
MARKED = ("train", "other", "generate")
OUTSIDE = "outside the phases"
TOP_OPS = 12
IDLE_GAP_US = 1000.0  # the GPU idle between two kernels for longer than this counts as waiting for the host


class ProfileStep(TrainerCallback):
    """Profiles optimizer step `step` of `trainer`; rank 0 (`main`) writes the files into run_dir/profile."""

    def __init__(self, trainer, run_dir: Path, step: int, main: bool):
        self.step, self.dir, self.main = step, Path(run_dir) / DIRECTORY, main
        self.profiler = None
        trainer.profile_label = LABEL  # compat.grpo_trainer.TimedGRPOTrainer and its subclasses

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


def by_phase(events) -> dict[str, dict]:
    """Per phase: its wall time (its own ranges, less the phases nested in them), the host time of the ops and the GPU
    time of the kernels (merged, so that overlapping streams count once) that ran in it, and both by name. An event
    belongs to the innermost phase range its start falls in, whatever thread ran it (autograd's backward thread, the
    engine's) and on the GPU's clock for kernels; times in microseconds, as torch.profiler gives them."""
    from torch.autograd import DeviceType

    labels = [e for e in events if e.name.startswith(LABEL)]
    ranges = sorted(
        ((e.time_range.start, e.time_range.end, e.name.removeprefix(LABEL)) for e in labels),
        key=lambda r: r[1] - r[0],  # the shortest first: the first range that holds a moment is the innermost
    )
    phases: dict[str, dict] = defaultdict(lambda: {"wall_us": 0.0, "cpu_us": 0.0, "device_us": 0.0, "ops": {}})
    kernels: dict[str, list] = defaultdict(list)
    for event in events:
        if event.name.startswith(LABEL):
            inner = sum(c.cpu_time_total for c in event.cpu_children if c.name.startswith(LABEL))
            phases[event.name.removeprefix(LABEL)]["wall_us"] += event.cpu_time_total - inner
            continue
        start = event.time_range.start
        phase = next((name for low, high, name in ranges if low <= start < high), OUTSIDE)
        on_device = event.device_type != DeviceType.CPU
        host, device = (0.0, event.time_range.elapsed_us()) if on_device else (event.self_cpu_time_total, 0.0)
        op = phases[phase]["ops"].setdefault(event.name, [0, 0.0, 0.0])
        op[0] += 1
        op[1] += host
        op[2] += device
        phases[phase]["cpu_us"] += host
        if on_device:
            kernels[phase].append((start, event.time_range.end))
    for phase, spans in kernels.items():
        phases[phase]["device_us"], phases[phase]["idle_gaps_us"] = _merged_us(spans)
    return dict(phases)


def _merged_us(spans: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """The time some kernel ran, and the gaps of over IDLE_GAP_US between one kernel's end and the next one's start:
    where a host-bound phase leaves the GPU waiting."""
    total, end, gaps = 0.0, None, []
    for low, high in sorted(spans):
        if end is not None and low - end > IDLE_GAP_US:
            gaps.append(low - end)
        total += max(0.0, high - max(low, end if end is not None else low))
        end = high if end is None else max(end, high)
    return total, gaps


def report(step: int, phases: dict[str, dict]) -> str:
    """The text of profile/step_K.txt: one `phase …` summary line per phase, then its top ops."""
    lines = [f"torch.profiler, step {step}: ops charged to the innermost phase that ran them (times in ms)", ""]
    # the marked phases innermost first, then the rest
    for name in [*(m for m in MARKED[::-1] if m in phases), *(p for p in phases if p not in MARKED)]:
        p = phases[name]
        busy = f", GPU busy {p['device_us'] / 1e3:.1f} ms" if p["device_us"] else ""
        if p["device_us"] and p["wall_us"]:
            busy += f" ({100 * p['device_us'] / p['wall_us']:.0f} % of its wall time)"
        wall = f"wall {p['wall_us'] / 1e3:.1f} ms, " if p["wall_us"] else ""
        if gaps := sorted(p.get("idle_gaps_us", [])):
            busy += (
                f"; GPU idle between kernels {len(gaps)} times over {IDLE_GAP_US / 1e3:.0f} ms (median "
                f"{gaps[len(gaps) // 2] / 1e3:.1f} ms, {sum(gaps) / 1e3:.1f} ms in all)"
            )
        lines.append(f"phase {name}: {wall}host ops {p['cpu_us'] / 1e3:.1f} ms{busy}")
        for title, column in (("GPU ms", 2), ("host ms", 1)):
            top = sorted(p["ops"].items(), key=lambda item: item[1][column], reverse=True)[:TOP_OPS]
            top = [(op_name, op) for op_name, op in top if op[column] > 0]
            if top:
                lines.append(f"  {'by ' + title:<70} {'calls':>7} {title:>9}")
                lines += [f"  {op_name[:70]:<70} {op[0]:>7} {op[column] / 1e3:>9.2f}" for op_name, op in top]
        lines.append("")
    return "\n".join(lines)
