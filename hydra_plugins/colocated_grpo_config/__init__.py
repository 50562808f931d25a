"""Hydra imports every module under hydra_plugins before composing: this registers the open config nodes that
conf/train.yaml lists (logic: colocated_grpo.training.open_keys)."""

from colocated_grpo.training import open_keys

open_keys.register()
