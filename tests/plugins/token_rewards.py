"""A reward that varies with the sampled tokens themselves, so that even a random-weight model gets advantages that
are not all zero and its policy moves every step (tests that check the weight sync need a moving policy).

Loaded by runs that put this directory on PYTHONPATH (the tests' runs do) and set `+reward.modules=[token_rewards]`.
"""

from colocated_grpo.training.rewards import register


@register
def even_token_share(completions, completion_ids=None, **_):
    """The share of even token ids in each completion."""
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]
