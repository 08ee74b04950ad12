#!/usr/bin/env bash
# The headline comparison on one GPU, runs side by side (Hydra's basic launcher runs a sweep's
# jobs one after another): noise-space SAC (experiment=dsrl_sac) over seeds 0 1 2, residual-mode
# SAC and PPO beside it with the same budget, then scripts/aggregate.py over the folder.
#
#   bash scripts/headline.sh [out_dir] [seconds_per_run] [override ...]
#
# A run stopped by the time limit keeps its curve.json up to its last evaluation; aggregate.py
# reports the runs that finished.
set -uo pipefail
out=${1:-multirun/headline}
limit=${2:-3600}
extra=("${@:3}")  # more Hydra overrides for every run
mkdir -p "$out"
run() {  # name, overrides...
  local name=$1
  shift
  OMP_NUM_THREADS=2 timeout "$limit" python scripts/train.py experiment=dsrl_sac "$@" "${extra[@]}" \
    "hydra.run.dir='$out/$name'" >"$out/$name.log" 2>&1
  echo "$name exit $?"
}
for seed in 0 1 2; do run "noise_sac_seed$seed" seed=$seed & done
run "residual_sac_seed0" env=residual seed=0 &
run "noise_ppo_seed0" agent=ppo seed=0 &
wait
python scripts/aggregate.py "$out"
