#!/bin/bash
# The GPU check of docs/gpu.md: installs fsdp_mpi as a GPU user would, then runs every experiment on the
# GPU under mpiexec on 1 and 2 ranks (fp32, bf16-mixed, 16-mixed; fsdp-mpi, lightning-fsdp-mpi and, on one
# rank, the nccl baselines, which must refuse two ranks on one GPU) and the interleaved GPU benchmark.
# Every command's output goes to its own log in results/gpu-check-<date>/, with a summary line per command.
#
#   bash hpc/gpu_check.sh                     # online: pip fetches what is missing
#   FSDP_MPI_WHEELS=/path/to/wheels bash hpc/gpu_check.sh
#       # offline: a folder of wheels for this machine's Python (mpich, mpi4py, tokenizers, lightning, ...),
#       # downloaded elsewhere with `pip download --only-binary=:all: --python-version X.Y ...`
#
# Uses the torch already installed (a CUDA build): the virtual environment sees the system's packages.
# FSDP_MPI_DATA_DIR must hold the corpora (../shared/data's layout); FSDP_MPI_GPU_CHECK_QUICK=1 runs only
# what the tests cannot show (one precision per script, the benchmark's shortest form).
set -uo pipefail
cd "$(dirname "$0")/.."
out="results/gpu-check-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
summary="$out/summary.txt"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" FSDP_MPI_TIMEOUT="${FSDP_MPI_TIMEOUT:-120}" PYTHONUNBUFFERED=1

venv="${FSDP_MPI_VENV:-.venv-gpu}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv --system-site-packages "$venv"
    if [ -n "${FSDP_MPI_WHEELS:-}" ]; then
        "$venv/bin/pip" install --no-index --find-links "$FSDP_MPI_WHEELS" -e ".[mpich,experiments]" \
            > "$out/install.log" 2>&1
    else
        "$venv/bin/pip" install -e ".[mpich,experiments]" > "$out/install.log" 2>&1
    fi || { echo "install failed: see $out/install.log"; exit 1; }
fi
source "$venv/bin/activate"
# mpi4py must load the wheel's MPICH, not an MPI the image brings (docs/gpu.md, "Checking a cluster's MPI").
libmpi="$(python -c 'import sysconfig; print(sysconfig.get_paths()["data"])')/lib/libmpi.so.12"
[ -e "$libmpi" ] && export MPI4PY_MPIABI=mpich MPI4PY_LIBMPI="$libmpi" LD_LIBRARY_PATH="$(dirname "$libmpi"):${LD_LIBRARY_PATH:-}"

run() {  # run NAME SECONDS COMMAND...: one logged command under a hard time limit; its exit code in the summary
    local name="$1" seconds="$2"; shift 2
    local start=$SECONDS
    timeout -s KILL "$seconds" "$@" > "$out/$name.log" 2>&1 < /dev/null
    local code=$?
    printf '%-48s exit %3d  %4d s\n' "$name" "$code" "$((SECONDS - start))" | tee -a "$summary"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
  python -c "from fsdp_mpi.communication.gpu_support import describe_device_path as d, mpi_is_cuda_aware as a; print(d(a(), False))"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

# The GPU tests of the suite (they skip on a machine without CUDA).
run pytest-gpu 600 python -m pytest -q -rs -k "cuda or device" tests/test_comm.py

# E: the experiments on the GPU.
precisions="32 bf16-mixed 16-mixed"
[ "${FSDP_MPI_GPU_CHECK_QUICK:-0}" = 1 ] && precisions="bf16-mixed"
tiny="--device cuda --epochs 1 --steps-per-epoch 20 --val-steps 5 --no-progress --out-dir $out/csv"
for ranks in 1 2; do
    for script in run_gpt2 run_bert; do
        for precision in $precisions; do
            run "$script-fsdp-mpi-n$ranks-$precision" 600 \
                mpiexec -n "$ranks" python "experiments/$script.py" $tiny --strategy fsdp-mpi --precision "$precision"
        done
        run "$script-lightning-fsdp-mpi-n$ranks" 600 \
            mpiexec -n "$ranks" python "experiments/$script.py" $tiny --strategy lightning-fsdp-mpi --precision bf16-mixed
    done
    for strategy in ddp torch-fsdp lightning-ddp lightning-fsdp; do  # nccl: one GPU per rank, else a refusal
        run "run_gpt2-$strategy-n$ranks" 600 \
            mpiexec -n "$ranks" python experiments/run_gpt2.py $tiny --strategy "$strategy" --precision bf16-mixed
    done
done

# F: the interleaved GPU benchmark (plain torch, fsdp-mpi, FSDP2 where each rank has its own GPU).
# One process against 2 ranks sharing the GPU on the same global batch, and FSDP2 (nccl) on one rank.
bench="--device cuda --model gpt2 --seq-len 1024 --rounds 3 --steps 10 --warmup 3 --same-global-batch"
run bench-gpu 600 python experiments/bench.py $bench --ranks 2 --batch-size 16 --out "$out/bench.csv" \
    --strategies plain:bf16-mixed,fsdp-mpi:bf16-mixed@1,fsdp-mpi:bf16-mixed,torch-fsdp:bf16-mixed@1
overlapped=fsdp-mpi+forward_prefetch+backward_prefetch+async_reduce_scatter
run bench-gpu-prefetch 600 python experiments/bench.py $bench --ranks 2 --batch-size 16 \
    --out "$out/bench-prefetch.csv" --strategies plain:bf16-mixed,fsdp-mpi:bf16-mixed,$overlapped:bf16-mixed
# The stretch target: compiled blocks, gpt2-medium on one GPU (>= 35% bf16 MFU, faster than FSDP2).
run bench-gpu-compiled 600 python experiments/bench.py --device cuda --model gpt2-medium --seq-len 1024 --rounds 3 \
    --steps 10 --warmup 3 --ranks 1 --batch-size 8 --out "$out/bench-compiled.csv" \
    --strategies plain+compile:bf16-mixed,fsdp-mpi+compile:bf16-mixed@1,fsdp-mpi:bf16-mixed@1,torch-fsdp:bf16-mixed@1
echo "logs, CSVs and summary in $out"
