#!/usr/bin/env bash
# Set up (if needed) and serve the embedded default model: scripts/serve.sh [launch.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python launch.py "$@"
