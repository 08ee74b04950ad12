# Shared set-up of scripts/test.sh and scripts/train.sh; source it, do not run it.
# Makes the virtual environment if it is missing ($FLASHRT_VENV, default .venv), installs torch
# the way this machine needs it, then the project with the extras in $FLASHRT_EXTRAS (default dev).
# Leaves the repository root as the working directory and the venv's python in $py.
#
# Torch: a machine with an NVIDIA GPU gets PyPI's build (CUDA wheels on Linux). A CPU-only machine
# gets the PyTorch CPU index's build (https://download.pytorch.org/whl/cpu, or $FLASHRT_TORCH_INDEX),
# unless pip's own configuration already offers a torch wheel without an index (a find-links
# folder, as on machines with a local wheel cache): that wheel is installed as is.
# The pip steps are skipped when pyproject.toml and the extras are unchanged since the last set-up.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${FLASHRT_VENV:-.venv}
extras=${FLASHRT_EXTRAS-dev}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install -q torch
  else
    local_wheels=$(mktemp -d)
    if [ -z "${FLASHRT_TORCH_INDEX:-}" ] \
      && "$py" -m pip download -q --no-deps --no-index -d "$local_wheels" torch 2>/dev/null; then
      "$py" -m pip install -q "$local_wheels"/torch-*.whl
    else
      "$py" -m pip install -q torch --index-url "${FLASHRT_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
    fi
    rm -rf "$local_wheels"
  fi
fi
stamp="$venv/.flashrt-setup"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) [$extras]"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$py" -m pip install -q -e ".${extras:+[$extras]}"
  printf '%s\n' "$want" >"$stamp.tmp" && mv "$stamp.tmp" "$stamp"
fi
