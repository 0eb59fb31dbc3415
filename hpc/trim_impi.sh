#!/bin/bash
# A trimmed copy of Intel MPI (the impi-rt wheel), small enough to carry to a machine that reaches no package
# index (a device call carries at most 64 MiB): what mpiexec and mpi4py need (the launcher, its proxies, libmpi,
# libfabric and its providers); not the benchmarks, tuning tools, the Fortran, C++ and Java bindings or the ILP64
# library: about 33 MB, and 6.5 MB as the .tar.xz beside it, which is what to carry. hpc/impi_env.sh points a
# shell at the copy; hpc/gpu_check.sh impi-direct unpacks the archive where the folder is missing.
#
#   bash hpc/trim_impi.sh [PREFIX [DEST]]   # PREFIX: where impi-rt is installed (default: this Python's prefix),
#                                           # DEST: the copy (default: .gpu/impi)
set -euo pipefail
prefix="${1:-$(python3 -c 'import sys; print(sys.prefix)')}"
dest="${2:-.gpu/impi}"
if [ ! -e "$prefix/lib/libmpi.so.12" ] || [ ! -x "$prefix/bin/mpiexec.hydra" ]; then
    echo "no Intel MPI under $prefix: pip install impi-rt there first (pip install -e '.[impi]')" >&2
    exit 2
fi
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib"
cp -L "$prefix"/bin/{mpiexec.hydra,hydra_pmi_proxy,hydra_bstrap_proxy} "$dest/bin/"
ln -s mpiexec.hydra "$dest/bin/mpiexec"
cp -L "$prefix"/lib/{libmpi.so.12,libfabric.so.1} "$dest/lib/"
cp -L "$prefix"/lib/lib*-fi.so "$dest/lib/"  # libfabric's providers: shm and tcp here, verbs, psm3, efa, mlx on clusters
tar -cJf "$dest.tar.xz" -C "$(dirname "$dest")" "$(basename "$dest")"
echo "$(du -sh "$dest" | cut -f1) in $dest, $(du -sh "$dest.tar.xz" | cut -f1) as $dest.tar.xz: source hpc/impi_env.sh $dest"
