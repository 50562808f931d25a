"""Generation: the colocated vLLM engine and the weight sync into it. in_process.py, placement=colocate's engine in
the trainer's process (TRL's, with our batched sync and flat log-prob reader); engine_process.py, the engine of
placement=colocate_process in a process beside each trainer (its build and environment, the sync through CUDA IPC
handles on GPUs or one blob on CPU, and overlap: the next batch generated while this one trains); engine_worker.py,
what runs inside the engine's processes. The trainer that drives them is training/trainer.py."""
