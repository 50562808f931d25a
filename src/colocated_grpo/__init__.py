"""Colocated GRPO lab: TRL GRPO with vLLM co-located on the training GPUs, configured with Hydra."""

__version__ = "0.1.0"
