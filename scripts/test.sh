#!/usr/bin/env bash
# Run the test suite from a fresh clone: make .venv if it is missing, install torch (CPU build
# where there is no GPU) and the project with its dev extras, then run pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m cuda`.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FLASHRT_VENV:-.venv}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install -q torch
  else
    "$py" -m pip install -q torch==2.13.0
  fi
fi
"$py" -m pip install -q -e ".[dev]"
exec "$py" -m pytest "$@"
