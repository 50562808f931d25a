"""An example reward module: rewards of your own, used by configuration alone.

    PYTHONPATH=examples python train.py reward.modules=[my_rewards] \\
        reward.weights.mentions=1.0 reward.params.mentions.word=because

A reward takes the completions (plain text) first and returns one score per completion: a finite float, or None
where it does not apply. Its keyword parameters with a default can be set in `reward.params.<reward>.<name>`; a
parameter without a default names a dataset column that TRL passes (`answer`, or any column your dataset has), and the
checks before a run refuse a dataset without it. It must also take **kwargs: TRL passes every column and extras such
as `trainer_state` and `completion_ids` (the completion's token ids).
"""

from __future__ import annotations

from colocated_grpo.training.rewards import register


@register
def mentions(completions: list[str], word: str = "because", **kwargs) -> list[float]:
    """1.0 when the completion contains `word` (any case), else 0.0. Needs no dataset column."""
    return [float(word.lower() in text.lower()) for text in completions]


@register
def answer_first(completions: list[str], answer: list[str | None], **kwargs) -> list[float | None]:
    """1.0 when the completion starts with the reference answer; None for rows without one. Needs `answer` (set
    data.answer_column to the column holding it)."""
    return [
        None if gold is None else float(text.strip().startswith(str(gold)))
        for text, gold in zip(completions, answer, strict=True)
    ]
