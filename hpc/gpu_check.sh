#!/bin/bash
# The GPU check of docs/gpu.md: installs fsdp_mpi as a GPU user would, then runs the GPU lane of the tests, the
# collectives through the node's shared device memory (CUDA IPC) and through MPI, every experiment on the GPU
# under mpiexec on 1 and 2 ranks (fp32, bf16-mixed, 16-mixed; fsdp-mpi, lightning-fsdp-mpi and, on one rank,
# the nccl baselines, which must refuse two ranks on one GPU) and the interleaved GPU benchmark.
# Every command's output goes to its own log in results/gpu-check-<date>/ (or $FSDP_MPI_GPU_CHECK_OUT), with a
# summary line per command.
#
#   bash hpc/gpu_check.sh                     # online: pip fetches what is missing, into .venv-gpu
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh
#       # the quick form, about 6 minutes on one GPU (an H200: 5.3 for the steps before the node-edges test): the GPU lane, the MFU table of issue 45 on one rank,
#       # bf16: gpt2 (16 x 1024 tokens a step) and gpt2-medium (8 x 1024) as plain torch eager, plain torch
#       # with the whole model compiled and fsdp-mpi compiled the same way, and BERT's step (bert-base,
#       # 32 x 128) as plain torch and fsdp-mpi, one round each (the full form: three); a 256 MiB collective table
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh pytest-gpu bench-bert
#       # only the steps named (as the summary names them): a machine lent for minutes runs the check in parts
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh seed-report
#       # the seed report on the GPU: run_gpt2.py and run_bert.py under every strategy on 1 rank and 2 sharing the
#       # GPU, three interleaved rounds, and compare.py's table and figures (seed/report/). Named only: 54 launches
#       # of 15-30 s each on an H200, about 9 minutes as two streams (FSDP_MPI_SEED_SCRIPTS=run_gpt2 on some cores,
#       # run_bert on others); FSDP_MPI_SEED_ROUNDS=1: one round
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh pytest-all
#       # README's test command, the whole suite, on parallel workers (pytest-xdist, FSDP_MPI_TEST_WORKERS): at
#       # most 9 minutes (FSDP_MPI_PYTEST_ALL_S cuts it sooner; -v, so a cut log still says what passed). Each test
#       # that passes goes into pytest-all-passed.txt; a later call given that file in FSDP_MPI_PYTEST_ALL_PASSED
#       # runs only the rest (the suite outgrew one call: about 500 launches, each about 10 s on the H200 image)
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh bench-mfu-blocks
#       # gpt2-medium with each block compiled, plain torch beside fsdp-mpi, and FSDP2: named only
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh impi-direct
#       # Intel MPI reading device memory itself (I_MPI_OFFLOAD=1): the collectives and the variants on its direct
#       # route, bit for bit the node transport's; node transport, direct and staged GB/s; GPT-2's step by route.
#       # Needs a trimmed Intel MPI (hpc/trim_impi.sh) in FSDP_MPI_IMPI (default .gpu/impi, or its .tar.xz). Named
#       # only, about 4 minutes
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh two-level
#       # 4 ranks sharing the GPU as 2 emulated nodes of 2 (FSDP_MPI_EMULATED_NODE_SIZE=2): the collectives in two
#       # levels on device memory (node transport inside, MPI staged across), and GPT-2's step in two levels
#       # against one flat staged ring. Named only, about 3 minutes
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh torch-distributed
#       # torch's own FSDP2 (fp32, bf16, HSDP) and DDP on the "fsdp_mpi" backend with 2 ranks sharing the GPU, and
#       # Lightning's DDPStrategy and FSDPStrategy on it (issue 61); GPT-2's step as FSDP2 on the backend beside
#       # fsdp-mpi, 2 ranks sharing the GPU. Named only, about 2 minutes
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh torch-test-base
#       # torch's own tests of a backend (DistributedTest._DistTestBase) on the fsdp_mpi backend, 2 ranks sharing the
#       # GPU (tests/test_torch_test_base.py's runner): counts and failures in torch-test-base.log. Named only
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh compiled-whole
#       # the whole model in one compiled graph (issue 62): gpt2 (16 x 1024) and gpt2-medium (8 x 1024), bf16,
#       # plain torch, fsdp-mpi and FSDP2 each compiled whole, on one rank and 2 ranks sharing the GPU; step s,
#       # first step s (the compile is in it), issued_s, MFU. Named only, up to 17 minutes (each run compiles
#       # first: on an H100 plain torch's compile took most of 110 s, and fsdp-mpi's did not finish in the rest):
#       # two calls, or one step alone: compiled-whole-gpt2
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh offload
#       # CPU offload (issue 76): gpt2-xl, bf16, one rank: plain torch, fsdp-mpi, fsdp-mpi+offload (shards,
#       # gradients and optimizer state in host memory), the same with the optimizer stepped inside backward on a
#       # host thread, and torch FSDP2 with CPUOffloadPolicy; peak GPU MB and step s. Named only, about 6 minutes
#   FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh offload-two-ranks
#       # the same offloaded runs on 2 ranks sharing the GPU, FSDP2 through the fsdp_mpi backend, and fsdp-mpi's
#       # with the copies the host waits for (+sync_copies: what the copy streams save). Named only
#   FSDP_MPI_GPU_CHECK_DRY=1 FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh seed-report compiled-whole
#       # prints each step's name and command line instead of running it (installs nothing, needs no GPU): what a
#       # loan will run, read before it starts. tests/test_gpu_check.py holds every command to its script's parser
#   FSDP_MPI_WHEELS=/path/to/wheels bash hpc/gpu_check.sh
#       # offline: wheels for this machine's Python (at least mpich and mpi4py; others the image lacks),
#       # downloaded elsewhere with `pip download --only-binary=:all: --python-version X.Y ...`. They go under
#       # a prefix (not a virtual environment), the checkout on PYTHONPATH, as ../shared/GPU-NOTES.md found works.
#
# Uses the torch already installed (a CUDA build). FSDP_MPI_DATA_DIR must hold the corpora (../shared/data's
# layout) for the experiments of the full form.
set -uo pipefail
cd "$(dirname "$0")/.."
dry="${FSDP_MPI_GPU_CHECK_DRY:-0}"
if [ "$dry" = 1 ]; then  # the commands on stdout; the logs and tables, empty, in a folder of their own
    out="$(mktemp -d)"
    trap 'rm -rf "$out"' EXIT
else
    out="${FSDP_MPI_GPU_CHECK_OUT:-results/gpu-check-$(date +%Y%m%d-%H%M%S)}"
fi
mkdir -p "$out"
summary="$out/summary.txt"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" FSDP_MPI_TIMEOUT="${FSDP_MPI_TIMEOUT:-120}" PYTHONUNBUFFERED=1
quick="${FSDP_MPI_GPU_CHECK_QUICK:-0}"
only=" $* "  # the steps to run; all of the form's when none is named
if [ -n "${FSDP_MPI_PYTEST_ALL_PASSED:-}" ] && [ ! -f "$FSDP_MPI_PYTEST_ALL_PASSED" ]; then  # not a whole rerun
    echo "FSDP_MPI_PYTEST_ALL_PASSED names no file: $FSDP_MPI_PYTEST_ALL_PASSED (an earlier pytest-all-passed.txt)" >&2
    exit 2
fi

if [ "$dry" = 1 ]; then
    libmpi="" PY=python
elif [ -n "${FSDP_MPI_WHEELS:-}" ]; then
    prefix="${FSDP_MPI_PREFIX:-$PWD/.gpu-prefix}"
    [ -x "$prefix/bin/mpiexec" ] || python3 -m pip install --no-index --no-deps --no-compile --prefix "$prefix" \
        "$FSDP_MPI_WHEELS"/*.whl > "$out/install.log" 2>&1 || { echo "install failed: see $out/install.log"; exit 1; }
    site="$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '$prefix', 'platbase': '$prefix'}))")"
    export PATH="$prefix/bin:$PATH" PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    ln -sfn "$PWD/models" "$site/fsdp_mpi_models"  # the checkout's models/ under the name setup.cfg installs
    export FSDP_MPI_MPIEXEC="$prefix/bin/mpiexec"  # not an mpiexec that the image may have beside its Python
    libmpi="$prefix/lib/libmpi.so.12"
    PY=python3
else
    venv="${FSDP_MPI_VENV:-.venv-gpu}"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv --system-site-packages "$venv"
        "$venv/bin/pip" install -e ".[mpich,experiments]" > "$out/install.log" 2>&1 \
            || { echo "install failed: see $out/install.log"; exit 1; }
    fi
    source "$venv/bin/activate"
    libmpi="$(python -c 'import sysconfig; print(sysconfig.get_paths()["data"])')/lib/libmpi.so.12"
    PY=python
fi
# mpi4py must load the wheel's MPICH, not an MPI the image brings (docs/gpu.md, "Checking a cluster's MPI").
[ -e "$libmpi" ] && export MPI4PY_MPIABI=mpich MPI4PY_LIBMPI="$libmpi" LD_LIBRARY_PATH="$(dirname "$libmpi"):${LD_LIBRARY_PATH:-}"
mpiexec="${FSDP_MPI_MPIEXEC:-mpiexec}"

expand() {  # expand GROUP STEP...: naming a group names each of its steps, which can also be named alone
    [[ "$only" != *" $1 "* ]] || only="$only ${*:2} "
}

run() {  # run NAME SECONDS COMMAND...: one logged command under a hard time limit; its exit code in the summary
    local name="$1" seconds="$2"; shift 2
    [ "$only" = "  " ] || [[ "$only" == *" $name "* ]] || return 0
    if [ "$dry" = 1 ]; then printf '%s %s' "$name" "$seconds"; printf ' %q' "$@"; echo; return 0; fi
    local start=$SECONDS
    timeout -s KILL "$seconds" "$@" > "$out/$name.log" 2>&1 < /dev/null
    local code=$?
    printf '%-48s exit %3d  %4d s\n' "$name" "$code" "$((SECONDS - start))" | tee -a "$summary"
}

route="from fsdp_mpi.communication.machinery.mpi_library import cuda_awareness, describe_device_path; "
route+="print(describe_device_path(cuda_awareness(), False))"  # the route device buffers take, and why
[ "$dry" = 1 ] || { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  $PY -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
  $PY -c "$route"
  # What each of the tests' hundreds of launches pays before its first step, which decides whether README's tests
  # fit one call of a lent machine (the last H200 image took about 10 s a launch; the CPU machine about 1 s)
  TIMEFORMAT="import torch: %R s"; time $PY -c "import torch"
  TIMEFORMAT="import fsdp_mpi: %R s"; time $PY -c "import fsdp_mpi"
  TIMEFORMAT="2 ranks launched to a Communicator: %R s"
  time timeout 60 "$mpiexec" -n 2 $PY -c "import fsdp_mpi; fsdp_mpi.Communicator()"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt" 2> /dev/null

# The seed report on a GPU (issues 63, 77), named only: run_gpt2.py and run_bert.py on the seed's models (gpt2-seed
# with GPT-2's BPE, 256 tokens; bert-seed), bf16, 32 samples a step whatever the ranks, 2 epochs of 30 steps (the
# first warms up), each strategy as its user launches it: fsdp-mpi and Lightning with fsdp_mpi's strategy on 1 rank
# and on 2 sharing the GPU; DDP (plain torch on one rank), Lightning DDP and torch FSDP2 on one rank (nccl); Lightning
# DDP and FSDP2 on 2 ranks sharing the GPU over the "fsdp_mpi" backend (nccl refuses that). FSDP_MPI_SEED_ROUNDS
# rounds (default 3), interleaved: every strategy once per round, so that a drift of the machine falls on all alike;
# each run's id ends in its round. FSDP_MPI_SEED_SCRIPTS names the scripts (default both: "run_gpt2 run_bert"), so
# that the two can run as two streams on cores of their own. compare.py makes the table (medians and min-max over the rounds) and figures in
# seed/report/. 15-30 s a launch on an H200's 4 cores (Lightning's the longest): 18 launches a round.
if [[ "$only" == *" seed-report "* ]]; then
    seed="$out/seed"
    each="--device cuda --precision bf16-mixed --epochs 2 --steps-per-epoch 30 --val-steps 4 --no-progress"
    for round in $(seq 1 "${FSDP_MPI_SEED_ROUNDS:-3}"); do
        for script in ${FSDP_MPI_SEED_SCRIPTS:-run_gpt2 run_bert}; do
            size=(--model gpt2-seed --seq-len 256 --tokenizer gpt2)
            [ "$script" = run_bert ] && size=(--model bert-seed)
            for job in fsdp-mpi:1 fsdp-mpi:2 ddp:1 lightning-ddp:1 lightning-fsdp-mpi:1 lightning-fsdp-mpi:2 \
                       torch-fsdp:1 lightning-ddp:2:fsdp_mpi torch-fsdp:2:fsdp_mpi; do
                IFS=: read -r strategy ranks backend <<< "$job"
                name="seed-$script-$strategy-n$ranks-r$round"
                only="$only $name "
                run "$name" 60 "$mpiexec" -n "$ranks" $PY "experiments/$script.py" "${size[@]}" $each \
                    --out-dir "$seed" --run-id "$name" --strategy "$strategy" --batch-size $((32 / ranks)) \
                    ${backend:+--backend $backend}
            done
        done
    done
    only="$only seed-compare "
    run seed-compare 60 $PY experiments/compare.py "$seed"/*.csv --out-dir "$seed/report"
    cat "$seed/report/summary.md" 2> /dev/null
fi

# The GPU lane of the tests: device code for real on 2 ranks (node transport, staged path, the worker thread,
# the variants bit for bit, GPT-2 against one process in fp32 and bf16, a bit-exact resume, run_gpt2.py), and the
# node transport's edges on 4 ranks sharing the GPU (3 ranks, HYBRID_SHARD's two groups at once, the memory given
# back and counted, IPC refused on one rank: issue 66).
run pytest-gpu 200 $PY -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_gpu.py -k "not fsdp_mpi_backend"

# README's test command, the whole suite, on the GPU machine (issue 44): its tests spread over parallel workers
# (pytest-xdist, in the test extra; FSDP_MPI_TEST_WORKERS of them, default 8, each test up to 4 ranks), so that it
# fits one call of a machine lent for minutes: 8 workers on an H200 node's 16 cores took 504 s, 300 of them one
# test's timeout. Where it does not, a second call goes on from the first's pytest-all-passed.txt (conftest.py's
# FSDP_MPI_TESTS_PASSED: the tests that passed are left out, and count as passed for the mutants that name them).
# Not in the quick form unless named: `... gpu_check.sh pytest-all`.
if [ "$quick" != 1 ] || [[ "$only" == *" pytest-all "* ]]; then
    workers=()
    $PY -c "import xdist" 2> /dev/null && workers=(-n "${FSDP_MPI_TEST_WORKERS:-8}")
    passed="$out/pytest-all-passed.txt"
    [ -z "${FSDP_MPI_PYTEST_ALL_PASSED:-}" ] || [ "$dry" = 1 ] || cp "$FSDP_MPI_PYTEST_ALL_PASSED" "$passed"
    run pytest-all "${FSDP_MPI_PYTEST_ALL_S:-540}" env FSDP_MPI_TESTS_PASSED="$passed" \
        $PY -m pytest -v -rs "${workers[@]}" -p no:cacheprovider --junitxml="$out/pytest-all.xml"
fi

# Issue 45's MFU table on one rank: eager beside the whole model compiled (inductor; the first of the warm-up
# steps compiles), plain torch and fsdp-mpi compiled the same way; BERT's step time beside them.
compiled=plain:bf16-mixed,plain+compile_whole:bf16-mixed,fsdp-mpi+compile_whole:bf16-mixed@1
mfu="--device cuda --seq-len 1024 --ranks 1 --steps 5 --warmup 2 --rounds"
if [ "$quick" = 1 ]; then
    run bench-mfu-gpt2 120 $PY experiments/bench.py $mfu 1 --model gpt2 --batch-size 16 --out "$out/mfu-gpt2.csv" \
        --strategies $compiled
    run bench-mfu-gpt2-medium 170 $PY experiments/bench.py $mfu 1 --model gpt2-medium --batch-size 8 \
        --out "$out/mfu-gpt2-medium.csv" --strategies $compiled
    run bench-bert 45 $PY experiments/bench.py --device cuda --model bert-base --seq-len 128 --batch-size 32 \
        --ranks 1 --steps 10 --warmup 2 --rounds 1 --out "$out/bert.csv" --strategies plain:bf16-mixed,fsdp-mpi:bf16-mixed@1
    # Named only (it would take the quick form past 6 minutes): gpt2-medium with each block compiled in place,
    # plain torch and fsdp-mpi alike (the form in which their graphs are the same), and FSDP2 on one rank.
    if [[ "$only" == *" bench-mfu-blocks "* ]]; then
        run bench-mfu-blocks 200 $PY experiments/bench.py $mfu 1 --model gpt2-medium --batch-size 8 \
            --out "$out/mfu-blocks.csv" \
            --strategies plain+compile:bf16-mixed,fsdp-mpi+compile:bf16-mixed@1,torch-fsdp:bf16-mixed@1
    fi
    awk '/^\| strategy \| precision/ {table = 1} table && /^$/ {table = 0; print ""} table' \
        "$out"/bench-mfu-*.log "$out"/bench-bert.log 2> /dev/null | tee "$out/mfu.md"
fi
# Intel MPI as a CUDA-aware MPI (issue 59), named only: its own launcher and library (hpc/impi_env.sh) with GPU
# offload on, in a subshell, so that what follows runs under the MPI the check started with.
expand impi-direct impi-machine impi-gpu-lane impi-bench-comm impi-gpt2
if [[ "$only" == *" impi-"* ]]; then
    impi="${FSDP_MPI_IMPI:-.gpu/impi}"
    [ -d "$impi" ] || [ ! -f "$impi.tar.xz" ] || [ "$dry" = 1 ] || tar -xJf "$impi.tar.xz" -C "$(dirname "$impi")"
    (
        [ "$dry" = 1 ] || source hpc/impi_env.sh "$impi"
        export I_MPI_OFFLOAD=1 mpiexec="$impi/bin/mpiexec"
        run impi-machine 30 $PY -c "$route"
        cat "$out/impi-machine.log" 2> /dev/null
        run impi-gpu-lane 100 $PY -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_gpu.py \
            -k "collectives_on_the_gpu or staging_chunking"
        run impi-bench-comm 60 "$mpiexec" -n 2 $PY experiments/bench_comm.py --device cuda --sizes-mb 1,16,256 \
            --rounds 3 --repeats 5 --out "$out/impi-bench-comm.csv"
        run impi-gpt2 80 $PY experiments/bench.py --device cuda --model gpt2 --seq-len 1024 --batch-size 16 \
            --same-global-batch --ranks 2 --steps 5 --warmup 2 --rounds 1 --out "$out/impi-gpt2.csv" \
            --strategies plain:bf16-mixed@1,fsdp-mpi:bf16-mixed,fsdp-mpi+mpi:bf16-mixed
    )
fi

# Two levels on a GPU (issue 60), named only: 4 ranks on the GPU as 2 emulated nodes of 2.
expand two-level two-level-collectives two-level-gpt2
if [[ "$only" == *" two-level-"* ]]; then
    run two-level-collectives 100 env FSDP_MPI_EMULATED_NODE_SIZE=2 "$mpiexec" -n 4 $PY tests/workers/collectives.py \
        "$out/two-level-collectives.json" --device cuda
    run two-level-gpt2 120 env FSDP_MPI_EMULATED_NODE_SIZE=2 $PY experiments/bench.py --device cuda --model gpt2 \
        --seq-len 1024 --batch-size 16 --same-global-batch --ranks 4 --steps 4 --warmup 2 --rounds 1 \
        --out "$out/two-level-gpt2.csv" --strategies fsdp-mpi:bf16-mixed,fsdp-mpi+flat:bf16-mixed
fi

# torch.distributed on fsdp_mpi (issue 61), named only: the GPU lane's tests of the backend (left out of
# pytest-gpu above), and FSDP2 over it against fsdp-mpi, 2 ranks sharing the GPU (which nccl refuses).
expand torch-distributed torch-distributed-tests torch-distributed-gpt2
if [[ "$only" == *" torch-distributed-"* ]]; then
    run torch-distributed-tests 150 $PY -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_gpu.py \
        -k fsdp_mpi_backend
    run torch-distributed-gpt2 120 env CUDA_VISIBLE_DEVICES=0 $PY experiments/bench.py --device cuda --model gpt2 \
        --seq-len 1024 --batch-size 16 --same-global-batch --ranks 2 --steps 4 --warmup 2 --rounds 1 \
        --out "$out/torch-distributed-gpt2.csv" --strategies fsdp-mpi:bf16-mixed,torch-fsdp+backend=fsdp_mpi:bf16-mixed
fi

# torch's own tests of a process-group backend (issue 71) on 2 ranks sharing the GPU, named only: the CPU ones,
# and of torch's CUDA ones those it lets run with one GPU for two ranks. expecttest (torch's test utilities need
# it) comes with the wheels where the image lacks it.
if [[ "$only" == *" torch-test-base "* ]]; then
    run torch-test-base 240 $PY tests/harness/torch_test_jobs.py fsdp_mpi 2 "$out/torch-test-base"
fi

# The whole model in one compiled graph (issue 62), named only: plain torch, fsdp-mpi (gathers and reductions
# traced into the graph) and FSDP2, each compiled whole, bf16, fused AdamW; on one rank, and 2 ranks sharing the
# GPU on the same global batch (FSDP2 on the "fsdp_mpi" backend there: nccl refuses to share a GPU).
expand compiled-whole compiled-whole-gpt2 compiled-whole-gpt2-medium compiled-whole-gpt2-2 compiled-whole-gpt2-medium-2
if [[ "$only" == *" compiled-whole-"* ]]; then
    whole="plain+compile_whole:bf16-mixed,fsdp-mpi+compile_whole:bf16-mixed@1,torch-fsdp+compile_whole:bf16-mixed@1"
    shared="plain+compile_whole:bf16-mixed,fsdp-mpi+compile_whole:bf16-mixed"
    shared="$shared,torch-fsdp+compile_whole+backend=fsdp_mpi:bf16-mixed"
    run compiled-whole-gpt2 300 $PY experiments/bench.py $mfu 1 --model gpt2 --batch-size 16 \
        --out "$out/compiled-whole-gpt2.csv" --strategies $whole
    run compiled-whole-gpt2-medium 300 $PY experiments/bench.py $mfu 1 --model gpt2-medium --batch-size 8 \
        --out "$out/compiled-whole-gpt2-medium.csv" --strategies $whole
    two="--device cuda --seq-len 1024 --ranks 2 --same-global-batch --steps 5 --warmup 2 --rounds 1"
    run compiled-whole-gpt2-2 200 $PY experiments/bench.py $two --model gpt2 --batch-size 16 \
        --out "$out/compiled-whole-gpt2-2.csv" --strategies $shared
    run compiled-whole-gpt2-medium-2 200 $PY experiments/bench.py $two --model gpt2-medium --batch-size 8 \
        --out "$out/compiled-whole-gpt2-medium-2.csv" --strategies $shared
    awk '/^\| strategy \| precision/ {table = 1} table && /^$/ {table = 0; print ""} table' \
        "$out"/compiled-whole-*.log 2> /dev/null | tee "$out/compiled-whole.md"
fi

# CPU offload (issue 76): gpt2-xl, bf16, one rank: plain torch, fsdp-mpi, fsdp-mpi with the shards, their
# gradients and the optimizer state in host memory (the optimizer stepped after backward, and inside it on a host
# thread), and torch FSDP2's CPUOffloadPolicy; peak GPU MB and step s side by side.
if [[ "$only" == *" offload "* ]]; then
    run offload 420 $PY experiments/bench.py --device cuda --seq-len 1024 --steps 3 --warmup 1 --rounds 1 --ranks 1 \
        --model gpt2-xl --batch-size 4 --out "$out/offload.csv" \
        --strategies plain:bf16-mixed,fsdp-mpi:bf16-mixed,fsdp-mpi+offload:bf16-mixed,fsdp-mpi+offload+step_in_backward:bf16-mixed,torch-fsdp+offload:bf16-mixed
fi
if [[ "$only" == *" offload-two-ranks "* ]]; then
    run offload-two-ranks 420 $PY experiments/bench.py --device cuda --seq-len 1024 --steps 3 --warmup 1 --rounds 1 \
        --ranks 2 --model gpt2-xl --batch-size 4 --out "$out/offload-two-ranks.csv" \
        --strategies fsdp-mpi+offload:bf16-mixed,fsdp-mpi+offload+sync_copies:bf16-mixed,fsdp-mpi+offload+step_in_backward:bf16-mixed,fsdp-mpi+offload+step_in_backward+sync_copies:bf16-mixed,torch-fsdp+offload+backend=fsdp_mpi:bf16-mixed
fi

# The collectives at 256 MiB: through the node's shared device memory, through MPI (staged), raw MPI on host.
run bench-comm-gpu 60 "$mpiexec" -n 2 $PY experiments/bench_comm.py --device cuda --sizes-mb 256 --rounds 3 \
    --repeats 5 --out "$out/bench-comm.csv"

if [ "$quick" = 1 ]; then
    echo "logs, CSVs and summary in $out"
    exit 0
fi
run bench-mfu-gpt2 400 $PY experiments/bench.py $mfu 3 --model gpt2 --batch-size 16 --out "$out/mfu-gpt2.csv" \
    --strategies $compiled,fsdp-mpi:bf16-mixed@1,fsdp-mpi+compile:bf16-mixed@1,torch-fsdp:bf16-mixed@1
run bench-mfu-gpt2-medium 450 $PY experiments/bench.py $mfu 3 --model gpt2-medium --batch-size 8 \
    --out "$out/mfu-gpt2-medium.csv" \
    --strategies $compiled,fsdp-mpi:bf16-mixed@1,fsdp-mpi+compile:bf16-mixed@1,torch-fsdp:bf16-mixed@1
run bench-bert 150 $PY experiments/bench.py --device cuda --model bert-base --seq-len 128 --batch-size 32 \
    --ranks 1 --steps 10 --warmup 3 --rounds 3 --out "$out/bert.csv" \
    --strategies plain:bf16-mixed,plain+compile_whole:bf16-mixed,fsdp-mpi:bf16-mixed@1,torch-fsdp:bf16-mixed@1

# The interleaved GPU benchmark: one process against 2 ranks sharing the GPU on the same global batch, through
# the node transport and through MPI (fsdp-mpi+mpi), and FSDP2 (nccl) on one rank.
bench="--device cuda --model gpt2 --seq-len 1024 --same-global-batch --ranks 2 --batch-size 16"
run bench-gpu 600 $PY experiments/bench.py $bench --rounds 3 --steps 10 --warmup 3 --out "$out/bench.csv" \
    --strategies plain:bf16-mixed,fsdp-mpi:bf16-mixed@1,fsdp-mpi:bf16-mixed,fsdp-mpi+mpi:bf16-mixed,torch-fsdp:bf16-mixed@1
overlapped=fsdp-mpi+forward_prefetch+backward_prefetch+async_reduce_scatter
run bench-gpu-prefetch 600 $PY experiments/bench.py $bench --rounds 3 --steps 10 --warmup 3 \
    --out "$out/bench-prefetch.csv" --strategies plain:bf16-mixed,fsdp-mpi:bf16-mixed,$overlapped:bf16-mixed

# The experiments on the GPU.
tiny="--device cuda --epochs 1 --steps-per-epoch 20 --val-steps 5 --no-progress --out-dir $out/csv"
for ranks in 1 2; do
    for script in run_gpt2 run_bert; do
        for precision in 32 bf16-mixed 16-mixed; do
            run "$script-fsdp-mpi-n$ranks-$precision" 600 \
                "$mpiexec" -n "$ranks" $PY "experiments/$script.py" $tiny --strategy fsdp-mpi --precision "$precision"
        done
        run "$script-lightning-fsdp-mpi-n$ranks" 600 \
            "$mpiexec" -n "$ranks" $PY "experiments/$script.py" $tiny --strategy lightning-fsdp-mpi --precision bf16-mixed
    done
    for strategy in ddp torch-fsdp lightning-ddp lightning-fsdp; do  # nccl: one GPU per rank, else a refusal
        run "run_gpt2-$strategy-n$ranks" 600 \
            "$mpiexec" -n "$ranks" $PY experiments/run_gpt2.py $tiny --strategy "$strategy" --precision bf16-mixed
    done
done
echo "logs, CSVs and summary in $out"
