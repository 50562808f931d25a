"""The README and docs/ name only real things: every command in a ```bash block runs a module, script or option
that exists, with config overrides that compose; every config-group option, module and repo path in inline code
exists; every relative link (and its #anchor) resolves. A failure names the file, the line and what is missing."""

from __future__ import annotations

import importlib.util
import inspect
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from colocated_grpo.launch.config_groups import renamed

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
# Paths under these are the checkout's own and must exist; others (outputs/runs/…, /tmp/figs, a sweep's dated
# directory) are examples of what a run writes.
REPO_PATHS = (".ci/", "conf/", "docs/", "notebooks/", "src/", "tests/", "hydra_plugins/", "sweeps/studies/")
REPO_PATHS += ("sweeps/results/", "train.py", "pyproject.toml", "LICENSE", "CITATION.cff", "CHANGELOG.md")
PLACEHOLDER = re.compile(r"[<>…]|\bDIR\b|\bSWEEP_DIR\b|\bOUT\b|\bNAME\b|\bN\b")
# Programs a documented command may start with that this repo does not provide (checked no further).
EXTERNAL = {"pip", "wandb", "jupytext", "pre-commit", "timeout", "sbatch", "export"}


def _pages_ids():
    return [str(p.relative_to(REPO)) for p in PAGES]


def bash_commands(page: Path) -> list[tuple[int, str]]:
    """(line number, command) of each command in the page's ```bash blocks: continuation lines joined, comments
    dropped, `a && b` split."""
    found, in_bash, pending, start = [], False, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_bash = not in_bash and line.strip() == "```bash"
            continue
        if not in_bash:
            continue
        if not pending:
            start = number
        pending += line.rstrip("\\").rstrip() + " "
        if line.rstrip().endswith("\\"):
            continue
        tokens = shlex.split(pending, comments=True)
        pending = ""
        command: list[str] = []
        for token in [*tokens, "&&"]:
            if token in ("&&", ";", "|", "||"):
                if command:
                    found.append((start, shlex.join(command)))
                command = []
            else:
                command.append(token)
    return found


@cache
def _source(module: str) -> str:
    """The source text of a module, or of every file of a package."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"no module {module}"
    origin = Path(spec.origin)
    files = sorted(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
    return "\n".join(f.read_text() for f in files)


def _check_path(token: str) -> str | None:
    path = token.rstrip("/")
    if PLACEHOLDER.search(path) or not path.startswith(REPO_PATHS):
        return None
    if "*" in path:
        return None if list(REPO.glob(path)) else f"nothing matches {path}"
    return None if (REPO / path).exists() else f"no file or directory {path}"


def _check_overrides(overrides: list[str]) -> str | None:
    """Hydra overrides of train.py: compose them (a sweep's lists by their first value)."""
    kept = []
    for override in overrides:
        if override in ("-m", "--multirun") or override.startswith("-"):
            continue
        key, _, value = override.partition("=")
        if "," in value and not value.startswith(("[", "'", '"')):
            value = value.split(",")[0]
        kept.append(f"{key}={value}")
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            compose("train", overrides=kept, return_hydra_config=True)
    except Exception as error:  # Hydra names the override it could not apply
        return f"overrides do not compose: {type(error).__name__}: {str(error).splitlines()[0]}"
    return None


def check_command(command: str) -> list[str]:
    """What is wrong with one documented command; [] when everything it names exists."""
    tokens = shlex.split(command)
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # VAR=value before the program
        tokens = tokens[1:]
    program, args = tokens[0], tokens[1:]
    problems = []
    if program in ("python", "python3"):
        if args[:1] == ["-m"]:
            module, rest = args[1], args[2:]
            if importlib.util.find_spec(module) is None:
                return [f"no module {module}"]
            own, overrides = rest, []
            if "--" in rest:  # what follows `--` is for train.py
                own, overrides = rest[: rest.index("--")], rest[rest.index("--") + 1 :]
            for arg in own:
                option = arg.split("=")[0]
                if option.startswith("-") and f'"{option}"' not in _source(module):
                    problems.append(f"{module} has no option {option}")
                elif not option.startswith("-") and "=" not in arg and (problem := _check_path(arg)):
                    problems.append(problem)
            if overrides and (problem := _check_overrides(overrides)):
                problems.append(problem)
        elif args and args[0].endswith(".py"):
            problem = _check_path(args[0]) or (_check_overrides(args[1:]) if args[0] == "train.py" else None)
            if problem:
                problems.append(problem)
        else:
            problems.append("a python command names neither -m MODULE nor a script")
    elif program == "torchrun":
        script = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
        if script is None or args[script] != "train.py":
            problems.append("torchrun runs train.py here")
        elif problem := _check_overrides(args[script + 1 :]):
            problems.append(problem)
    elif program == "bash":
        if problem := _check_path(args[0]):
            problems.append(problem)
        elif args[0] == ".ci/install.sh" and not all(
            re.search(rf"^\s*{re.escape(a)}\)", (REPO / args[0]).read_text(), re.M) for a in args[1:]
        ):
            problems.append(f".ci/install.sh takes none of {args[1:]}")
    elif program != "pytest" and program not in EXTERNAL:
        problems.append(f"unknown program {program} (add it to EXTERNAL in tests/test_docs.py if it is meant)")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_pages_ids())
def test_every_documented_command_names_real_modules_options_and_configs(page):
    commands = bash_commands(page)
    offending = [
        f"{page.relative_to(REPO)}:{line}: {command}\n    -> {problem}"
        for line, command in commands
        for problem in check_command(command)
    ]
    assert not offending, "commands that name something that does not exist:\n" + "\n".join(offending)


def _launchers() -> str:
    return "\n".join(p.read_text() for p in (REPO / "hydra_plugins").rglob("*.py"))


def check_inline(code: str) -> str | None:
    """An inline code span: `python -m MODULE …`, `group=option`, or a path of the checkout."""
    if code.startswith("python -m "):
        module = code.split()[2]
        if PLACEHOLDER.search(module):
            return None
        return None if importlib.util.find_spec(module) else f"no module {module}"
    if match := re.fullmatch(r"\+?([\w/]+)=([\w.-]+)", code):
        group, option = match.groups()
        if PLACEHOLDER.search(option):
            return None
        if message := renamed(code):
            return message
        if group == "hydra/launcher":
            return None if f'"{option}"' in _launchers() or option == "basic" else f"no launcher {option}"
        if (CONF / group).is_dir():
            return None if (CONF / group / f"{option}.yaml").exists() else f"no conf/{group}/{option}.yaml"
        return None
    if re.fullmatch(r"[\w./*-]+", code):
        if code.startswith("colocated_grpo/"):
            code = "src/" + code
        return _check_path(code)
    return None


@pytest.mark.parametrize("page", PAGES, ids=_pages_ids())
def test_inline_code_names_real_modules_config_options_and_paths(page):
    offending = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for code in re.findall(r"`([^`]+)`", line):
            if problem := check_inline(code):
                offending.append(f"{page.relative_to(REPO)}:{number}: `{code}` -> {problem}")
    assert not offending, "inline code naming something that does not exist:\n" + "\n".join(offending)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    found, seen = set(), {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


@pytest.mark.parametrize("page", PAGES, ids=_pages_ids())
def test_relative_links_and_their_anchors_resolve(page):
    offending = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                offending.append(f"{page.relative_to(REPO)}:{number}: ({target}) -> no {path}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                offending.append(f"{page.relative_to(REPO)}:{number}: ({target}) -> no heading #{anchor} there")
    assert not offending, "links that do not resolve:\n" + "\n".join(offending)


def test_the_checks_catch_what_does_not_exist():
    assert check_command("python train.py placement=colocated") != []
    assert check_command("python train.py +experiment=qwen_colocate trainer.vllm_tensor_parallel_size=1,2") == []
    assert check_command("python -m colocated_grpo.bench.vllm_generate --no-such-option 1") != []
    assert check_command("python -m colocated_grpo.no_such_module") != []
    assert check_command("bash .ci/install.sh tpu") != []
    assert check_inline("+sweep=no_such_sweep") and check_inline("conf/no_such.yaml")
    assert check_inline("hydra/launcher=torchrun_slurm") is None and check_inline("placement=server") is None
    assert "is now `placement`: write placement=server" in check_inline("vllm=server")
    assert anchors(REPO / "docs" / "results.md") >= {"where-should-generation-run-on-2--h200"}


def test_citation_and_license():
    import yaml

    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "Apache-2.0"
    assert {"message", "title", "authors"} <= set(cff), "CFF 1.2.0's required keys"
    for reference in cff["references"]:
        assert {"type", "title", "authors"} <= set(reference), reference
        assert (REPO / re.search(r"sweeps/results/[\w.]+/", reference["notes"])[0]).is_dir(), reference["notes"]
    assert "Apache License" in (REPO / "LICENSE").read_text()[:200]


def test_every_test_and_handler_the_signal_table_names_exists():
    """docs/resilience.md's table of what a signal does names, per row, its handler in resilience/signals.py and the
    tests that show it; every handler that module installs has its row."""
    page = (REPO / "docs" / "resilience.md").read_text()
    table = page.split("### What a signal does, by process and phase", 1)[1].split("\n## ", 1)[0]
    rows = [
        line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| process", "| ---"))
    ]
    named = [name for row in rows for name in re.findall(r"`(test_\w+)`", row.rsplit("|", 2)[1])]
    assert len(rows) >= 8 and all(re.search(r"`test_\w+`", row) for row in rows), "each row names its test"
    defined = {
        m for path in (REPO / "tests").glob("test_*.py") for m in re.findall(r"^def (test_\w+)", path.read_text(), re.M)
    }
    assert not [name for name in named if name not in defined]
    from colocated_grpo.resilience import signals

    handlers = {row.split(" | ")[2].strip("`") for row in rows}
    installers = {n for n, f in vars(signals).items() if inspect.isfunction(f) and f.__module__ == signals.__name__}
    assert handlers == {n for n in installers if not n.startswith("_")}
