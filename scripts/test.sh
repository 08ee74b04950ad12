#!/usr/bin/env bash
# Run the test suite from a fresh clone: scripts/setup.sh makes .venv if it is missing and
# installs torch (the CPU build where there is no GPU) and the project with its dev extras;
# then pytest. Extra arguments go to pytest, e.g. `bash scripts/test.sh -m cuda`.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
bash scripts/install_metaworld.sh "$py"  # Meta-World beside MuJoCo 4 (see the script)
exec "$py" -m pytest "$@"
