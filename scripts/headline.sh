#!/usr/bin/env bash
# The headline comparison, runs side by side and spread round-robin over the visible GPUs
# (Hydra's basic launcher runs a sweep's jobs one after another): noise-space SAC
# (experiment=dsrl_sac) over seeds 0 1 2, residual-mode SAC and PPO beside it with the same
# budget, then scripts/aggregate.py over the folder.
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
# The devices to take turns on: CUDA_VISIBLE_DEVICES as given, else every GPU torch sees (0 on a CPU).
IFS=, read -ra devices <<<"${CUDA_VISIBLE_DEVICES:-$(python -c "import torch
print(','.join(map(str, range(max(torch.cuda.device_count(), 1)))))")}"
run() {  # device, name, overrides...
  local device=$1 name=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$device OMP_NUM_THREADS=2 timeout "$limit" python scripts/train.py experiment=dsrl_sac \
    "$@" "${extra[@]}" "hydra.run.dir='$out/$name'" >"$out/$name.log" 2>&1
  echo "$name (device $device) exit $?"
}
i=0
launch() {  # name, overrides...: in the background, on the next device in turn
  local device=${devices[i % ${#devices[@]}]}
  i=$((i + 1))
  run "$device" "$@" &
}
for seed in 0 1 2; do launch "noise_sac_seed$seed" seed=$seed; done
launch "residual_sac_seed0" env=residual seed=0
launch "noise_ppo_seed0" agent=ppo seed=0
wait
python scripts/aggregate.py "$out"
