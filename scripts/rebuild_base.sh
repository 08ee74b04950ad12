#!/usr/bin/env bash
# Rebuild a base policy end to end, as the shipped flashrt_gym/assets/tiny (TASK=tabletop, the
# default) and flashrt_gym/assets/tiny_mujoco (TASK=mujoco_push) were made: scripted-expert
# demonstrations from the demonstration seeds (flashrt_gym.splits.demo_seed), behaviour cloning
# with a checkpoint every `eval_every` steps scored on the validation starts (seen and held-out
# instructions), the checkpoint with the highest success on seen instructions chosen, and that
# one measured once on the test starts, seen and held out.
#
#   bash scripts/rebuild_base.sh OUT_DIR [pretrain override ...]
#   TASK=mujoco_push bash scripts/rebuild_base.sh OUT_DIR init=flashrt_gym/assets/tiny steps=1500 warmup=100 lr=1e-4
#   COLLECT="num_episodes=8 num_slots=8" TEST_EPISODES=16 bash scripts/rebuild_base.sh /tmp/smoke \
#       steps=2 eval_every=1 eval_episodes=8 batch_size=8 warmup=1                   # a CPU smoke run
#
# TASK=mujoco_push collects and fine-tunes through scripts/mujoco_pretrain.py (MuJoCo's C library,
# $EPISODES demonstrations, $WORKERS collection processes, $THREADS physics threads in every
# evaluation) and evaluates on the push task.
#
# Writes OUT_DIR/demos/, OUT_DIR/pretrain/ (step-N/ folders, evals.json), OUT_DIR/chosen -> the
# chosen step-N/, and OUT_DIR/base_test.json (the chosen policy on TEST_EPISODES test starts a split).
set -euo pipefail
out=${1:?usage: bash scripts/rebuild_base.sh OUT_DIR [pretrain override ...]}
extra=("${@:2}")
read -r -a collect <<<"${COLLECT:-}"   # more collect_demos.py overrides
episodes=${TEST_EPISODES:-1024}         # test episodes a split
py=${PYTHON:-$(command -v python || command -v python3)}
threads=${THREADS:-$(nproc)}
mkdir -p "$out"
case ${TASK:-tabletop} in
  tabletop)
    "$py" scripts/collect_demos.py "out=$out/demos" "hydra.run.dir=$out/hydra/collect" "${collect[@]}"
    "$py" scripts/pretrain_policy.py "demos=$out/demos" "out=$out/pretrain" "hydra.run.dir=$out/hydra/pretrain" "${extra[@]}"
    split_key=task.split; eval_task=() ;;
  mujoco_push)
    "$py" scripts/mujoco_pretrain.py --episodes "${EPISODES:-4000}" --workers "${WORKERS:-$(nproc)}" \
      --eval-threads "$threads" --out "$out" "${extra[@]}"
    split_key=task.cfg.table.split; eval_task=(task=mujoco_push "task.threads=$threads") ;;
  *) echo "TASK must be tabletop or mujoco_push, got ${TASK}" >&2; exit 2 ;;
esac
chosen=$("$py" -c '
import json, sys
evals = json.load(open(sys.argv[1]))["evals"]
print(max(evals, key=lambda e: (e["success_train"], -e["step"]))["weights"])' "$out/pretrain/evals.json")
ln -sfn "$(realpath "$chosen")" "$out/chosen"
echo "chosen on validation (seen instructions): $chosen"
for split in train heldout; do
  "$py" scripts/eval.py "${eval_task[@]}" +split=test "eval.episodes=$episodes" "eval.test_episodes=$episodes" "$split_key=$split" \
    "policy.weights=$out/chosen" \
    "hydra.run.dir=$out/hydra/eval_$split" | tail -n 1 | "$py" -c '
import json, sys
print(json.dumps({"instructions": sys.argv[1], **json.loads(sys.stdin.read())}))' "$split"
done > "$out/base_test.jsonl"
"$py" -c '
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
json.dump({"chosen": sys.argv[2], "test": rows}, open(sys.argv[3], "w"), indent=2)' \
  "$out/base_test.jsonl" "$chosen" "$out/base_test.json"
cat "$out/base_test.json"
