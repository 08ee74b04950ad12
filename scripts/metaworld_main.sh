#!/usr/bin/env bash
# The main job on Meta-World's MT10 (configs/experiment/metaworld_mt10.yaml), on one GPU machine
# whose CPU cores step the physics, in two stages, each run reading the base policy's evaluation
# from <out>/base_eval.json (scripts/eval.py base_eval=..., once on all the cores, first):
#
# 1. Choose the action mode on the validation starts: FastSAC over the VLA's noise (env=noise) and
#    residual FastSAC (env=residual), seed 0 of each, side by side for CHOICE_S seconds (default
#    240), each with half the cores' worker processes; scripts/aggregate.py names the better by its
#    last validation evaluation (<out>/choice/summary.md).
# 2. The chosen mode over seeds 0-4 ($SEEDS) side by side for RUN_S seconds each (default 420),
#    the cores split between them: scripts/headline.sh, then scripts/aggregate.py's IQM over the
#    seeds on the test starts with the per-task table beside the base policy (<out>/main/).
#
#   bash scripts/metaworld_main.sh [out_dir] [override ...]
#   STAGE=choice bash scripts/metaworld_main.sh out    # stage 1 alone (writes out/choice.txt)
#   STAGE=main bash scripts/metaworld_main.sh out      # stage 2 alone, on the mode out/choice.txt names
#
# STAGE (all, choice or main; default all) splits the job over two sittings, as a GPU machine lent
# for less than the whole job asks: stage 2 reads the mode from <out>/choice.txt, the validation
# choice stage 1 wrote, so the seeds' mode is still chosen on validation.
# out_dir defaults to $OUT/metaworld_mt10 when $OUT is set, else multirun/metaworld_mt10; further
# Hydra overrides go to every run. With the defaults it ends within ~17 minutes (the base policy's
# evaluation, under a minute; each stage's runs stop RUN_S / CHOICE_S after launch, then evaluate on
# 1 024 test starts).
set -euo pipefail
out=${1:-${OUT:+$OUT/metaworld_mt10}}
out=${out:-multirun/metaworld_mt10}
extra=("${@:2}")
py=${PYTHON:-$(command -v python || command -v python3)}
cores=$(nproc)
read -r -a seeds <<<"${SEEDS:-0 1 2 3 4}"
per_run=$((cores / ${#seeds[@]} > 0 ? cores / ${#seeds[@]} : 1))

stage=${STAGE:-all}
case "$stage" in
  all | choice | main) ;;
  *) echo "STAGE must be all, choice or main (got '$stage')" >&2; exit 2 ;;
esac

# The base policy's evaluation, once on all the cores into a file every run of this invocation reads
# (config key base_eval): each run would otherwise evaluate the same base policy on the same starts
# inside its time limit (README, Meta-World: a large part of it). Should it fail, each run evaluates it.
base="$out/base_eval.json"
evaluate_base() {
  mkdir -p "$out"
  rm -f "$base"
  "$py" scripts/eval.py experiment=metaworld_mt10 task.processes="$cores" base_eval="$base" "${extra[@]}" \
    "hydra.run.dir='$out/base_eval'" >"$out/base_eval.log" 2>&1 ||
    echo "the base policy's evaluation failed (see $out/base_eval.log): each run evaluates it itself" >&2
}

if [ "$stage" != main ]; then
  evaluate_base
  mkdir -p "$out/choice"
  for mode in noise residual; do
    SEEDS=0 NAME=$mode bash scripts/headline.sh "$out/choice/$mode" "${CHOICE_S:-240}" experiment=metaworld_mt10 \
      env=$mode task.processes=$((cores / 2 > 0 ? cores / 2 : 1)) base_eval="$base" "${extra[@]}" >"$out/choice/$mode.log" 2>&1 &
  done
  wait
  "$py" scripts/aggregate.py "$out/choice" | tee "$out/choice.txt"
fi
mode=$(sed -n 's/^best on validation: \([a-z]*\) .*/\1/p' "$out/choice.txt" 2>/dev/null || true)
if [ -z "$mode" ]; then
  if [ "$stage" = main ]; then
    echo "no choice: STAGE=main reads the mode from $out/choice.txt; run STAGE=choice (or all) into $out first" >&2
  else
    echo "no choice: a mode's run has no validation evaluation (see $out/choice/*.log and its runs' logs)" >&2
  fi
  exit 1
fi
echo "chosen on validation: env=$mode"
[ "$stage" = choice ] && exit 0
[ "$stage" = main ] && evaluate_base
# The seeds' final evaluations (1 280 episodes each, five runs sharing the cores) come close to
# headline.sh's default 180 s grace at the evaluation rates the choice stage measured (README,
# Meta-World). A larger grace only delays the stop of a run that hangs.
GRACE=${GRACE:-360} SEEDS="${seeds[*]}" NAME=$mode bash scripts/headline.sh "$out/main" "${RUN_S:-420}" experiment=metaworld_mt10 \
  env="$mode" task.processes="$per_run" base_eval="$base" "${extra[@]}"
