"""torch.load of a checkpoint onto an indexed CPU device: accelerate places each rank of a multi-process CPU run on
`cpu:<rank>`, and transformers resumes the optimizer's state with that device as map_location, which torch 2.11
(the pin) does not restore ("don't know how to restore data location ... (tagged with cpu:0)"). Written for
torch 2.11.0; later torch accepts the index itself."""

from __future__ import annotations

import functools

PRIORITY = 11  # after torch's own CPU entry (10), which takes "cpu" alone


@functools.cache  # once per process
def restore_indexed_cpu_locations() -> None:
    """Let torch.load restore storages onto "cpu:N" as onto "cpu" (the same memory); other locations are torch's."""
    import torch

    def tag(obj):
        return None  # saving is unchanged: this entry only restores

    def restore(obj, location: str):
        return obj if location.startswith("cpu:") else None

    torch.serialization.register_package(PRIORITY, tag, restore)
