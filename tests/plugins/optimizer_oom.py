"""A reward of weight 0 that makes the optimizer step of step `at_step` raise torch's out-of-memory error with the
message a CUDA GPU gives (CPU memory never runs out this way): for the test of what a run that does not fit says.

Loaded with `+reward.modules=[optimizer_oom] +reward.weights.oom=0 +reward.params.oom.at_step=K`."""

import torch

from colocated_grpo.training.rewards import register

# torch's CUDA caching allocator's message, as an H200 beside a colocated engine printed it
MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 1.23 GiB is "
    "free. Including non-PyTorch memory, this process has 138.55 GiB memory in use. Of the allocated memory 95.20 GiB "
    "is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch but unallocated."
)


@register
def oom(completions, log_metric, at_step: int = 1, **_):
    trainer = log_metric.__self__  # TRL passes its own bound method
    optimizer = trainer.optimizer
    if not getattr(optimizer, "oom_installed", False):  # torch's LR scheduler wraps `step` on the instance too
        optimizer.oom_installed, step = True, optimizer.step

        def step_or_oom(*args, **kwargs):  # the optimizer step of step s runs at global_step s - 1
            if trainer.state.global_step == at_step - 1:
                raise torch.OutOfMemoryError(MESSAGE)
            return step(*args, **kwargs)

        optimizer.step = step_or_oom
    return [0.0] * len(completions)
