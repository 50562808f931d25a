"""Placement predictor: a calibration measured on one GPU (generation rate of one engine over batch sizes, train time
per token, weight-sync and sleep/wake cost) and an explicit per-phase model of a GRPO step, which predicts the step
time of each placement (colocate, colocate + sleep mode, server K+T) for N GPUs and a workload.

    python -m colocated_grpo.bench.placement calibrate STUDY_DIR… --out calibration.json
    python -m colocated_grpo.bench.placement predict --calibration FILE --gpus 8 --completions 1024 …
    python -m colocated_grpo.bench.placement validate --calibration FILE STUDY_OR_SWEEP_DIR…

The model and its limits: docs/placement.md."""
