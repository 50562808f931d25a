"""Which of our settings a plain TRL run (bench/plain_trl.py) is given, in one place.

Our defaults are switches in conf/: the placement group's and `run`'s. Some of them become settings that TRL and
vLLM accept from any user: a `trl.GRPOConfig` field, vLLM's `SamplingParams` through `GRPOConfig.generation_kwargs`,
an environment variable vLLM reads. Plain TRL given our settings keeps those switches as composed, so that their
settings reach its GRPOConfig through the same code as ours (training/config.py, training/memory_plan.py,
training/build.py), whatever our defaults become; plain TRL at TRL's defaults has them off. The other switches
change TRL's own code (our GRPOTrainer subclass) and are off in every plain run. Every boolean switch of the
placement group and of `run` is in one of the three lists below (tests/test_bench_study.py), so that a new default
cannot reach ours and miss the plain baseline.

A plain case says which with `+plain_trl=trl_defaults` (TRL's defaults) or `+plain_trl=ours` (given our settings,
also what it gets without the key); its config.yaml records it.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf, open_dict

from colocated_grpo.training.config import ConfigError

KEY = "plain_trl"
OURS, TRL_DEFAULTS = "ours", "trl_defaults"
MODES = (OURS, TRL_DEFAULTS)

# Switches whose settings plain TRL accepts: each with its value at TRL's defaults; given our settings, as composed.
TRL_SETTINGS = {
    # GRPOConfig.gradient_checkpointing, chosen from memory before the model loads (TRL's default: on)
    "run.auto_memory": False,
    # GRPOConfig.generation_kwargs: SamplingParams(detokenize=False, flat_logprobs=True) (compat/vllm.py FAST_OUTPUTS).
    # TRL decodes the token ids itself, and its own parser reads flat log-probs as it reads per-token ones.
    "placement.fast_outputs": False,
    # vLLM's model runner v2 (VLLM_USE_V2_MODEL_RUNNER=1, an environment variable vLLM reads)
    "placement.model_runner_v2": False,
}
# Switches that change TRL's code: off in every plain run.
OUR_CODE = (
    "placement.fast_sync",  # our weight sync into the engine
    "placement.one_forward",  # the training forward's log-probs instead of TRL's extra no-grad forward
    "run.stop_on_nonfinite",  # our non-finite guard, a callback plain TRL does not have
    "run.pack_micro_batches",  # our packed forward (one row per micro-batch without padding)
    "run.balance_micro_batches",  # our regrouping of each optimizer step's micro-batches
    "placement.engine_process",  # the engine in a process of its own (placement=colocate_process): TRL's is in-process
    "placement.overlap",  # the next batch generated while this one trains
)
# The same in every case: the workload, and how the CPU engine is built (on a GPU it does nothing).
SAME_FOR_ALL = ("run.fixed_completion_length", "placement.cpu_eager")


def apply(cfg: DictConfig) -> str:
    """Set `cfg`'s switches as plain TRL gets them in the mode its `plain_trl` key names (`ours` where unset), and
    write the mode into it, so that config.yaml says what ran; returns the mode. A placement switch in none of the
    lists is off, as our code's are."""
    mode = cfg.get(KEY) or OURS
    if mode not in MODES:
        raise ConfigError([f"{KEY}={mode!r}: one of {', '.join(MODES)} (TRL's defaults, or given our settings)"])
    kept = set(SAME_FOR_ALL) | (set(TRL_SETTINGS) if mode == OURS else set())
    off = {**{key: False for key in OUR_CODE}, **(TRL_SETTINGS if mode == TRL_DEFAULTS else {})}
    for key, value in cfg.placement.items():
        if isinstance(value, bool) and f"placement.{key}" not in kept:
            off.setdefault(f"placement.{key}", False)
    with open_dict(cfg):
        cfg[KEY] = mode
        for key, value in off.items():
            if OmegaConf.select(cfg, key) is not None:  # a placement without the switch (none, server) keeps none
                OmegaConf.update(cfg, key, value)
    return mode
