"""Hydra launchers that run every sweep job as a fresh `torchrun` (logic: colocated_grpo.launch)."""
