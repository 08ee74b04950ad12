#!/usr/bin/env bash
# Run the main job from a fresh clone: scripts/setup.sh makes .venv if it is missing and installs
# torch (the CPU build where there is no GPU) and the project; then scripts/train.py.
# Arguments are Hydra overrides, e.g. `bash scripts/train.sh experiment=quick seed=1`.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
exec "$py" scripts/train.py "$@"
