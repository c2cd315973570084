#!/usr/bin/env bash
# Seeded runs whose metrics.jsonl must not change when code moves without changing behaviour:
#
#   bash scripts/same_metrics.sh OUT [PY]         # runs them into OUT/ with this checkout (PY: its python)
#   python scripts/same_metrics.py OUT_A OUT_B    # compares two such folders, wall-clock fields aside
#
# The runs: SFT and a reward model (short; the starting points), the demo's PPO (6 ranks, reward model and rule
# reward), GRPO on vLLM's CPU engine, an asynchronous GRPO (one step stale) that checkpoints and resumes, and a
# multi-turn GRPO with the calculator environment.
set -euo pipefail
OUT=${1:?usage: same_metrics.sh OUT [PY]}
PY=${2:-.venv/bin/python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
QUIET="log.progress=false log.tensorboard=false checkpoint.resume=false"
run() { local name=$1; shift; echo "== $name"; "$PY" -m hpc_rlhf "$@" > "$OUT/$name.log" 2>&1 || {
  tail -30 "$OUT/$name.log"; exit 1; }; }

run sft sft --config examples/tiny/sft.yaml output_dir="$OUT/sft" $QUIET train.max_steps=150 log.eval_every_steps=150
run rm rm --config examples/tiny/rm.yaml output_dir="$OUT/rm" model.path="$OUT/sft/final" $QUIET \
  train.max_steps=100 log.eval_every_steps=100
run ppo ppo --config examples/tiny/ppo.yaml output_dir="$OUT/ppo" actor.path="$OUT/sft/final" \
  critic.path="$OUT/rm/final" "reward.models=[$OUT/rm/final]" $QUIET train.max_steps=6 log.eval_every_steps=3 \
  eval.max_rows=40
run grpo_vllm grpo --config examples/tiny/grpo.yaml output_dir="$OUT/grpo_vllm" actor.path="$OUT/sft/final" \
  placement=actor=1,ref=1,rollout=1 rollout.backend=vllm $QUIET train.max_steps=4 log.eval_every_steps=2 \
  eval.max_rows=40
run grpo_async grpo --config examples/tiny/grpo.yaml output_dir="$OUT/grpo_async" actor.path="$OUT/sft/final" \
  rl.max_staleness=1 $QUIET train.max_steps=3 checkpoint.every_steps=2 log.eval_every_steps=0
run grpo_async_resumed grpo --config examples/tiny/grpo.yaml output_dir="$OUT/grpo_async" \
  actor.path="$OUT/sft/final" rl.max_staleness=1 log.progress=false log.tensorboard=false checkpoint.resume=true \
  train.max_steps=5 checkpoint.every_steps=2 log.eval_every_steps=0
run grpo_calculator grpo --config examples/tiny/grpo_calculator.yaml output_dir="$OUT/grpo_calculator" \
  actor.path="$OUT/sft/final" $QUIET train.max_steps=4 log.eval_every_steps=2 eval.max_rows=40
echo "done: $OUT"
