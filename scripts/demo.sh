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
# The trace seed is fixed (DEMO_SEED, default 771) so the demo is repeatable. The trace is the synthetic model as
# is (no scripted kill): six preemptions and four additions. On the first layout (pipeline 0: node1 node4 node5
# node0; pipeline 1: node6 node2 node7 node3) it kills node7 and node3 (stages 2 and 3 of pipeline 1, adjacent
# through the shadow ring) 5.2 trace minutes apart, inside one 10 s detection window at 60x: the runtime raises
# ConsecutiveFailure and the survivors re-form from the surviving copies (a consecutive pair); node4 dies while
# they are still at it and is left out. node5 and node0 die later: a kill that lands while the nodes train is an
# ordinary failover (with its pause)
# followed by a reconfiguration; one that lands while a reconfiguration is starting makes it start again without
# that node (its record says attempts 2). Which of the two happens to node5 depends on how long the workers took
# to start, so the number of failovers varies between runs (1 or 2 in the measured runs); the joiner node9 is
# killed while a reconfiguration starts in every measured run.
# Why this seed: a consecutive pair needs adjacent stages lost within one detection window. The generator's bulk
# preemptions share one time only within a zone, and bamboo-reconfig never puts adjacent stages in one zone, so no
# seed has adjacent kills at the same instant; independent kills of adjacent stages a few trace minutes apart do
# happen. Of seeds 0-2999, 11 have such a pair on the first layout within 30 trace minutes, a later kill at least
# 12 trace minutes from any other (a candidate ordinary failover) and at least two additions; 771 is the first of
# those tried, and its runs showed every part the demo is for. (The previous seed, 2559, was chosen to avoid kills
# during a reconfiguration, which bamboo-launch did not survive then; its pair and third kill were confirmed as
# one failure event, so it showed no ordinary failover.)
# Then the parameters are checked against a fault-free single-process run of the same steps (--verify: within 1e-6
# relative). --timeout 420 ends a run that hangs after 7 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu PYTHONWARNINGS=ignore
BIN=.venv/bin
SEED=${DEMO_SEED:-771}
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
