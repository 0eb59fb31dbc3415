#!/usr/bin/env bash
# A cluster of K nodes on this one machine: each node is a network namespace with its own hostname
# and one veth link to a switch (a bridge in a namespace of its own), optionally rate-limited.
# Ranks on different nodes talk over a real TCP/IP stack and its links; ranks on one node share
# memory, as on a real cluster. The machine's own network is never touched: every link and address
# lives inside the namespaces this script creates, in one private /24.
#
#   hpc/cluster/cluster.sh start [--nodes K] [--rate RATE] [--slurm]
#                                  K in 2..4 (default 2); RATE e.g. 1gbit; --slurm: a SLURM of the nodes,
#                                  slurmctld on the switch (fmswitch), one slurmd per node
#   hpc/cluster/cluster.sh rate RATE|none                     change every node's link limit
#   hpc/cluster/cluster.sh exec NODE COMMAND...               run COMMAND on NODE (as ssh would; with
#                                                            --slurm, SLURM_CONF names the cluster's SLURM)
#   hpc/cluster/cluster.sh bytes                              bytes each node sent and received, so far
#   hpc/cluster/cluster.sh cut NODE | mend NODE               take a node's link down, or up again
#   hpc/cluster/cluster.sh stop                               kill every process on the nodes, remove it all
#
# Needs root and network namespaces (`ip netns`). docs/clusters.md shows how to run MPI jobs on it.
set -euo pipefail

PREFIX=fmnode                 # node i is namespace and host "fmnode<i>"
SWITCH=fmswitch               # the namespace holding the bridge
SUBNET=${FSDP_MPI_CLUSTER_SUBNET:-10.213.77}   # a /24 of 10.0.0.0/8; node i is .<10 + i>
STATE=/run/fsdp_mpi_cluster   # what `start` made, for the other commands
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

fail() { echo "cluster.sh: $*" >&2; exit 2; }

nodes() { cat "$STATE/nodes" 2>/dev/null || fail "no cluster is running (start one with: $0 start)"; }

node_names() { local k; k=$(nodes); for ((i = 0; i < k; i++)); do echo "$PREFIX$i"; done; }

check_can_run() {
  [ "$(id -u)" = 0 ] || fail "needs root (it creates network namespaces)"
  command -v ip >/dev/null || fail "needs iproute2's ip"
  ip netns add "${PREFIX}probe" 2>/dev/null || fail "cannot create network namespaces here (ip netns add failed)"
  ip netns del "${PREFIX}probe"
}

set_rate() {  # $1: a tc rate (1gbit, 500mbit, ...) or "none"; limits both directions of every node's link
  local rate=$1 node i=0
  for node in $(node_names); do
    for where in "-n $node eth0" "-n $SWITCH port$i"; do
      # shellcheck disable=SC2086
      set -- $where
      tc "$1" "$2" qdisc del dev "$3" root 2>/dev/null || true
      if [ "$rate" != none ]; then
        # tbf: the token bucket holds 1 ms of traffic at the rate, at least a few large frames.
        tc "$1" "$2" qdisc add dev "$3" root tbf rate "$rate" burst 256kb latency 100ms \
          || fail "tc refused the rate $rate (examples: 10gbit, 1gbit, 100mbit)"
      fi
    done
    i=$((i + 1))
  done
  echo "$rate" > "$STATE/rate"
}

start() {
  local k=2 rate=none slurm=no
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) k=${2:?}; shift 2 ;;
      --rate) rate=${2:?}; shift 2 ;;
      --slurm) slurm=yes; shift ;;
      *) fail "start: unknown option $1 (options: --nodes K, --rate RATE, --slurm)" ;;
    esac
  done
  if [ $slurm = yes ]; then
    command -v slurmctld >/dev/null && command -v munged >/dev/null \
      || fail "--slurm needs slurmctld, slurmd and munged (Debian: apt-get install slurm-wlm munge)"
  fi
  [[ "$k" =~ ^[2-4]$ ]] || fail "--nodes $k: give 2, 3 or 4"
  [[ "$SUBNET" =~ ^10\.[0-9]+\.[0-9]+$ ]] || fail "FSDP_MPI_CLUSTER_SUBNET=$SUBNET: give the first three numbers of a 10.x.y.0/24"
  [ -e "$STATE/nodes" ] && fail "a cluster is already running ($(nodes) nodes): stop it first ($0 stop)"
  check_can_run
  ip -o addr | grep " $SUBNET\." >/dev/null && fail "$SUBNET.0/24 is already used on this machine: set FSDP_MPI_CLUSTER_SUBNET"
  mkdir -p "$STATE"
  echo "$k" > "$STATE/nodes"
  trap 'echo "cluster.sh: start failed; removing what it made" >&2; stop' ERR
  ip netns add "$SWITCH"
  ip -n "$SWITCH" link add br0 type bridge
  ip -n "$SWITCH" link set br0 up
  ip -n "$SWITCH" link set lo up
  ip -n "$SWITCH" addr add "$SUBNET.1/24" dev br0  # the controller's address, for --slurm
  local hosts="127.0.0.1 localhost"$'\n'"$SUBNET.1 $SWITCH"$'\n'
  for ((i = 0; i < k; i++)); do hosts+="$SUBNET.$((10 + i)) $PREFIX$i"$'\n'; done
  mkdir -p "/etc/netns/$SWITCH"
  printf '%s' "$hosts" > "/etc/netns/$SWITCH/hosts"
  local node
  for ((i = 0; i < k; i++)); do
    node=$PREFIX$i
    ip netns add "$node"
    mkdir -p "/etc/netns/$node"
    printf '%s' "$hosts" > "/etc/netns/$node/hosts"
    ip -n "$SWITCH" link add "port$i" type veth peer name eth0 netns "$node"
    # Jumbo frames: headers then cost under 1% of the bytes a link carries.
    ip -n "$SWITCH" link set "port$i" mtu 9000 master br0 up
    ip -n "$node" link set lo up
    ip -n "$node" link set eth0 mtu 9000 up
    ip -n "$node" addr add "$SUBNET.$((10 + i))/24" dev eth0
  done
  set_rate "$rate"
  for node in $(node_names); do
    ip -n "$node" link show eth0 | grep LOWER_UP >/dev/null || { stop; fail "$node's link did not come up; nothing is left behind"; }
  done
  if [ $slurm = yes ]; then start_slurm "$k"; fi
  local hostlist
  hostlist=$(node_names | sed 's/$/:2/' | paste -sd, -)
  cat <<EOF
Started $k nodes ($(node_names | paste -sd' ' -)) on $SUBNET.0/24, links limited to: $rate.
Run a job from a node, which reaches the others (2 ranks per node here):
  MPICH:    $0 exec ${PREFIX}0 env MPICH_CH4_NETMOD=ofi FI_PROVIDER=tcp \\
              mpiexec -hosts $hostlist -launcher ssh -launcher-exec $HERE/ssh.sh python ...
  Open MPI: $0 exec ${PREFIX}0 mpirun --host $hostlist --mca plm_rsh_agent $HERE/ssh.sh \\
              --mca btl tcp,self,vader --mca btl_tcp_if_include $SUBNET.0/24 --mca oob_tcp_if_include $SUBNET.0/24 python ...
EOF
  if [ $slurm = yes ]; then
    echo "SLURM: submit from a node, e.g."
    echo "  $0 exec ${PREFIX}0 sbatch --nodes=$k --ntasks-per-node=2 --cpus-per-task=1 hpc/run_gpt2_cpu.sbatch"
    echo "  (with MPICH from pip: FSDP_MPI_LAUNCHER=\"srun --mpi=pmi2\" MPICH_CH4_NETMOD=ofi FI_PROVIDER=tcp)"
  fi
  echo "Stop it with: $0 stop"
}

start_slurm() {  # $1: nodes. munge (shared by all: one kernel), slurmctld on the switch, a slurmd per node
  local k=$1 cpus=8 memory_mb=4096  # every node claims 8 CPUs, so that the scripts' defaults fit; they share the cores
  mkdir -p "$STATE/slurmctld" /etc/munge /run/munge /var/lib/munge /var/log/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || munged --force
  {
    echo "ClusterName=fsdpmpi"
    echo "SlurmctldHost=$SWITCH($SUBNET.1)"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    echo "MpiDefault=none"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "ReturnToService=2"
    echo "SlurmdParameters=config_overrides"  # the CPUs declared below, not the cores slurmd finds
    echo "SlurmctldPidFile=$STATE/slurmctld.pid"
    echo "SlurmdPidFile=$STATE/slurmd-%n.pid"
    echo "StateSaveLocation=$STATE/slurmctld"
    echo "SlurmdSpoolDir=$STATE/slurmd-%n"
    echo "SlurmctldLogFile=$STATE/slurmctld.log"
    echo "SlurmdLogFile=$STATE/slurmd-%n.log"
    echo "JobCompType=jobcomp/none"
    echo "SchedulerType=sched/backfill"
    # Scheduling passes every 2 s, not 60 (backfill: 30): on a small emulated cluster a job that becomes
    # eligible without an event to wake the scheduler (a requeued job's begin time) starts within seconds.
    echo "SchedulerParameters=sched_interval=2,bf_interval=2"
    # A step whose node stopped answering is ended 5 s after its signal, not 30: the node-loss test waits for it.
    echo "KillWait=5"
    for ((i = 0; i < k; i++)); do
      echo "NodeName=$PREFIX$i NodeAddr=$SUBNET.$((10 + i)) CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN"
    done
    echo "PartitionName=nodes Nodes=$(node_names | paste -sd, -) Default=YES MaxTime=INFINITE State=UP"
  } > "$STATE/slurm.conf"
  export SLURM_CONF=$STATE/slurm.conf
  ip netns exec "$SWITCH" unshare --uts sh -c "hostname $SWITCH && exec slurmctld"
  local node
  for node in $(node_names); do
    # slurmd needs a cgroup hierarchy, which the namespace's fresh /sys lacks: this machine's v1 hierarchies
    # (as /proc/self/cgroup lists them) on a tmpfs, in this slurmd's own mount namespace (ip netns exec gives
    # it one)
    ip netns exec "$node" unshare --uts sh -c "hostname $node
      mount -t tmpfs cgroup /sys/fs/cgroup
      for hierarchy in $(awk -F: '$2 != "" {print $2}' /proc/self/cgroup | paste -sd' ' -); do
        directory=\${hierarchy#name=}
        options=\$hierarchy; [ \$directory = \$hierarchy ] || options=none,\$hierarchy
        mkdir -p /sys/fs/cgroup/\$directory && mount -t cgroup -o \$options cgroup /sys/fs/cgroup/\$directory
      done
      exec slurmd -N $node"
  done
  for _ in $(seq 60); do
    if ip netns exec "${PREFIX}0" sinfo --noheader --states=idle 2>/dev/null | grep " $k " >/dev/null; then return 0; fi
    sleep 1
  done
  local logs
  logs=$(mktemp -d /tmp/fsdp_mpi_cluster_logs.XXXX)
  cp "$STATE"/*.log "$logs"/ 2>/dev/null || true
  stop
  fail "SLURM did not come up (its logs: $logs); nothing else is left behind"
}

stop() {
  local node
  for node in $(ip netns list | awk '{print $1}' | grep -E "^($PREFIX[0-9]+|$SWITCH)$" || true); do
    # shellcheck disable=SC2046
    kill -9 $(ip netns pids "$node") 2>/dev/null || true
    ip netns del "$node"
    rm -rf "/etc/netns/$node"
  done
  rm -rf "$STATE"
}

exec_on() {  # $1: node; the rest: a command, run there with the node's hostname
  local node=${1:?exec: name a node}; shift
  node_names | grep -x "$node" >/dev/null || fail "no node named $node (nodes: $(node_names | paste -sd' ' -))"
  [ $# -gt 0 ] || fail "exec $node: give a command"
  if [ -e "$STATE/slurm.conf" ]; then export SLURM_CONF=$STATE/slurm.conf; fi
  exec ip netns exec "$node" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$node" "$@"
}

bytes() {  # one line per node: name, bytes sent, bytes received on its link
  local node
  for node in $(node_names); do
    echo "$node $(ip netns exec "$node" cat /sys/class/net/eth0/statistics/tx_bytes) $(ip netns exec "$node" cat /sys/class/net/eth0/statistics/rx_bytes)"
  done
}

link_state() {  # $1: up or down; $2: node
  node_names | grep -x "${2:-}" >/dev/null || fail "name a node (nodes: $(node_names | paste -sd' ' -))"
  ip -n "$2" link set eth0 "$1"
}

command=${1:-}; shift || true
case "$command" in
  start) start "$@" ;;
  stop) stop ;;
  rate) nodes >/dev/null; set_rate "${1:?rate: give a rate (e.g. 1gbit) or none}" ;;
  exec) exec_on "$@" ;;
  bytes) bytes ;;
  cut) link_state down "${1:-}" ;;
  mend) link_state up "${1:-}" ;;
  *) fail "usage: $0 start|stop|rate|exec|bytes|cut|mend (see the top of this file)" ;;
esac
