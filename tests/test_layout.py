"""The package's shape: each layer a folder, imports only pointing down the layers, no circle of imports
(import-linter's contracts in pyproject.toml: `lint-imports`), and the tree lint-clean and formatted (ruff, configured
in pyproject.toml)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with pyproject.toml's contracts, on the package as found in `src`."""
    command = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", command, str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"],
        cwd=src,
        env={**os.environ, "PYTHONPATH": str(src), "COLUMNS": "200"},  # COLUMNS: one line per reported import
        capture_output=True,
        text=True,
    )


def package_circles(graph: grimp.ImportGraph) -> list[tuple[str, str]]:
    """A package's __init__ and a module inside it importing each other (directly or not): the one circle that
    import-linter's acyclic_siblings contract does not see (it compares the package's children, not the package)."""
    return sorted(
        (package, module)
        for package in graph.modules
        for module in graph.find_descendants(package)
        if graph.chain_exists(package, module) and graph.chain_exists(module, package)
    )


def test_imports_point_down_the_layers_and_never_in_a_circle():
    proc = lint_imports(ROOT / "src")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert package_circles(grimp.build_graph("colocated_grpo", cache_dir=None)) == []


def test_the_layer_check_sees_an_upward_arrow_a_peer_import_a_circle_and_a_unit_without_a_layer(tmp_path):
    package = shutil.copytree(ROOT / "src" / "colocated_grpo", tmp_path / "colocated_grpo")
    with open(package / "training" / "prompt_lengths.py", "a") as module:  # upward, inside a function
        module.write("\n\ndef planted():\n    from colocated_grpo.launch import sweep_plan\n")
    with open(package / "telemetry" / "phases.py", "a") as module:  # into a peer unit
        module.write("\nfrom colocated_grpo.resilience import checkpoints\n")
    (package / "training" / "planted_a.py").write_text("from colocated_grpo.training import planted_b\n")
    (package / "training" / "planted_b.py").write_text("from colocated_grpo.training import planted_a\n")
    (package / "planted_unit").mkdir()
    (package / "planted_unit" / "__init__.py").write_text("")

    proc = lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for reported in (
        "colocated_grpo.training.prompt_lengths -> colocated_grpo.launch.sweep_plan",
        "colocated_grpo.telemetry.phases -> colocated_grpo.resilience.checkpoints",
        "No cycles are allowed in colocated_grpo.\n",  # training -> launch closes a circle with launch -> training
        "No cycles are allowed in colocated_grpo.training.\n",  # planted_a <-> planted_b
        "The following modules are not listed as layers:\n\n- colocated_grpo.planted_unit\n",
    ):
        assert reported in proc.stdout, proc.stdout


def test_the_circle_check_sees_a_package_and_its_own_module_importing_each_other():
    graph = grimp.ImportGraph()
    graph.add_import(importer="colocated_grpo.analysis", imported="colocated_grpo.analysis.tables")  # a re-export
    graph.add_import(importer="colocated_grpo.analysis.tables", imported="colocated_grpo.analysis")
    assert package_circles(graph) == [("colocated_grpo.analysis", "colocated_grpo.analysis.tables")]


def test_the_tree_is_lint_clean_and_formatted():
    for command in (["check", "--output-format", "concise", "."], ["format", "--check", "."]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, f"ruff {' '.join(command)}:\n{proc.stdout}{proc.stderr}"


def test_one_module_installs_every_signal_handler():
    """resilience/signals.py owns every signal handler (docs/resilience.md's table names each): no other module of
    the package, nor train.py, calls signal.signal."""
    files = [*(ROOT / "src").rglob("*.py"), ROOT / "train.py", *(ROOT / "hydra_plugins").rglob("*.py")]
    installing = sorted(str(p.relative_to(ROOT)) for p in files if re.search(r"\bsignal\.signal\(", p.read_text()))
    assert installing == ["src/colocated_grpo/resilience/signals.py"]
