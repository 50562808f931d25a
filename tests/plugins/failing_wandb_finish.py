"""W&B's finish raising, as a dropped connection or a full disk can make it: for the tests of a run's ending.

Loaded by `+reward.modules=[failing_wandb_finish]` (it registers no reward; importing it is the change)."""

import wandb


def _finish(self, *args, **kwargs):
    raise RuntimeError("W&B's finish failed (tests/plugins/failing_wandb_finish.py)")


wandb.Run.finish = _finish
