"""A reward of weight 0 that sleeps in every call: steps slow enough for a test to signal a run between two of them,
without training more steps than the test reads.

Loaded with `+reward.modules=[slow_steps] +reward.weights.sleeps=0 +reward.params.sleeps.seconds=S`."""

import time

from colocated_grpo.training.rewards import register


@register
def sleeps(completions, seconds: float = 1.0, **_):
    time.sleep(seconds)
    return [0.0] * len(completions)
