"""Records rank 0's sampled completions per step in rollouts.jsonl (to read what the policy wrote, and to
check that seeds replicate)."""

from __future__ import annotations

import functools
from pathlib import Path

from colocated_grpo import run_files
from colocated_grpo.run_files import STEP_KEY, JsonlWriter
from colocated_grpo.training.rewards import completion_text


def recording(reward_fn, run_dir: Path):
    """Wrap a TRL reward function so that each call also appends its prompts and completions to the run files."""
    writer = JsonlWriter(run_dir / run_files.ROLLOUTS)

    @functools.wraps(reward_fn)
    def reward(prompts, completions, **columns):
        scores = reward_fn(prompts, completions, **columns)
        state = columns.get("trainer_state")
        writer.write(
            {
                # TRL computes rewards before it counts the step: these are the rollouts of step global_step + 1
                STEP_KEY: state.global_step + 1 if state is not None else None,
                "prompts": [p if isinstance(p, str) else p[-1]["content"] for p in prompts],
                "completions": [completion_text(c) for c in completions],
                reward_fn.__name__: scores,
            }
        )
        return scores

    return reward
