"""Write pip constraints from a tested environment: `name==version` of every distribution that installing
colocated-grpo with the given extras pulls in (pyproject.toml's dependencies, followed through each installed
distribution's own requirements), as installed in that environment.

    python .ci/freeze_constraints.py gpu,test,notebooks > .ci/constraints-gpu.txt    # inside the tested environment
    python .ci/freeze_constraints.py gpu,test,notebooks --path SITE --path SITE2 --python 3.12   # from copies of
        # its metadata (*.dist-info folders; the first path that holds a distribution wins)

Requirements that the environment does not hold are listed as comments at the end: pip resolves those freely.
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


def closure(roots: list[Requirement], dists: dict, env: dict) -> tuple[dict[str, str], dict[str, str]]:
    """(pinned: name → version, missing: name → who requires it) over the requirements reachable from `roots`."""
    pinned, missing, seen = {}, {}, set()
    queue = [(r, "colocated-grpo", ("",)) for r in roots]
    while queue:
        req, parent, extras = queue.pop()
        if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in extras):
            continue
        name = canonicalize_name(req.name)
        key = (name, tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        dist = dists.get(name)
        if dist is None:
            missing.setdefault(name, f"{parent}: {req}")
            continue
        pinned[dist.metadata["Name"]] = dist.version
        queue += [(Requirement(r), name, ("", *req.extras)) for r in dist.requires or []]
    return pinned, missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("extras", help="comma-separated extras of colocated-grpo, e.g. gpu,test,notebooks")
    parser.add_argument("--path", action="append", help="a folder of *.dist-info (default: this interpreter's)")
    parser.add_argument("--python", help="the environment's Python X.Y, when reading it from --path")
    parser.add_argument("--header", default="", help="a first comment line: what the environment was")
    args = parser.parse_args()
    env = default_environment()
    if args.python:
        env.update(python_version=args.python, python_full_version=f"{args.python}.0")
    extras = [e for e in args.extras.split(",") if e]
    pinned, missing = closure(project_requirements(extras), installed(args.path), env)
    pinned.pop("colocated-grpo", None)
    if args.header:
        print(f"# {args.header}")
    print(f"# colocated-grpo[{','.join(extras)}] and everything it requires, at the versions of that environment")
    print(f"# ({platform.machine()} Linux, Python {env['python_version']}); written by .ci/freeze_constraints.py.")
    for name in sorted(pinned, key=str.lower):
        print(f"{name}=={pinned[name]}")
    if missing:
        print("# Required but not in that environment (pip picks a version):")
        for name in sorted(missing):
            print(f"#   {name}  ({missing[name]})")


if __name__ == "__main__":
    main()
