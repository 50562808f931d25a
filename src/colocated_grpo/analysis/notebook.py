"""Execute a notebook of notebooks/ headless, with its parameters set (no Jupyter server needed).

    python -m colocated_grpo.analysis.notebook notebooks/sweep.py sweep_dir=sweeps/2026-11-30_12-00-00_tp_x_gpu_mem \
        figures_dir=sweeps/2026-11-30_12-00-00_tp_x_gpu_mem/figures -o sweep.executed.ipynb

The values given go in a cell (tagged `injected-parameters`) right after the one tagged `parameters`, as papermill
does: a Python literal where one parses (a number, None, True), else a string. The notebook (jupytext .py or .ipynb)
runs in the current directory; a failing cell fails the command. `require_extra`: the tools' check, before long work,
that the `notebooks` extra they draw figures with is installed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path

from colocated_grpo.provenance import command_parser

# The `notebooks` extra: figures (a study's report, `render`) and notebooks executed headless.
FIGURES = ("matplotlib",)
NOTEBOOKS = ("matplotlib", "jupytext", "nbclient", "nbformat", "ipykernel")


def require_extra(extra: str, modules: Iterable[str], command: str) -> None:
    """Refuse, naming the extra to install, when a module `command` needs is missing: before long work, not after."""
    if missing := [m for m in modules if importlib.util.find_spec(m) is None]:
        raise SystemExit(
            f'{command} needs {", ".join(missing)} (the `{extra}` extra): pip install -e ".[{extra}]" in the '
            f'checkout, or pip install "colocated-grpo[{extra}]"'
        )


def execute(
    notebook: str | Path,
    parameters: dict | None = None,
    output: str | Path | None = None,
    cwd: str | Path | None = None,
    timeout: int = 600,
):
    """Run every cell of `notebook` (.py or .ipynb) in a fresh Python kernel; returns the executed notebook, also
    written to `output` when given. A cell that raises raises here (nbclient.exceptions.CellExecutionError)."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    nb = jupytext.read(notebook)
    if parameters:  # a cell setting them, after the one tagged `parameters` (or first, when none is)
        source = "# Parameters\n" + "".join(f"{name} = {value!r}\n" for name, value in parameters.items())
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
        tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
        nb.cells.insert(tagged[0] + 1 if tagged else 0, cell)
    client = NotebookClient(
        nb, kernel_name="python3", timeout=timeout, resources={"metadata": {"path": str(cwd or os.getcwd())}}
    )
    try:
        client.execute()
    finally:
        if output is not None:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, str(output))
    return nb


def parse_parameter(text: str) -> tuple[str, object]:
    """ "name=value" → (name, the value as a Python literal, or the string when it is none)."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: parameters are NAME=VALUE")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = command_parser("colocated_grpo.analysis.notebook", __doc__.split("\n")[0], prog)
    parser.add_argument("notebook", help="notebooks/sweep.py, notebooks/run.py (or their .ipynb)")
    parser.add_argument("parameters", nargs="*", type=parse_parameter, help="NAME=VALUE, e.g. sweep_dir=sweeps/…")
    parser.add_argument("-o", "--output", help="the executed notebook (default: NAME.executed.ipynb here)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may take")
    args = parser.parse_args(argv)
    require_extra("notebooks", NOTEBOOKS, "notebook")
    output = args.output or f"{Path(args.notebook).stem}.executed.ipynb"
    execute(args.notebook, dict(args.parameters), output, timeout=args.timeout)
    print(output)


if __name__ == "__main__":
    main()
