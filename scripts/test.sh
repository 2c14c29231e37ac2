#!/usr/bin/env bash
# Sets up ./.venv with every extra and runs the whole test suite (CPU). Exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh "dev,models,llama-index,langchain,eval,serve,redis,distributed"
venv="${KVFUSE_VENV:-.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$venv/bin/python" -m pytest -q -ra --durations=25 "$@"
