"""The config node conf/train.yaml lists first (`schema`), registered in Hydra's ConfigStore when Hydra imports
hydra_plugins, before it composes. Every group then merges into it:
- `trainer` (every trl.GRPOConfig field), `reward.weights` and `reward.params` take any key without `+`: Hydra
  closes the whole config before applying command-line overrides, and a node whose own struct flag is false stays
  open. What such a key may be is checked by config.validate, every problem at once, before anything loads.
- `run` and `telemetry` are typed: a value of the wrong type (`run.cpu_kvcache_gb=abc`) or a key they do not have
  (unless added with `+`, as Hydra allows anywhere) is refused as Hydra composes, naming the key. The values
  themselves are in conf/ (MISSING here: no second copy).
"""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

OPEN = ("trainer", "reward.weights", "reward.params")


@dataclass
class Run:
    name: str = MISSING
    cache_dir: str = MISSING
    cpu_kvcache_gb: float = MISSING  # GiB; vLLM takes it in bytes, so fractions too
    resume: str = MISSING  # one of checkpoints.RESUME_MODES, checked by config.validate
    stop_on_nonfinite: bool = MISSING
    fixed_completion_length: bool = MISSING
    length_profile: str | None = MISSING  # one of training.lengths.PROFILES, checked by config.validate
    auto_memory: bool = MISSING
    pack_micro_batches: bool = MISSING
    balance_micro_batches: bool = MISSING


@dataclass
class Telemetry:
    enabled: bool = MISSING
    interval_s: float = MISSING
    warmup_steps: int = MISSING
    sync_cuda: bool = MISSING
    peak_tflops: float | None = MISSING
    profile_step: int | None = MISSING


root = OmegaConf.create({"trainer": {}, "reward": {"weights": {}, "params": {}}})
for key in OPEN:
    OmegaConf.set_struct(OmegaConf.select(root, key), False)
root.run, root.telemetry = OmegaConf.structured(Run), OmegaConf.structured(Telemetry)  # typed and closed
ConfigStore.instance().store(name="schema", node=root, provider="colocated_grpo")
