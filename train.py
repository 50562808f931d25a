"""Entry point: compose the Hydra config and run colocated GRPO. All logic lives in `colocated_grpo`."""

import sys

import hydra
from omegaconf import DictConfig

from colocated_grpo.launch import config_groups
from colocated_grpo.resilience import signals

config_groups.register_run_start()  # ${run_start:…} in conf/train.yaml: one run directory for all ranks


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from colocated_grpo.launch.lifecycle import main as run  # torch and the rest load once the config's checks pass

    run(cfg)


# vLLM spawns worker processes that re-import this module: the guard keeps them from re-running training.
if __name__ == "__main__":
    config_groups.refuse_renamed_groups(sys.argv[1:])  # a group's old name: one line naming the new, before Hydra
    signals.run_main(main)  # SIGTERM in start-up exits 143 saying so, as Ctrl-C exits 130
