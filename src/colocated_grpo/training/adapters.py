"""The `peft` group → the adapter config that TRL's GRPOTrainer(peft_config=…) receives; None trains the whole
model. TRL wraps the model with it, merges the adapters for each vLLM sync and unmerges after."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

# peft.name → the peft config class it builds.
CONFIG_CLASSES = {"lora": "LoraConfig"}


def name(cfg: DictConfig) -> str:
    """The adapter kind of this config; `none` also for configs written before the group existed."""
    return str(OmegaConf.select(cfg, "peft.name", default="none"))


def options(cfg: DictConfig) -> dict:
    """The peft config's keyword arguments: every key of the group but `name`."""
    node = OmegaConf.to_container(cfg.peft, resolve=True)
    return {k: v for k, v in node.items() if k != "name"}


def peft_config(cfg: DictConfig):
    """peft.LoraConfig(task_type="CAUSAL_LM", **options) for peft=lora; None for peft=none."""
    kind = name(cfg)
    if kind == "none":
        return None
    import peft

    return getattr(peft, CONFIG_CLASSES[kind])(**{"task_type": "CAUSAL_LM", **options(cfg)})
