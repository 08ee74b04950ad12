#!/usr/bin/env bash
# The headline: the main job (FastSAC, `python scripts/train.py`) over seeds 0 1 2 3 4 ($SEEDS) as
# processes side by side on one GPU, or with ALONE=1 one after another, each alone on it. Each
# trains until `seconds_per_run` after its own launch
# (compile and capture included; the step budget is set out of reach), evaluating on the
# validation starts as it goes and on the test starts at 200 000 env steps and at the end; a hard
# timeout GRACE s later (default 180: the final evaluations of 512 + 1 024 episodes, three runs
# sharing the GPU, took over 60 s on MuJoCo Warp) stops a run that hangs. Then scripts/aggregate.py
# (IQM and 95 % bootstrap intervals over the seeds) over the folder.
#
#   bash scripts/headline.sh [out_dir] [seconds_per_run] [override ...]
#   NAME=sb3_sac bash scripts/headline.sh out/sb3 600 experiment=dsrl_sac   # the SB3 path, same protocol
#   ALONE=1 GRACE=90 bash scripts/headline.sh out/mjw 240 task=mujoco_warp_push  # one run after another
#
# out_dir defaults to $OUT/headline when $OUT is set. Writes <out_dir>/<name>_seed<k>/
# (config.yaml, curve.json, curve.png, summary.json, checkpoints/, tb/), one .log per run, and
# summary.md, aggregate.json, curves.png. The default 450 s per run ends within ~8.5 minutes.
# IQM and its intervals mean something only with enough seeds: five is the least reported.
set -uo pipefail
out=${1:-${OUT:+$OUT/headline}}
out=${out:-multirun/headline}
limit=${2:-450}
extra=("${@:3}")  # more Hydra overrides for every run
name=${NAME:-fast_sac}
grace=${GRACE:-180}
py=${PYTHON:-$(command -v python || command -v python3)}  # the interpreter that holds torch (PYTHON=... to choose)
mkdir -p "$out"
start=$(date +%s)
read -r -a seeds <<<"${SEEDS:-0 1 2 3 4}"
status=0
for seed in "${seeds[@]}"; do
  run="${name}_seed$seed"
  OMP_NUM_THREADS=4 timeout --kill-after=10 $((limit + grace)) "$py" scripts/train.py seed=$seed \
    time_limit_s=$limit total_steps=1000000000 "${extra[@]}" "hydra.run.dir='$out/$run'" >"$out/$run.log" 2>&1 &
  if [ "${ALONE:-0}" = 1 ]; then wait $! || status=$?; fi  # each run alone on the GPU
done
for job in $(jobs -p); do wait "$job" || status=$?; done
echo "runs finished after $(($(date +%s) - start)) s (last non-zero exit: $status)"
"$py" scripts/aggregate.py "$out" || echo "aggregate.py failed (is rliable installed here?); the runs' JSON is complete: run it where it is"
