#!/usr/bin/env bash
# The project's main job, run by `make demo` after `make setup`: Bamboo training on an emulated spot cluster.
#
# `bamboo-launch run` starts an embedded etcd, 8 emulated nodes in 3 zones (one agent process per node, each
# spawning its bamboo-rc worker), places them as P=4 stages x D=2 pipelines with bamboo-reconfig, trains the tiny
# GPT with eager redundant computation, and replays synthetic preemptions at the paper's highest replayed rate
# (33% per node per hour) compressed 60x (87 trace minutes in 87 s of training), timed from the first step:
# every removal SIGKILLs a node's process group, the runtime fails over, additions start new nodes that join at
# the next reconfiguration, and the final report compares the cost at spot and on-demand prices.
#
# Leases of 10 s (--ttl 10 --grace 10): eight workers importing torch at once on two cores can starve an agent or
# etcd itself for longer than the 2 s default, and a node declared failed by mistake is worse than a slower detection.
#
# The trace seed is fixed (DEMO_SEED, default 2559) so the demo is repeatable. The trace is the synthetic model as
# is (no scripted kill): three preemptions in the first 4.3 trace minutes (node1 and node0, stages 0 and 3 of
# pipeline 0, adjacent through the shadow ring, 2.1 trace minutes apart, and node7 of pipeline 1 in between),
# then three additions (28, 46 and 58.5 trace minutes). The kills are 0.6 and 1.5 s apart at 60x, well inside the
# 10 s detection window, so membership confirms them in one failure event: the runtime raises ConsecutiveFailure
# and the survivors re-form into one pipeline from the surviving copies (a consecutive pair); when the third
# joiner arrives there are enough waiting nodes for a second pipeline, and the run goes back to D=2.
# Why this seed: a consecutive pair needs adjacent stages lost within one detection window. The generator's bulk
# preemptions share one time only within a zone, and bamboo-reconfig never puts adjacent stages in one zone, so no
# seed has adjacent kills at the same instant (0 of the 1,056 seeds in 0-9999 whose 8 nodes are all there at
# t=0). Independent kills of adjacent stages a few trace minutes apart do happen (114 of those 1,056 have two
# within 3 trace minutes on the first layout), but most of those traces also kill a node while a reconfiguration
# is in progress, which bamboo-launch does not handle yet (the run times out). A rough replay of the layouts
# (bamboo-reconfig's decide and plan_layout on the trace) kept 3 seeds of 10,000 with one pair, joins and no kill
# during a reconfiguration: 2559, 2778 and 6053 (the last two lose a pair in a single pipeline, so they restore
# the last checkpoint instead). Then the parameters are checked against a fault-free single-process run of the
# same steps (--verify: within 1e-6 relative). --timeout 420 ends a run that hangs after 7 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu PYTHONWARNINGS=ignore
BIN=.venv/bin
SEED=${DEMO_SEED:-2559}
OUT=${DEMO_OUT:-.cache/demo}
rm -rf "$OUT" && mkdir -p "$OUT"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1/2 bamboo-launch run: 8 nodes in 3 zones, P=4, D=2, tiny GPT, synthetic preemptions (rate 0.33/h, seed $SEED)"
$BIN/bamboo-launch run --nodes 8 --zones a,b,c --stages 4 --pipelines 2 --steps "${DEMO_STEPS:-500}" \
  --preemptions synthetic:0.33 --hours 1.45 --seed "$SEED" --time-scale 60 \
  --ttl 10 --grace 10 --timeout 420 --checkpoint-dir "$OUT/checkpoints" --checkpoint-every 20 --run-dir "$OUT/run" --plot "$OUT/run.png" --verify

step "2/2 what the same spot market would cost over a long run: bamboo vs checkpoint/restart vs on-demand (simulated, EC2 p3 trace)"
TRACE=../shared/traces/bamboo/p3-trace.csv
if [[ -f $TRACE ]]; then
  $BIN/bamboo-bench simulate --trace "$TRACE" --model gpt2 --strategy bamboo,checkpoint,on-demand
else
  echo "demo: $TRACE not found (the traces live in ../shared); simulating synthetic preemptions instead"
  $BIN/bamboo-bench simulate --synthetic --probability 0.1 --model gpt2 --strategy bamboo,checkpoint,on-demand
fi
