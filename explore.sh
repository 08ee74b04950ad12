#!/usr/bin/env bash
# ad-hoc exploration (not committed)
set -u
limit=${1:-400}
mkdir -p $OUT/runs
python -m pytest -q -m cuda tests/flashrt_gym/test_graph_sac.py 2>&1 | tail -3
python scripts/bench_sac.py --widths 256 2048 --steps 300 --out $OUT/bench_sac.json 2>&1 | tail -4
run() { local name=$1; shift
  OMP_NUM_THREADS=2 timeout $limit python scripts/train.py experiment=dsrl_sac logger=none eval.episodes=256 "$@" "hydra.run.dir=$OUT/runs/$name" > $OUT/runs/$name.log 2>&1
  echo "$name exit $?"; }
run utd1 agent.utd=1 &
run utd4 agent.utd=4 &
run utd4_rep agent.utd=4 env.repeat_over_horizon=true &
run utd4_w1024 agent.utd=4 "agent.kwargs.policy_kwargs.net_arch=[1024,1024,1024]" &
wait
for f in $OUT/runs/*/curve.json; do echo $f; python -c "
import json,sys; c=json.load(open('$f')); print(' '.join(f\"{p['env_steps']//1000}k:{p['success']:.2f}\" for p in c), 'base', c[0]['base_success'] if c else '', 'wall', round(c[-1]['wall_s']) if c else '')"; done
