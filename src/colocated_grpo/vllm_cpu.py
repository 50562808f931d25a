"""Make TRL's in-place weight sync reach vLLM's CPU engine.

On CPU, vLLM repacks every linear layer's weight for oneDNN after loading and drops the original parameter
(`dispatch_cpu_unquantized_gemm(remove_weight=True)`). TRL's colocated weight sync then fails
("'Parameter' object has no attribute 'weight_loader'"), and even where it does not fail the packed copy would
keep serving the old weights. Keeping plain `torch.nn.functional.linear` on the live parameter makes every sync
visible to the next generation. CUDA builds of vLLM are untouched.
"""

from __future__ import annotations


def keep_weights_syncable() -> None:
    import torch

    if torch.cuda.is_available():
        return
    from vllm.model_executor.layers import utils

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = plain_linear
