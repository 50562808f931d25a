"""A reward of weight 0 that turns the weight sync into a no-op from step `from_step` on, on every rank: the negative
control of the tests that show weights reach the engine (their check must fail on the steps without the sync).

Loaded with `+reward.modules=[weight_sync_off] +reward.weights.sync_off=0 +reward.params.sync_off.from_step=K`
(conftest.sync_off_from(K)). The engine model's `load_weights` is what every sync ends in (TRL's per-tensor loop,
the one-call and chunked syncs of placement.fast_sync, ZeRO-3's gathered and PEFT's merged weights), or, with the
engine in its own process (placement=colocate_process), the worker call that loads them: from step K on it loads
nothing, so the engine keeps generating with the weights of step K - 2. It is replaced at the first reward
call of a process, after the attempt's first sync: a resumed run's engine still gets its checkpoint's weights.
"""

from colocated_grpo.training.rewards import register


@register
def sync_off(completions, log_metric, from_step: int = 0, **_):
    # imported here, not with the module: a run refused before anything loads imports its reward modules
    from colocated_grpo.generation.engine_process import EngineProcessGeneration

    trainer = log_metric.__self__  # TRL passes its own bound method: the trainer whose engine this is
    llm = trainer.vllm_generation.llm
    if isinstance(trainer.vllm_generation, EngineProcessGeneration):
        if from_step and "collective_rpc" not in vars(llm):
            call = llm.collective_rpc

            def collective_rpc(method, *args, **kwargs):
                # load_policy_weights (a blob, on CPU) or load_policy_weights_from_handles (CUDA IPC handles)
                if method.startswith("load_policy_weights") and trainer.state.global_step >= from_step - 1:
                    return None
                return call(method, *args, **kwargs)

            llm.collective_rpc = collective_rpc
        return [0.0] * len(completions)
    model = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model  # as TRL reaches it
    if from_step and "load_weights" not in vars(model):
        load = model.load_weights

        def load_weights(weights):  # the sync before step s runs at global_step s - 1
            return load(weights) if trainer.state.global_step < from_step - 1 else None

        model.load_weights = load_weights
    return [0.0] * len(completions)
