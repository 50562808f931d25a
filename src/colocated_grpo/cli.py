"""`colocated-grpo COMMAND …`: the project's tools under one command (training itself is `python train.py`).

Each command is a module's own `main`, so `python -m colocated_grpo.…` runs the same thing; `colocated-grpo
COMMAND --help` prints that command's options. Commands that run training (study run, bench-telemetry) need a
checkout's train.py and conf/: run them from the checkout, or set COLOCATED_GRPO_CHECKOUT.
"""

from __future__ import annotations

import importlib
import sys

# command: (module whose main(argv) runs it, arguments put first, what it does)
COMMANDS = {
    "summary": ("colocated_grpo.analysis.__main__", [], "SWEEP_DIR: print a sweep's table, rewrite its summary.csv"),
    "render": ("colocated_grpo.analysis.__main__", ["render"], "DIR [--out OUT]: a sweep's or a run's figures"),
    "notebook": ("colocated_grpo.analysis.notebook", [], "NOTEBOOK [NAME=VALUE …]: execute a notebook headless"),
    "study": ("colocated_grpo.bench.study.__main__", [], "run DEFINITION --out DIR | report DIR: a benchmark study"),
    "bench-generate": ("colocated_grpo.bench.vllm_generate", [], "standalone vLLM generation throughput"),
    "bench-telemetry": ("colocated_grpo.bench.telemetry_overhead", [], "what the telemetry costs a training step"),
    "fault-campaign": (
        "colocated_grpo.bench.fault_campaign",
        [],
        "a CPU run interrupted at random moments and resumed each time; checks every step is kept once",
    ),
    "placement": (
        "colocated_grpo.bench.placement.__main__",
        [],
        "calibrate | predict | validate: the step time of each placement, modelled from one GPU",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items()]
    return "usage: colocated-grpo COMMAND [ARGS …]   (COMMAND --help for its options)\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n")[0] + "\n\n" + usage())
        return
    if argv[0] not in COMMANDS:
        sys.exit(f"colocated-grpo: unknown command {argv[0]!r}\n{usage()}")
    module, first, _ = COMMANDS[argv[0]]
    importlib.import_module(module).main([*first, *argv[1:]])


if __name__ == "__main__":
    main()
