#!/bin/bash
# A GPU loan's plan, rebuilt from scratch on a CPU machine that reaches a package index (issue 94): the folder a
# device call carries beside the checkout (at most 64 MiB), and the calls that then run hpc/gpu_check.sh with it,
# in the order a loan takes them.
#
#   bash hpc/gpu_carry.sh                            # builds .gpu/ (git-ignored) and prints the loan's calls
#   FSDP_MPI_GPU_CARRY_DRY=1 bash hpc/gpu_carry.sh   # prints every command instead of running it, then the calls
#
# What .gpu/ holds, what a GPU image without a package index lacks (../shared/GPU-NOTES.md):
#   wheels/       mpich, mpi4py, expecttest (torch-test-base) and accelerate (Accelerate over the backend) for the
#                 image's Python (FSDP_MPI_GPU_PYTHON: 3.12 on the images lent so far), without their
#                 dependencies: the image brings torch, transformers and the rest
#   data/         the corpora, copied from FSDP_MPI_DATA_DIR (default ../shared/data)
#   impi.tar.xz   Intel MPI from the impi-rt wheel, trimmed by hpc/trim_impi.sh (gpu_check.sh impi-direct
#                 unpacks it there)
# Each piece's size and the total are printed; a total over 64 MiB stops it with exit 1.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu
python_version="${FSDP_MPI_GPU_PYTHON:-3.12}"
data="${FSDP_MPI_DATA_DIR:-../shared/data}"
dry="${FSDP_MPI_GPU_CARRY_DRY:-0}"
limit=$((64 * 1024 * 1024))  # the most one device call carries
step() { echo "+ $*"; [ "$dry" = 1 ] || "$@"; }

if [ ! -f "$data/README.md" ]; then
    echo "no corpora in $data: set FSDP_MPI_DATA_DIR to a folder laid out as ../shared/data" >&2
    exit 2
fi
impi_prefix="$dest/impi-wheel"  # the whole impi-rt install (82 MB), removed once trimmed
step rm -rf "$dest/wheels" "$dest/data" "$dest/impi" "$dest/impi.tar.xz" "$impi_prefix"
step mkdir -p "$dest"
step python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --dest "$dest/wheels" mpich mpi4py expecttest accelerate
step cp -r "$data" "$dest/data"
step python3 -m pip install --quiet --no-deps --prefix "$impi_prefix" "impi-rt==2021.15.0"
step bash hpc/trim_impi.sh "$impi_prefix" "$dest/impi"
step rm -rf "$dest/impi" "$impi_prefix"  # the archive is what travels

if [ "$dry" != 1 ]; then
    for piece in "$dest/wheels" "$dest/data" "$dest/impi.tar.xz"; do
        echo "$(du -sh "$piece" | cut -f1)	$piece"
    done
    total=$(du -sb "$dest" | cut -f1)
    echo "$((total / 1024 / 1024)) MiB in $dest, of the $((limit / 1024 / 1024)) MiB a device call carries"
    if [ "$total" -gt "$limit" ]; then
        echo "$dest is too large to carry: leave out what the image has" >&2
        exit 1
    fi
fi

# The loan's calls, each one device call (carry: .gpu), in issue 94's order; each call's output folder is under
# the device's $OUT, so that what it measured comes back even when the call is cut. Before each, the sum of its
# steps' time limits, as the check's dry form gives them: the call's timeout_s is that and a margin, at most the
# 600 s a call may last.
offline="FSDP_MPI_WHEELS=$dest/wheels FSDP_MPI_DATA_DIR=$dest/data FSDP_MPI_IMPI=$dest/impi FSDP_MPI_GPU_CHECK_QUICK=1"
echo "the loan's calls (carry $dest), each after the sum of its steps' limits in seconds:"
while read -r folder extra steps; do
    limits=$(FSDP_MPI_GPU_CHECK_DRY=1 FSDP_MPI_GPU_CHECK_QUICK=1 bash hpc/gpu_check.sh $steps \
             | awk '$1 != "logs," {sum += $2} END {print sum}')
    [ "$extra" = - ] && extra="" || extra="$extra "
    echo "call $limits $offline FSDP_MPI_GPU_CHECK_OUT=\$OUT/$folder ${extra}bash hpc/gpu_check.sh $steps"
done <<'CALLS'
pytest-all FSDP_MPI_PYTEST_ALL_S=480 pytest-all
offload - offload
torch - torch-distributed torch-test-base
compiled - compiled-whole-gpt2 bench-mfu-blocks
CALLS
echo "a later call of pytest-all adds FSDP_MPI_PYTEST_ALL_PASSED=<the last call's pytest-all-passed.txt, carried>"
