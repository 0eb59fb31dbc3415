#!/bin/bash
# Runs each experiment with each strategy at 1, 2 and 4 ranks, then compare.py over all CSVs.
# Inside an allocation (salloc, or as the body of an sbatch job) with at least 4 tasks:
#   bash hpc/sweep.sh [cpu|gpu] [extra run_*.py arguments...]
# SIZE=seed runs the seed report's models (gpt2-seed with GPT-2's BPE, 256 tokens; bert-seed, 46.7 M)
# instead of the quick defaults; SIZE=local runs them briefly (2 epochs of 5 steps, 2 samples per rank),
# sized for a 2-core machine; RANKS and STRATEGIES choose subsets.
set -uo pipefail
kind="${1:-cpu}"; shift || true
launcher="${FSDP_MPI_LAUNCHER:-srun}"           # as in hpc/launch.sh: srun, srun --mpi=pmi2, mpiexec, ...
out="${SWEEP_OUT:-results/sweep-$(date +%Y%m%d-%H%M%S)}"
strategies="fsdp-mpi ddp torch-fsdp lightning-ddp lightning-fsdp-mpi"
device="cpu"
if [ "$kind" = gpu ]; then strategies="$strategies lightning-fsdp"; device="cuda"; fi
strategies="${STRATEGIES:-$strategies}"         # a subset, e.g. STRATEGIES="fsdp-mpi ddp"
rank_counts="${RANKS:-1 2 4}"
for experiment in run_gpt2 run_bert; do
  size_args=()
  if [ "${SIZE:-default}" = seed ] || [ "${SIZE:-default}" = local ]; then
    if [ "$experiment" = run_gpt2 ]; then size_args=(--model gpt2-seed --seq-len 256 --tokenizer gpt2); else size_args=(--model bert-seed); fi
  fi
  if [ "${SIZE:-default}" = local ]; then
    size_args+=(--epochs 2 --steps-per-epoch 5 --batch-size 2 --val-steps 2)
  fi
  for ranks in $rank_counts; do
    for strategy in $strategies; do
      echo "== $experiment $strategy on $ranks ranks"
      $launcher -n "$ranks" python "experiments/$experiment.py" --strategy "$strategy" --device "$device" \
        --no-progress --out-dir "$out" "${size_args[@]}" "$@" || echo "!! $experiment $strategy on $ranks ranks failed"
    done
  done
done
python experiments/compare.py "$out"/*.csv --out-dir "$out/report"
