"""placement=colocate's engine, in the trainer's process (TRL's `external_launcher` engine), with our changes to
TRL's engine wrapper: the colocated weight sync batched into one `load_weights` call (or one per chunk of FSDP2's
gathered weights), and the flat log-prob reader. ColocatedGRPOTrainer (training/trainer.py) turns each on where it
applies; generation/engine_process.py builds on it for the engine in a process of its own."""

from __future__ import annotations

from colocated_grpo.compat import trl as trl_internals
from colocated_grpo.compat.grpo_trainer import TimedVLLMGeneration, in_phase, vllm_generation

# Weight sync: TRL's VLLMGeneration.sync_weights calls the engine model's `load_weights([(name, tensor)])` once per
# tensor, and each call walks every module of the model: tensors × modules of Python work per sync. The same tensors
# in one call (or a few, where FSDP2 gathers them) land the same weights in a fraction of the time.


def fast_sync_plan(generation) -> str | None:
    """How the colocated weight sync can be batched: "one_call" (DDP, one process), "chunked" (FSDP2: full tensors
    gathered one by one, loaded in chunks), or None to keep TRL's own sync: server mode, ZeRO-3 and FSDP1 (views valid
    only inside a gather) and PEFT (adapters unmerged before a batched call would read the merged weights)."""
    from accelerate.utils import is_peft_model

    if getattr(generation, "mode", None) != "colocate" or not hasattr(generation, "_iter_named_params"):
        return None
    dist = getattr(generation, "_dist", None)
    if dist is None or dist.is_zero3 or dist.fsdp_version == 1 or is_peft_model(generation.model):
        return None
    return "chunked" if dist.fsdp_version == 2 else "one_call"


class ColocatedVLLMGeneration(TimedVLLMGeneration):
    """The engine wrapper whose colocated sync loads the weights in one load_weights call, or one per chunk, and
    whose outputs are read by the flat log-prob reader."""

    batched_sync = False  # set by ColocatedGRPOTrainer where fast_sync_plan allows it
    sync_chunk_bytes: int | None = None  # None: one call
    flat_logprobs = False  # set by ColocatedGRPOTrainer where the request asks for flat log-probs

    def generate(self, *args, **kwargs):
        if not self.flat_logprobs:
            return super().generate(*args, **kwargs)
        # TRL's generate calls its module's extract_logprobs by name: our reader stands in for this call only
        original = vllm_generation.extract_logprobs

        def read(outputs):
            return trl_internals.read_flat_logprobs(outputs, fallback=original)

        vllm_generation.extract_logprobs = read
        try:
            return super().generate(*args, **kwargs)
        finally:
            vllm_generation.extract_logprobs = original

    def sync_weights(self):  # GRPOTrainer's sync before generation, and generate's re-sync of weights asleep
        if not self.batched_sync:
            return super().sync_weights()
        with in_phase(self.phase_tracker, "sync_weights"):
            if self.enable_sleep_mode:  # as TRL: map the weights back in before writing into them
                vllm_generation.empty_cache()
                self.llm.wake_up(tags=["weights"])
                self._llm_weights_sleeping = False
            load = self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights  # as TRL's
            pending, size = [], 0
            # TRL's own iterator: its name fixes, and FSDP2's full_tensor() gathers (collectives: every rank iterates)
            for name, tensor in self._iter_named_params():
                pending.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
                if self.sync_chunk_bytes is not None and size >= self.sync_chunk_bytes:
                    load(pending)
                    pending, size = [], 0
            if pending:
                load(pending)
            del pending  # FSDP2's gathered copies go before generation
            self.llm.reset_prefix_cache()  # as TRL: cached KV was computed with the old weights
