"""Config nodes that take any key without Hydra's `+`: `trainer` (every trl.GRPOConfig field), `reward.weights` and
`reward.params`. Hydra closes the whole config before applying command-line overrides, so `trainer.top_p=0.9` would
be refused for a field our yaml does not list; a node whose own struct flag is false stays open. What such a key may
be (a GRPOConfig field of the right type, a registered reward, a parameter the reward takes) is checked by
config.validate, every problem at once, before anything loads."""

from __future__ import annotations

from omegaconf import OmegaConf

# Listed first in conf/train.yaml's defaults, so these nodes exist (open) before any group merges into them.
NAME = "open_keys"
OPEN = ("trainer", "reward.weights", "reward.params")


def register() -> None:
    from hydra.core.config_store import ConfigStore

    root = OmegaConf.create()
    for key in OPEN:
        OmegaConf.update(root, key, {}, force_add=True)
        OmegaConf.set_struct(OmegaConf.select(root, key), False)
    ConfigStore.instance().store(name=NAME, node=root, provider="colocated_grpo")
