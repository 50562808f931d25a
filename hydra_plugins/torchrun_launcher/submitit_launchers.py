"""`hydra/launcher=torchrun_slurm` (and `torchrun_submitit_local`): every sweep job is one SLURM job through
hydra-submitit-launcher, one task per node, each task starting `torchrun` with the multi-node rendezvous taken from
SLURM's environment. The work is done by colocated_grpo.launch. Registered only when hydra-submitit-launcher is
installed."""

from dataclasses import dataclass
from typing import Optional

from hydra.core.config_store import ConfigStore

from colocated_grpo.launch.sweep_plan import Options

try:
    from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
except ImportError:  # pragma: no cover - the plain torchrun launcher works without it
    BaseSubmititLauncher = None


@dataclass
class TorchrunTasks(Options):
    # GPUs per node; null: the job's parallelism.nproc_per_node
    gpus_per_node: Optional[int] = None
    # one task per node: it runs torchrun, which starts one process per GPU
    tasks_per_node: int = 1


if BaseSubmititLauncher is not None:

    class _TorchrunSubmititLauncher(BaseSubmititLauncher):
        def launch(self, job_overrides, initial_job_idx):
            from colocated_grpo.launch import sweep_slurm

            opts, params = Options.split(self.params)
            return sweep_slurm.launch_submitit(
                self._EXECUTOR,
                params,
                self.hydra_context,
                self.config,
                self.task_function,
                job_overrides,
                initial_job_idx,
                opts,
            )

    class TorchrunSlurmLauncher(_TorchrunSubmititLauncher):
        _EXECUTOR = "slurm"

    class TorchrunSubmititLocalLauncher(_TorchrunSubmititLauncher):
        _EXECUTOR = "local"

    @dataclass
    class TorchrunSlurmConf(TorchrunTasks, SlurmQueueConf):
        _target_: str = "hydra_plugins.torchrun_launcher.submitit_launchers.TorchrunSlurmLauncher"

    @dataclass
    class TorchrunSubmititLocalConf(TorchrunTasks, LocalQueueConf):
        _target_: str = "hydra_plugins.torchrun_launcher.submitit_launchers.TorchrunSubmititLocalLauncher"

    for name, node in (("torchrun_slurm", TorchrunSlurmConf), ("torchrun_submitit_local", TorchrunSubmititLocalConf)):
        ConfigStore.instance().store(group="hydra/launcher", name=name, node=node, provider="colocated_grpo")
