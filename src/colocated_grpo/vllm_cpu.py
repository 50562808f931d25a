"""Make TRL's in-place weight sync reach vLLM's CPU engine.

On CPU, vLLM repacks every linear layer's weight for oneDNN after loading and drops the original parameter
(`dispatch_cpu_unquantized_gemm(remove_weight=True)`). TRL's colocated weight sync then fails
("'Parameter' object has no attribute 'weight_loader'"), and even where it does not fail the packed copy would
keep serving the old weights. Keeping plain `torch.nn.functional.linear` on the live parameter makes every sync
visible to the next generation.

Second, under torchrun (`external_launcher`) every CPU engine names its tensor-parallel shared-memory segment
after "env://", so two TP runs on one machine collide ("create shm in SHMManager failed. errno: 17"); the
rendezvous port makes the name unique per job. CUDA builds of vLLM are untouched.
"""

from __future__ import annotations

import os


def prepare() -> None:
    import torch

    if torch.cuda.is_available():
        return
    from vllm.distributed.device_communicators import cpu_communicator
    from vllm.model_executor.layers import utils

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = plain_linear

    shm = cpu_communicator._CPUSHMDistributed
    shared_name = shm.make_group_name

    def per_job_name(communicator) -> str:
        os.environ["VLLM_DIST_IDENT"] = f"job{os.environ.get('MASTER_PORT', '')}"
        return shared_name(communicator)

    shm.make_group_name = staticmethod(per_job_name)
