"""Phase marks: which part of a GRPO step each moment of wall-clock time belongs to. Phases nest (sync_weights
inside generate inside TRL's training_step); time goes to the innermost open phase, else to `other`, so each step's
segments cover it exactly and the phase durations add up to the step time."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("generate", "sync_weights", "sleep_wake", "reward", "train", "other")


@dataclass
class Segment:
    start: float
    end: float
    phase: str


@dataclass
class StepPhases:
    start: float
    end: float
    segments: list[Segment] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def durations(self) -> dict[str, float]:
        out = dict.fromkeys(PHASES, 0.0)
        for s in self.segments:
            out[s.phase] += s.end - s.start
        return out


class PhaseTracker:
    """Marks phase edges with `clock()`; `barrier()` (e.g. torch.cuda.synchronize) runs at every edge so that
    asynchronous device work is charged to the phase that queued it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, barrier: Callable[[], None] | None = None):
        self.clock, self.barrier = clock, barrier
        self._stack: list[str] = []
        self._segments: list[Segment] = []
        self._step_start: float | None = None
        self._mark = 0.0
        self.barrier_s = 0.0  # time spent waiting in barriers: the cost of accurate edges

    def _now(self) -> float:
        if self.barrier is not None:
            t0 = self.clock()
            self.barrier()
            self.barrier_s += self.clock() - t0
        return self.clock()

    def _close_segment(self, now: float) -> None:
        if self._step_start is not None and now > self._mark:
            self._segments.append(Segment(self._mark, now, self._stack[-1] if self._stack else "other"))
        self._mark = now

    def begin_step(self) -> None:
        self._segments, self._step_start = [], self._now()
        self._mark = self._step_start

    def end_step(self) -> StepPhases | None:
        if self._step_start is None:
            return None
        now = self._now()
        self._close_segment(now)
        step = StepPhases(self._step_start, now, self._segments)
        self._segments, self._step_start = [], None
        return step

    def enter(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        self._close_segment(self._now())
        self._stack.append(phase)

    def exit(self, phase: str) -> None:
        self._close_segment(self._now())
        if self._stack and self._stack[-1] == phase:
            self._stack.pop()

    @contextmanager
    def phase(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.exit(name)


class TokenCounter:
    """Prompt and completion tokens generated since the last reset (one step's), and each completion's length where
    they are counted sequence by sequence (`count`)."""

    def __init__(self):
        self.prompt = self.completion = 0
        self.lengths: list[int] = []

    def count(self, prompt_ids, completion_ids) -> None:
        """One generation's prompts and completions, as token ids per sequence."""
        lengths = [len(ids) for ids in completion_ids]
        self.prompt += sum(len(ids) for ids in prompt_ids)
        self.completion += sum(lengths)
        self.lengths += lengths

    def reset(self) -> tuple[int, int]:
        counts = (self.prompt, self.completion)
        self.prompt = self.completion = 0
        self.lengths = []
        return counts
