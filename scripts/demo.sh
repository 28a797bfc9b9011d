#!/usr/bin/env bash
# The project's main job, run by `make demo` after `make setup`: Bamboo training on an emulated spot cluster,
# then Bamboo measured against checkpoint/restart and on-demand on the same market, and the simulator's long run.
#
# `bamboo-launch run` starts an embedded etcd, 8 emulated nodes in 3 zones (one agent process per node, each
# spawning its bamboo-rc worker), places them as P=4 stages x D=2 pipelines with bamboo-reconfig, trains the tiny
# GPT with the redundancy that `--redundancy auto` (the default) chooses for each layout from the measured step
# and the market's rate (lazy FRC for most layouts at this rate, eager where a layout's recovery favours it),
# and replays synthetic preemptions at the paper's highest replayed rate (33% per node per hour) compressed 60x (87 trace minutes in 87 s of training), timed from the first step:
# every removal SIGKILLs a node's process group, the runtime fails over, additions start new nodes that join at
# the next reconfiguration, and the final report compares the cost at spot and on-demand prices.
#
# Leases of 10 s (--ttl 10 --grace 10): eight workers importing torch at once on two cores can starve an agent or
# etcd itself for longer than the 2 s default, and a node declared failed by mistake is worse than a slower detection.
#
# The trace seed is fixed (DEMO_SEED, default 771) so the demo is repeatable. The trace is the synthetic model as
# is (no scripted kill): six preemptions and four additions. On the first layout (pipeline 0: node1 node4 node5
# node0; pipeline 1: node6 node2 node7 node3) it kills node7, node3, node4, node5, node9 (a joiner) and node0, one
# at a time: each kill is a separate, ordinary failover (the shadow takes the stage over, with its pause),
# followed by a reconfiguration of about 0.45 s that rebuilds redundancy ("rebuild redundancy"); the joiners
# come in as a new pipeline at a step boundary. node7 and node3 (stages 2 and 3 of pipeline 1, adjacent through
# the shadow ring) die 5.2 trace minutes apart: the seed was chosen when that was one consecutive failure
# (both inside one 10 s detection window); a killed node's closed connections are now seen at once, so the
# first failover and its rebuild are over before the second kill, and there is no consecutive pair any more.
# How many of them a run shows varies: the 500 steps can end before the last kills, and a kill that lands while
# a reconfiguration starts makes it start again without that node (its record says attempts 2) instead of
# failing over.
# Then the parameters are checked against a fault-free single-process run of the same steps (--verify: within 1e-6
# relative). --timeout 420 ends a run that hangs after 7 minutes.
#
# Part 2 measures the paper's headline comparison on the same market, briefly: `bamboo-bench compare` runs
# bamboo, the checkpoint/restart system users run today (torchrun elastic agents + DeepSpeed's PipelineEngine,
# a checkpoint every K steps by Young's rule, every membership change a restart from the last checkpoint) and
# on-demand nodes, each for 30 s after its first step on the first 30 trace minutes of the same trace (three
# kills and one addition), prints the table (throughput, node-hours, cost, value, steps redone, time lost,
# ratios) and the simulator's prediction of each run from the profile that run measured, side by side with the
# error; then the same measured profiles at full scale on the EC2 p3 trace, uncompressed. Part 3 is the
# simulator alone with the paper's GPT-2 constants on that trace. The latest figures of parts 1 and 2 are in
# docs/benchmarks.md (`demo` and `compare`), with the commands that print them; `make demo` takes about 5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu PYTHONWARNINGS=ignore
BIN=.venv/bin
SEED=${DEMO_SEED:-771}
OUT=${DEMO_OUT:-.cache/demo}
rm -rf "$OUT" && mkdir -p "$OUT"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1/3 bamboo-launch run: 8 nodes in 3 zones, P=4, D=2, tiny GPT, synthetic preemptions (rate 0.33/h, seed $SEED)"
$BIN/bamboo-launch run --nodes 8 --zones a,b,c --stages 4 --pipelines 2 --steps "${DEMO_STEPS:-500}" \
  --preemptions synthetic:0.33 --hours 1.45 --seed "$SEED" --time-scale 60 \
  --ttl 10 --grace 10 --timeout 420 --checkpoint-dir "$OUT/checkpoints" --run-dir "$OUT/run" --plot "$OUT/run.png" --verify

TRACE=../shared/traces/bamboo/p3-trace.csv
LONG_RUN=()
[[ -f $TRACE ]] && LONG_RUN=(--long-run "$TRACE")

step "2/3 bamboo vs checkpoint/restart vs on-demand, measured on the same market (seed $SEED, 30 s each) and predicted by the simulator from each run's measured profile"
$BIN/bamboo-bench compare --preemptions synthetic:0.33 --hours 1.45 --seed "$SEED" --zones a,b,c --time-scale 60 \
  --nodes 8 --stages 4 --pipelines 2 --duration "${DEMO_COMPARE_S:-30}" --timeout 300 --out "$OUT/compare" \
  --plot "$OUT/compare.png" "${LONG_RUN[@]}"

step "3/3 what the same spot market would cost over a long run with the paper's GPT-2 constants: bamboo vs checkpoint/restart vs on-demand (simulated, EC2 p3 trace)"
if [[ -f $TRACE ]]; then
  $BIN/bamboo-bench simulate --trace "$TRACE" --model gpt2 --strategy bamboo,checkpoint,on-demand
else
  echo "demo: $TRACE not found (the traces live in ../shared); simulating synthetic preemptions instead"
  $BIN/bamboo-bench simulate --synthetic --probability 0.1 --model gpt2 --strategy bamboo,checkpoint,on-demand
fi
