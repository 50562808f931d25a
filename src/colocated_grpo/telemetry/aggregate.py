"""Every rank's phase marks, GPU samples and token counts of one step → the logged metrics (pure functions of
recorded data: tested on CPU)."""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

from colocated_grpo.run_files import STEP_KEY
from colocated_grpo.telemetry.nvml import Sample
from colocated_grpo.telemetry.phases import PHASES, Segment, StepPhases

IDLE_UTIL = 5.0  # a sample below this utilisation (%) counts as idle in gpu/idle_frac


@dataclass
class RankReport:
    """What one rank measured in one step; gathered to rank 0."""

    rank: int
    phases: StepPhases
    samples: list[Sample] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    completion_lengths: list[int] = field(default_factory=list)  # each completion's tokens, where counted

    @cached_property
    def labelled(self) -> list[tuple[Sample, str]]:
        """The samples with the phase each was taken in; computed once on rank 0 for the metrics and the files."""
        return label_samples(self.samples, self.phases.segments)


def label_samples(samples: list[Sample], segments: list[Segment]) -> list[tuple[Sample, str]]:
    """Pair each sample with the phase running when it was taken (samples outside every segment are dropped)."""
    starts = [s.start for s in segments]
    labelled = []
    for sample in samples:
        i = bisect.bisect_right(starts, sample.t) - 1
        if i >= 0 and sample.t <= segments[i].end:
            labelled.append((sample, segments[i].phase))
    return labelled


def _mean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def step_metrics(
    reports: list[RankReport], n_params: int | None = None, peak_tflops_per_gpu: float | None = None
) -> dict[str, float]:
    """Metrics of one step from all ranks' reports (names: the metrics table of docs/telemetry.md)."""
    step_s = _mean(r.phases.duration for r in reports)
    metrics = {"timing_s/step": step_s}
    per_rank = [r.phases.durations() for r in reports]
    metrics.update({f"timing_s/{phase}": _mean(d[phase] for d in per_rank) for phase in PHASES})

    gpus = {s.gpu for r in reports for s in r.samples}
    n_gpus = len(gpus) or len(reports)  # every GPU sampled, a vLLM server's included; without GPUs: per process
    metrics["placement/gpus"] = float(n_gpus)
    prompt = sum(r.prompt_tokens for r in reports)
    completion = sum(r.completion_tokens for r in reports)
    metrics["perf/tokens"] = float(prompt + completion)
    if step_s > 0 and prompt + completion:  # none for a step that reuses a generation (trainer.num_iterations > 1)
        metrics["perf/tokens_per_s"] = (prompt + completion) / step_s
        metrics["perf/tokens_per_s_per_gpu"] = metrics["perf/tokens_per_s"] / n_gpus  # every GPU used
        # per training GPU: how the server-vs-colocate comparisons usually scale server mode (N / (N - K))
        metrics["perf/tokens_per_s_per_train_gpu"] = metrics["perf/tokens_per_s"] / len(reports)
    if metrics["timing_s/generate"] > 0:
        metrics["perf/gen_tokens_per_s"] = completion / metrics["timing_s/generate"]
    if lengths := sorted(n for r in reports for n in r.completion_lengths):  # beside TRL's completions/mean_length, …
        metrics["completions/p50_length"] = float(percentile(lengths, 50))
        metrics["completions/p99_length"] = float(percentile(lengths, 99))
    if n_params and peak_tflops_per_gpu and "perf/tokens_per_s" in metrics:
        # Training FLOPs only (forward + backward ≈ 6 · params · tokens); generation is not counted.
        flops = 6 * n_params * (prompt + completion)
        metrics["perf/mfu"] = flops / (step_s * peak_tflops_per_gpu * 1e12 * n_gpus)
        if metrics["timing_s/train"] > 0:  # the train phase alone, on the training GPUs; recomputation not counted
            metrics["perf/train_mfu"] = flops / (metrics["timing_s/train"] * peak_tflops_per_gpu * 1e12 * len(reports))

    if gpus:
        metrics.update(_gpu_metrics(reports))
    return metrics


def percentile(ordered: list, q: float):
    """The nearest-rank `q`th percentile of a sorted, non-empty list: the smallest value that at least q % of them do
    not exceed."""
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def _gpu_metrics(reports: list[RankReport]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    by_gpu: dict[str, list[Sample]] = defaultdict(list)
    by_phase: dict[str, list[float]] = defaultdict(list)
    for r in reports:
        for s in r.samples:
            by_gpu[s.gpu].append(s)
        for s, phase in r.labelled:
            by_phase[phase].append(s.util)
    for gpu, samples in sorted(by_gpu.items()):
        for name in ("util", "mem_gb", "power_w", "sm_clock_mhz"):
            metrics[f"gpu/{gpu}/{name}"] = _mean(getattr(s, name) for s in samples)
    metrics.update({f"gpu/util_{phase}": _mean(by_phase[phase]) for phase in PHASES if by_phase[phase]})
    all_samples = [s for samples in by_gpu.values() for s in samples]
    metrics["gpu/idle_frac"] = sum(s.util < IDLE_UTIL for s in all_samples) / len(all_samples)
    metrics["gpu/samples"] = float(len(all_samples))
    metrics["memory/peak_gb"] = max(s.mem_gb for s in all_samples)
    return metrics


class SteadyState:
    """Running means of every numeric metric over the steps after each attempt's first `warmup_steps` (all steps
    while none are left). `starts`: the step each attempt started from (0, then each resume's checkpoint step)."""

    def __init__(self, warmup_steps: int, starts=(0,)):
        self.warmup_steps = warmup_steps
        self.starts = sorted({0, *starts})
        self._all = _Means()
        self._steady = _Means()
        self._reward = None  # the latest step's that has one: a step that reuses a generation logs none

    def add(self, record: dict) -> None:
        step = record.get(STEP_KEY, 0)
        start = self._start(step)
        self._all.add(record, start)
        if self.past_warmup(step):
            self._steady.add(record, start)
        self._reward = record.get("reward", self._reward)

    def past_warmup(self, step: int) -> bool:
        """Whether `step` counts in the steady state: past the warm-up of the attempt it belongs to."""
        return step - self._start(step) > self.warmup_steps

    def _start(self, step: int) -> int:
        """The start of the attempt that trained `step`."""
        return self.starts[bisect.bisect_left(self.starts, step) - 1] if step > 0 else 0

    def summary(self) -> dict[str, float]:
        means = self._steady if self._steady.records else self._all
        summary = means.means()
        summary["steady_state/steps"] = means.records
        summary["steady_state/warmup_steps"] = self.warmup_steps
        summary["steady_state/attempts"] = len(means.starts)  # attempts whose steps are in the means
        if self._reward is not None:
            summary["final/reward"] = self._reward
        return summary


class _Means:
    def __init__(self):
        self.records = 0
        self.starts: set[int] = set()  # the attempts averaged, by the step each started from
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, record: dict, start: int) -> None:
        self.records += 1
        self.starts.add(start)
        for key, value in record.items():
            if key == STEP_KEY or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            self.counts[key] += 0  # a metric that is always NaN still gets a (NaN) mean
            if not math.isnan(value):
                self.sums[key] += value
                self.counts[key] += 1

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / n if n else float("nan") for k, n in sorted(self.counts.items())}
