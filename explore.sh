#!/usr/bin/env bash
set -u
limit=${1:-330}
mkdir -p $OUT/runs
python -m pytest -q -m cuda tests/flashrt_gym/test_graph_sac.py 2>&1 | tail -2
python scripts/bench_sac.py --widths 256 1024 2048 --steps 300 --out $OUT/bench_sac.json 2>&1 | tail -5
LN=agent.policy=flashrt_gym.graph_sac.LayerNormSACPolicy
run() { local name=$1; shift
  OMP_NUM_THREADS=2 timeout $limit python scripts/train.py experiment=dsrl_sac logger=none eval.episodes=256 $LN "$@" "hydra.run.dir=$OUT/r/$name" > $OUT/runs/$name.log 2>&1
  cp $OUT/r/$name/curve.json $OUT/runs/$name.json; echo "$name exit $?"; }
run ln_utd1 agent.utd=1 &
run ln_utd4 agent.utd=4 &
run ln1024_utd2 agent.utd=2 "agent.kwargs.policy_kwargs.net_arch=[1024,1024,1024]" &
run ln_utd2_rep agent.utd=2 env.repeat_over_horizon=true &
wait
rm -rf $OUT/r
for f in $OUT/runs/*.json; do echo $f; python -c "
import json,sys; c=json.load(open('$f')); print(' '.join(f\"{p['env_steps']//1000}k:{p['success']:.2f}\" for p in c), 'base', c[0]['base_success'] if c else '', 'wall', round(c[-1]['wall_s']) if c else '')"; done
