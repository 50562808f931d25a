"""Benchmarks that print numbers; each is runnable with `python -m colocated_grpo.bench.<name>`."""

import argparse


def command_parser(module: str, doc: str | None, prog: str | None) -> argparse.ArgumentParser:
    """The parser of `python -m module` (or of `prog`, its `colocated-grpo` name), the module's docstring as help."""
    return argparse.ArgumentParser(
        prog=prog or f"python -m {module}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
