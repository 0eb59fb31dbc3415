#!/usr/bin/env bash
# Strategies on a slow network, on 2 nodes x 2 ranks of hpc/cluster, at each link rate:
#   bench    fair interleaved rounds of every strategy (experiments/bench.py), then one table and a figure
#            of step time against link rate (experiments/network_report.py);
#   predict  the cost model against the same runs (experiments/predict.py validate: fsdp-mpi's strategies
#            measured beside their prediction from a profile taken under the job's load and collectives timed
#            on the cluster).
# Starts and stops its own cluster.
#
#   bash hpc/cluster/network_bench.sh        (RATES="none 10gbit 1gbit" ROUNDS=3 WHAT="bench predict" OUT=results/network
#                                             STRATEGIES=bench.py's list, fsdp-mpi+flat: FULL_SHARD in one flat ring)
#
# Extra arguments go to bench.py (e.g. --model gpt2-tiny --vocab-size 128 for a quick look).
set -euo pipefail
cd "$(dirname "$0")/../.."
RATES=${RATES:-none 10gbit 1gbit}
OUT=${OUT:-results/network}
WHAT=${WHAT:-bench predict}
HERE=$PWD/hpc/cluster
mkdir -p "$OUT"
bash "$HERE/cluster.sh" stop
bash "$HERE/cluster.sh" start --nodes 2 >/dev/null
trap 'bash "$HERE/cluster.sh" stop' EXIT
export MPICH_CH4_NETMOD=ofi FI_PROVIDER=tcp
export FSDP_MPI_MPIEXEC="mpiexec -hosts fmnode0:2,fmnode1:2 -launcher ssh -launcher-exec $HERE/ssh.sh"
MODEL=(--model gpt2-seed --batch-size 2 --seq-len 128 --steps 2 --warmup 1)
for rate in $RATES; do
  bash "$HERE/cluster.sh" rate "$rate"
  if [[ " $WHAT " == *" bench "* ]]; then
    echo "=== bench, links limited to: $rate"
    bash "$HERE/cluster.sh" exec fmnode0 python experiments/bench.py --ranks 4 --rounds "${ROUNDS:-3}" "${MODEL[@]}" \
      --strategies "${STRATEGIES:-fsdp-mpi,fsdp-mpi+flat,fsdp-mpi+SHARD_GRAD_OP,fsdp-mpi+HYBRID_SHARD,fsdp-mpi+NO_SHARD,ddp,torch-fsdp}" \
      --out "$OUT/bench-$rate.csv" "$@"
  fi
  if [[ " $WHAT " == *" predict "* ]]; then
    echo "=== cost model, links limited to: $rate"
    bash "$HERE/cluster.sh" exec fmnode0 python experiments/predict.py validate --ranks 4 --rounds "${ROUNDS:-3}" \
      "${MODEL[@]}" --repeats 2 --out-dir "$OUT/predict-$rate"
  fi
done
if [[ " $WHAT " == *" bench "* ]]; then
  python experiments/network_report.py "$OUT" $RATES
fi
