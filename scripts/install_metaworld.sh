#!/usr/bin/env bash
# Install Meta-World into the project's environment: `bash scripts/install_metaworld.sh [python]`
# (default: .venv/bin/python). scripts/test.sh runs it after scripts/setup.sh.
#
# metaworld 3.1.1 (the newest release) requires mujoco==3.3.0, and this project runs MuJoCo 4:
# pip cannot hold both, and an extra in pyproject.toml cannot install a package without its
# requirements. So metaworld is installed with --no-deps, after its real runtime requirements
# with mujoco as the project pins it; the one MuJoCo 4 difference Meta-World meets (12 numbers
# a weld constraint, not 11) is bridged by flashrt_gym.sims.metaworld_state.reset_mocap_welds.
# `packaging` is imported by Gymnasium's MuJoCo envs, which Meta-World builds on, and declared by
# neither. Nothing is done when metaworld 3.1.1 is already installed.
set -euo pipefail
py=${1:-.venv/bin/python}
if "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('metaworld') != '3.1.1')" 2>/dev/null; then
  exit 0
fi
"$py" -m pip install -q "mujoco>=4.0,<5" "gymnasium>=1.1" "numpy>=1.18" "scipy>=1.4.1" imageio packaging typing_extensions
"$py" -m pip install -q --no-deps "metaworld==3.1.1"
