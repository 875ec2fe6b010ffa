#!/usr/bin/env bash
# A real 2-node SLURM cluster on this machine, for the infrastructure tests (root, no
# systemd): munged, slurmctld, and one slurmd per node, each node a network namespace
# (NODE_PREFIX1, NODE_PREFIX2 on a private bridge; the nodes' host names are node1 and node2)
# with its own UTS and mount namespace for its host name and /etc/hosts.
#
#   slurm_cluster.sh up DIR     (re)start the cluster; all state, logs and sockets in DIR
#   slurm_cluster.sh down DIR   cancel its jobs, stop it, remove the namespaces and bridge
#
# Then: export SLURM_CONF=DIR/slurm.conf. Network: the nodes reach each other and the
# controller (10.77.1.254 on the bridge) only; the namespaces have no default route.
set -euo pipefail

cmd=${1:?usage: slurm_cluster.sh up|down DIR}
dir=$(realpath -m "${2:?usage: slurm_cluster.sh up|down DIR}")
nodes=${NODES:-2}
prefix=${NODE_PREFIX:-blm-node}
bridge=${BRIDGE:-blm-br0}
subnet=10.77.1
ctl_addr=$subnet.254

down() {
  if [[ -f $dir/slurm.conf && -f $dir/slurmctld.pid ]]; then
    SLURM_CONF=$dir/slurm.conf scancel --user=root --quiet 2>/dev/null || true
  fi
  stop_pidfiles "$dir"/slurmd-*.pid "$dir/slurmctld.pid"
  for i in $(seq 1 "$nodes"); do
    # whatever still runs in a node (job steps) goes with it
    ip netns pids "$prefix$i" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$prefix$i" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  iptables -D FORWARD -i "$bridge" -o "$bridge" -j ACCEPT 2>/dev/null || true
  stop_pidfiles "$dir/munge/munged.pid"
}

stop_pidfiles() { # TERM the daemons named by existing pid files, wait up to 10 s each
  local file pid
  for file in "$@"; do
    [[ -f $file ]] || continue
    pid=$(cat "$file")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$file"
  done
}

wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq 1 $((seconds * 4))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  echo "slurm_cluster.sh: $what did not happen within ${seconds}s; logs in $dir/log" >&2
  return 1
}

all_idle() { [[ $(sinfo -h -t idle -o %D | head -1) == "$nodes" ]]; }

if [[ $cmd == down ]]; then
  down
  exit 0
fi
[[ $cmd == up ]] || { echo "slurm_cluster.sh: unknown command '$cmd' (up or down)" >&2; exit 2; }
for tool in slurmctld slurmd munged ip nsenter unshare iptables; do
  command -v "$tool" >/dev/null || { echo "slurm_cluster.sh: $tool is missing (tests/infra/install.sh)" >&2; exit 1; }
done
down
rm -rf "$dir"
mkdir -p "$dir"/{state,spool,log,munge}

# munge authenticates every SLURM message: a private munged with its own key and socket.
chown munge:munge "$dir/munge"
chmod 711 "$dir/munge" # clients need to reach the socket
runuser -u munge -- mungekey --create --keyfile="$dir/munge/munge.key"
runuser -u munge -- munged --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
  --seed-file="$dir/munge/munged.seed"

# The nodes: namespaces on a bridge; the controller is the root namespace's end of it.
ip link add "$bridge" type bridge
ip addr add "$ctl_addr/24" dev "$bridge"
ip link set "$bridge" up
# dockerd sets the FORWARD policy to DROP and filters bridged traffic: let ours through.
iptables -C FORWARD -i "$bridge" -o "$bridge" -j ACCEPT 2>/dev/null ||
  iptables -I FORWARD -i "$bridge" -o "$bridge" -j ACCEPT
{
  echo "127.0.0.1 localhost"
  for i in $(seq 1 "$nodes"); do echo "$subnet.$i node$i"; done
} >"$dir/hosts"
for i in $(seq 1 "$nodes"); do
  ns=$prefix$i
  ip netns add "$ns"
  ip link add "veth-$ns" type veth peer name eth0 netns "$ns"
  ip link set "veth-$ns" master "$bridge" up
  ip -n "$ns" addr add "$subnet.$i/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
done

cat >"$dir/slurm.conf" <<EOF
ClusterName=belief-lm-ci
SlurmctldHost=$(hostname -s)($ctl_addr)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
# no cgroups: processes are tracked by parentage, tasks are not confined
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=node[1-$nodes] NodeAddr=$subnet.[1-$nodes] CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$dir/slurm.conf
slurmctld -i
wait_for 20 "slurmctld answering" scontrol ping
for i in $(seq 1 "$nodes"); do
  # nsenter, not `ip netns exec`: that remounts /sys, which hides the cgroup mount slurmd
  # needs. The node's own UTS and mount namespaces give it its host name and /etc/hosts;
  # job steps inherit both.
  # shellcheck disable=SC2016  # $1 and $2 expand in the inner shell
  nsenter --net="/run/netns/$prefix$i" unshare --uts --mount bash -c \
    'mount --bind "$1" /etc/hosts && hostname "$2" && exec slurmd -N "$2"' \
    _ "$dir/hosts" "node$i"
done
wait_for 30 "both nodes idle" all_idle
sinfo -N -h -o '%N %T'
echo "slurm_cluster.sh: up; export SLURM_CONF=$SLURM_CONF"
