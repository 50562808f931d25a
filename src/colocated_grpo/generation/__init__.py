"""Generation in an engine of its own: placement=colocate_process's vLLM engine in a process beside each trainer, the
weight sync into it (CUDA IPC handles on GPUs, one blob on CPU) and overlap (the next batch generated while this one
trains). engine_process.py is the trainer's side, engine_worker.py what runs inside the engine's processes. The
in-process engine (placement=colocate, TRL's own) keeps its timed and batched sync in compat/grpo_trainer.py, beside
the TRL subclass that builds it."""
