#!/usr/bin/env bash
# The project's main job, run by `make demo` after `make setup`.
# It runs, end to end, the most complete real thing the packages can do today:
#   1. the eager-FRC schedule of a 4-stage pipeline, failed over after stage 2 dies mid-iteration;
#   2. real redundant training: 4 stages x 2 pipelines over gloo (8 processes), eager FRC with the stash swapped
#      to a CPU store, exact replica sync, checked against a single-process reference (bit-equal replicas);
#   3. what spot training would cost: Bamboo against checkpoint/restart and on-demand on the paper's EC2 p3 trace.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu PYTHONWARNINGS=ignore
BIN=.venv/bin
TRACE=../shared/traces/bamboo/p3-trace.csv

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1/3 schedule: 1F1B, P=4, M=4, eager FRC; stage 2 fails at its 9th instruction"
$BIN/bamboo-schedule show --stages 4 --microbatches 4 --rc eflb --fail 2@9

step "2/3 training: P=4 stages x D=2 pipelines, eflb, 5 steps, against a single-process reference"
$BIN/bamboo-rc verify --stages 4 --pipelines 2 --steps 5 --redundancy eflb 2> >(grep -v 'real_accelerator' >&2)

step "3/3 cost: bamboo vs checkpoint/restart vs on-demand on the EC2 p3 trace (GPT-2 profile)"
if [[ -f $TRACE ]]; then
  $BIN/bamboo-bench simulate --trace "$TRACE" --model gpt2 --strategy bamboo,checkpoint,on-demand
else
  echo "demo: $TRACE not found (the traces live in ../shared); simulating synthetic preemptions instead"
  $BIN/bamboo-bench simulate --synthetic --probability 0.1 --model gpt2 --strategy bamboo,checkpoint,on-demand
fi
