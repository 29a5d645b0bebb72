#!/usr/bin/env bash
# The draft head's seed table (issues 47 and 48): `make smollm2` on SEEDS x ARMS, one run at a time, the
# arms of a seed back to back so that runs paired by seed share the box's speed of the hour.
#   ar      --rollout.speculative=null
#   ps      the config's chain: prior, suffix
#   head    prior, then the head at $HEAD (k=4), trained online each step
#   frozen  the same head, never trained (the ablation)
#   bubble  the same head, trained in the ranks' idle time (speculation.head_training: bubble)
# Resumable: a run with a DONE file is skipped, a partial one resumes from its last checkpoint (every
# 5 steps); a finished one keeps only its final checkpoint. After each run, `tools.simulate --run`
# replays it (simulate.txt; the calibration is cached).
# EXTRA="--section.key=value ..." is passed to every run (e.g. EXTRA=--task.num_test=4 for a short eval).
# usage (from the repository root): tools/seed_table.sh OUT_ROOT ["0 1 2 3"] ["ar ps head frozen"]
set -euo pipefail
out=${1:?usage: tools/seed_table.sh OUT_ROOT [seeds] [arms]}
seeds=${2:-0 1 2 3}
arms=${3:-ar ps head frozen}
head=${HEAD:-runs/head_smollm2}
bin=${BIN:-.venv/bin}
chain="[{method: prior, num_draft_tokens: 8}, {method: head, model: $head, num_draft_tokens: 4}]"
for seed in $seeds; do
  for arm in $arms; do
    dir=$out/${arm}_s$seed
    [ -f "$dir/DONE" ] && continue
    case $arm in
      ar) extra=(--rollout.speculative=null) ;;
      ps) extra=() ;;
      head) extra=("--rollout.speculative=$chain") ;;
      frozen) extra=("--rollout.speculative=$chain" --speculation.head_training=off) ;;
      bubble) extra=("--rollout.speculative=$chain" --speculation.head_training=bubble) ;;
      *) echo "tools/seed_table.sh: arm '$arm': expected one of ar, ps, head, frozen, bubble" >&2; exit 2 ;;
    esac
    read -ra more <<<"${EXTRA:-}"
    extra+=("${more[@]}")
    mkdir -p "$dir"
    echo "[seed_table] $(date -u +%FT%TZ) $arm seed $seed -> $dir"
    OMP_NUM_THREADS=1 "$bin/torchrun" --standalone --nproc_per_node=2 train.py \
      --config configs/smollm2_arith.yaml --run.seed="$seed" --run.out_dir="$dir" \
      --run.save_every=5 --run.resume=true "${extra[@]}" >>"$dir/train.log" 2>&1
    # done: only the final checkpoint is worth its gigabytes (a table of 16 runs kept two each, and filled a disk)
    ls -d "$dir"/checkpoints/step_* 2>/dev/null | head -n -1 | xargs -r rm -rf || true
    "$bin/python" -m tools.simulate --run "$dir" >"$dir/simulate.txt" 2>&1 || true
    touch "$dir/DONE"
  done
done
