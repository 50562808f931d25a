"""`colocated-grpo COMMAND …`: the project's tools under one command (training itself is `python train.py`).

Each command is a module's own `main(argv, prog)`, so `python -m colocated_grpo.…` runs the same thing; given the
prog name `colocated-grpo COMMAND`, its `--help` prints that command's options under that name."""

from __future__ import annotations

import importlib
import sys

from colocated_grpo.provenance import command_parser

PROG = "colocated-grpo"

# command: (module whose main(argv, prog) runs it, arguments put first, what it does)
COMMANDS = {
    "summary": (
        "colocated_grpo.analysis.__main__",
        [],
        "SWEEP_DIR | RUN_DIR: a sweep's table (rewrites its summary.csv), or a run's row",
    ),
    "render": ("colocated_grpo.analysis.__main__", ["render"], "DIR [--out OUT]: a sweep's or a run's figures"),
    "notebook": ("colocated_grpo.analysis.notebook", [], "NOTEBOOK [NAME=VALUE …]: execute a notebook headless"),
    "study": ("colocated_grpo.bench.study.__main__", [], "run DEFINITION --out DIR | report DIR: a benchmark study"),
    "bench-generate": ("colocated_grpo.bench.vllm_generate", [], "standalone vLLM generation throughput"),
    "bench-telemetry": ("colocated_grpo.bench.telemetry_overhead", [], "what the telemetry costs a training step"),
    "bench-micro-batches": (
        "colocated_grpo.bench.micro_batches",
        [],
        "one optimizer step's training in TRL's, balanced and packed micro-batches",
    ),
    "fault-campaign": (
        "colocated_grpo.bench.fault_campaign",
        [],
        "a CPU run interrupted at random moments and resumed each time; checks every step is kept once",
    ),
    "config-reference": (
        "colocated_grpo.launch.config_groups",
        [],
        "write docs/config_reference.yaml: the composed default config, each section with the configs that set it",
    ),
    "placement": (
        "colocated_grpo.bench.placement.__main__",
        [],
        "calibrate | predict | validate: the step time of each placement, modelled from one GPU",
    ),
}


def commands() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items()]
    return "commands (COMMAND --help for its options):\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = command_parser(__name__, __doc__.split("\n")[0], PROG)
    parser.epilog = commands()
    parser.add_argument("command", metavar="COMMAND", help="one of the commands below")
    parser.add_argument("args", metavar="ARGS", nargs="*", default=[], help="the command's own arguments")
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv)  # --help: exit 0; nothing, or an option in place of a command: usage, exit 2
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})")
    module, first, _ = COMMANDS[argv[0]]
    importlib.import_module(module).main([*first, *argv[1:]], prog=f"{PROG} {argv[0]}")


if __name__ == "__main__":
    main()
