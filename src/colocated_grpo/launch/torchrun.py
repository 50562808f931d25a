"""`python -m colocated_grpo.launch.torchrun ARGS…` is `torchrun ARGS…` with two differences, on every torch:

- after a stop signal its agent gives the workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to finish their step and
  save, where torch 2.11 reads no such setting and always gives 30 s (torch 2.12 and later read it too, or take
  `--shutdown_timeout` instead: the larger of that and the variable then holds);
- after that stop it exits 128 + the signal (143 for SIGTERM) with one line, not 1 with torch's traceback
  (signals.torchrun_agent).

Every torchrun this project starts is this one (processes.torchrun_command)."""

from __future__ import annotations

import os
import sys

from colocated_grpo.compat.torch_elastic import honour_shutdown_timeout
from colocated_grpo.launch import processes
from colocated_grpo.resilience import signals


def main() -> int:
    from torch.distributed import run

    honour_shutdown_timeout(processes.shutdown_timeout(os.environ))
    return signals.torchrun_agent(run.main)


if __name__ == "__main__":
    sys.exit(main())
