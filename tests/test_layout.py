"""The package's shape: each layer a folder, imports only pointing down the layers, no circle of imports, and the
tree lint-clean and formatted (ruff, configured in pyproject.toml).

    python tests/test_layout.py     # the import graph's numbers: folders, modules, arrows, circles, upward arrows
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "colocated_grpo"

# Bottom to top. A module may import from its own unit or from a unit of a lower layer, never from a peer or above.
LAYERS = (
    ("run_files", "provenance", "compat"),  # the run-directory contract, where results come from, third-party internals
    ("telemetry", "resilience"),  # what a run reports; how it survives failures
    ("training",),  # config, model, data, rewards, the runner
    ("analysis",),  # reading runs and sweeps: tables, frames, figures
    ("launch",),  # processes: entry point, server placement, sweeps
    ("bench",),  # studies and benchmarks
    ("cli",),  # the `colocated-grpo` command: each tool's own main, under one name
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports, at module level or inside functions alike."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found - {PACKAGE.name}  # `from colocated_grpo import x` names x, not the package's empty __init__


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(p): p for p in package.rglob("*.py")}
    files.pop(PACKAGE.name)
    return {name: imports(path, set(files) | {PACKAGE.name}) - {name} for name, path in files.items()}


def unit(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Arrows into a peer unit or a higher layer."""
    return sorted(
        (a, b)
        for a, targets in edges.items()
        for b in targets
        if unit(a) != unit(b) and LAYER[unit(b)] >= LAYER[unit(a)]
    )


def test_every_unit_of_the_package_has_a_layer():
    units = {unit(m) for m in graph()}
    assert units == set(LAYER), f"give these a layer in LAYERS: {units - set(LAYER)}; gone: {set(LAYER) - units}"


def test_imports_point_down_the_layers_and_never_in_a_circle():
    edges = graph()
    assert upward(edges) == []
    assert circles(edges) == []


def test_the_layer_check_sees_an_upward_arrow_and_a_circle():
    edges = {
        "colocated_grpo.training.a": {"colocated_grpo.launch.b"},
        "colocated_grpo.launch.b": {"colocated_grpo.training.a"},
    }
    assert upward(edges) == [("colocated_grpo.training.a", "colocated_grpo.launch.b")]
    assert circles(edges) == [["colocated_grpo.launch.b", "colocated_grpo.training.a"]]


def test_the_tree_is_lint_clean_and_formatted():
    root = PACKAGE.parents[1]
    for command in (["check", "--output-format", "concise", "."], ["format", "--check", "."]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=root, capture_output=True, text=True)
        assert proc.returncode == 0, f"ruff {' '.join(command)}:\n{proc.stdout}{proc.stderr}"


if __name__ == "__main__":
    package = Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE
    edges = graph(package)
    folders = sum(1 for p in package.rglob("__init__.py") if p.parent != package)
    print(
        f"folders {folders}, modules {len(edges)}, arrows {sum(map(len, edges.values()))}, "
        f"circles {len(circles(edges))}, upward arrows {len(upward(edges))}"
    )
    for a, b in upward(edges):
        print(f"  upward: {a} -> {b}")
