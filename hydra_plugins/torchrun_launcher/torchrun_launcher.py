"""`hydra/launcher=torchrun`: every sweep job is its own `torchrun --nproc_per_node=N train.py …` on this machine,
one after another, N being the job's `parallelism.nproc_per_node`. The work is done by colocated_grpo.launch; the
options (script, torchrun_args, stop_grace_s, log_tail_lines, dry_run) are colocated_grpo.launch.sweep_plan.Options."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra.plugins.launcher import Launcher

from colocated_grpo.launch.sweep_plan import Options


@dataclass
class TorchrunLauncherConf(Options):
    _target_: str = "hydra_plugins.torchrun_launcher.torchrun_launcher.TorchrunLauncher"


ConfigStore.instance().store(
    group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf, provider="colocated_grpo"
)


class TorchrunLauncher(Launcher):
    def __init__(self, **options) -> None:
        self.options = Options(**options)
        self.config = self.hydra_context = self.task_function = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides, initial_job_idx):
        from colocated_grpo.launch import sweep_local

        return sweep_local.launch_local(
            self.hydra_context, self.config, self.task_function, job_overrides, initial_job_idx, self.options
        )
