#!/usr/bin/env bash
# An ssh for hpc/cluster/cluster.sh's nodes: `ssh.sh [ssh options] NODE COMMAND...` runs COMMAND on
# NODE as ssh would (the words joined and given to a shell), in the node's namespace, under its
# hostname. MPI launchers take it as their remote shell: MPICH's `-launcher ssh -launcher-exec`,
# Open MPI's `--mca plm_rsh_agent`. The environment and working directory carry over, as on a
# cluster with a shared file system.
set -euo pipefail
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;  # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
node=${1:?ssh.sh: no node named}; shift
workdir=$PWD
exec "$(dirname "${BASH_SOURCE[0]}")/cluster.sh" exec "$node" sh -c "cd \"\$0\" 2>/dev/null; $*" "$workdir"
