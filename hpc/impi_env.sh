# Source it: points this shell at an Intel MPI (a trimmed copy from hpc/trim_impi.sh, or an impi-rt install's
# prefix) for mpiexec and for mpi4py, whatever MPI the image or the environment brings besides.
#
#   source hpc/impi_env.sh DIR
#
# mpi4py 4 loads the first MPI it finds: MPI4PY_LIBMPI names Intel's (an MPICH-ABI library), and its mpiexec comes
# first on PATH, so that launcher and library agree (fsdp_mpi refuses a run where they do not). GPU offload
# (I_MPI_OFFLOAD=1) stays the caller's choice: Intel MPI crashes at start with it where no CUDA driver loads.
impi="$(cd "${1:?usage: source hpc/impi_env.sh DIR}" && pwd)"
export I_MPI_ROOT="$impi" FI_PROVIDER_PATH="$impi/lib" MPI4PY_MPIABI=mpich MPI4PY_LIBMPI="$impi/lib/libmpi.so.12"
export PATH="$impi/bin:$PATH" LD_LIBRARY_PATH="$impi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FSDP_MPI_MPIEXEC="$impi/bin/mpiexec"
