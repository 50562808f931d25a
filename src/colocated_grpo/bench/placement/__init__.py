"""Placement predictor: a per-phase model of the GRPO step, calibrated on one GPU, that predicts the step time of each
placement on N GPUs (`python -m colocated_grpo.bench.placement calibrate|predict|validate`; docs/placement.md)."""
