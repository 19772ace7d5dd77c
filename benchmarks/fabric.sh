#!/usr/bin/env bash
# Run any command (typically `mpirun ...`) on an emulated cluster network.
#
#   sudo benchmarks/fabric.sh --rate 1gbit --delay 50us -- mpirun -n 4 mpigc-bench --sizes 4K,32M
#
# How: a private network namespace (ip netns) whose loopback is shaped with tc
# (tbf for the rate, netem for the one-way delay, if given), Open MPI forced onto
# its TCP transport over that loopback (OMPI_MCA_* environment variables: pml ob1,
# btl tcp,self, interfaces lo; PRRTE's out-of-band channel on lo too), gloo
# (torch.distributed) pointed at lo as well. The namespace is deleted on exit,
# on failure and on Ctrl-C. Needs root or CAP_NET_ADMIN (refuses otherwise).
#
# A SHARED MEDIUM: every byte between any two ranks crosses the one shaped
# loopback, so all ranks together share --rate. On a switched cluster each node
# has its own link of that rate; here N ranks get 1/N of it each. A
# bandwidth-optimal allreduce, where every rank sends at once, therefore runs
# about N times slower than on a real N-node network of the same link rate;
# compressed and uncompressed ops are slowed alike, so ratios between them hold
# as long as the network, not compute, is the bottleneck.
#
# Options
#   --rate R       link rate as tc writes it: 1gbit, 10gbit, 100mbit (required)
#   --delay D      one-way latency added to every packet (netem), e.g. 50us; default none
#   --burst B      tbf bucket; default scales with the rate (256kb per Gbit/s)
#   --timeout S    kill the command after S seconds (exit 124)
#   --name NAME    namespace name (default mpigc-fabric-PID)
#   -h, --help
# Environment inside: MPIGC_FABRIC="rate R, delay D, shared loopback" (mpigc-bench
# records it), OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 when run as root.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "fabric.sh: $*" >&2; exit 2; }

RATE="" DELAY="" BURST="" TIMEOUT="" NS="mpigc-fabric-$$"
while [ $# -gt 0 ]; do
    case "$1" in
        --rate) RATE=${2:?}; shift 2 ;;
        --delay) DELAY=${2:?}; shift 2 ;;
        --burst) BURST=${2:?}; shift 2 ;;
        --timeout) TIMEOUT=${2:?}; shift 2 ;;
        --name) NS=${2:?}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) die "unknown option $1 (expected --rate R [--delay D] [--burst B] [--timeout S] -- COMMAND...)" ;;
    esac
done
[ -n "$RATE" ] || die "expected --rate (e.g. --rate 1gbit), got none"
[ $# -gt 0 ] || die "expected a command after --, got none"
[[ "$RATE" =~ ^([0-9]+)([kmg]?)bit$ ]] || die "expected --rate like 100mbit, 1gbit or 10gbit, got '$RATE'"

for tool in ip tc; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found: install iproute2 (apt-get install iproute2)"
done
if [ "$(id -u)" -ne 0 ]; then
    # not root: CAP_NET_ADMIN and CAP_SYS_ADMIN (for ip netns) are still enough
    capeff=$(awk '/^CapEff/ {print $2}' /proc/self/status 2>/dev/null || echo 0)
    if (( (0x$capeff >> 12 & 1) == 0 || (0x$capeff >> 21 & 1) == 0 )); then
        die "needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to create a network namespace and shape it with tc; run it with sudo"
    fi
fi

if [ -z "$BURST" ]; then  # about 256 kB of bucket per Gbit/s, at least 32 kB
    num=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
    case "$unit" in g) kbit=$((num * 1000000)) ;; m) kbit=$((num * 1000)) ;; k) kbit=$num ;; *) kbit=$((num / 1000)) ;; esac
    kb=$(( kbit * 256 / 1000000 )); [ "$kb" -ge 32 ] || kb=32
    BURST="${kb}kb"
fi

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if ip netns list 2>/dev/null | grep -qw "^$NS"; then
        # only processes still inside our own namespace (left over by a crash)
        for pid in $(ip netns pids "$NS" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
        ip netns del "$NS" 2>/dev/null || echo "fabric.sh: could not delete namespace $NS; run: ip netns del $NS" >&2
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add "$NS" 2>/tmp/fabric.$$.err || {
    err=$(cat /tmp/fabric.$$.err); rm -f /tmp/fabric.$$.err
    die "could not create network namespace $NS ($err); needs root or CAP_NET_ADMIN"; }
rm -f /tmp/fabric.$$.err
ip netns exec "$NS" ip link set lo up
if [ -n "$DELAY" ]; then
    # netem (delay) at the root, tbf (rate) below it
    ip netns exec "$NS" tc qdisc add dev lo root handle 1: netem delay "$DELAY" limit 100000 \
        || die "tc netem failed (kernel module sch_netem missing?)"
    ip netns exec "$NS" tc qdisc add dev lo parent 1: handle 2: tbf rate "$RATE" burst "$BURST" latency 50ms \
        || die "tc tbf failed (kernel module sch_tbf missing?)"
else
    ip netns exec "$NS" tc qdisc add dev lo root tbf rate "$RATE" burst "$BURST" latency 50ms \
        || die "tc tbf failed (kernel module sch_tbf missing?)"
fi

export MPIGC_FABRIC="rate $RATE, delay ${DELAY:-0}, shared loopback (tc tbf, burst $BURST)"
# Open MPI 4 reads OMPI_MCA_oob_*, Open MPI 5 (PRRTE) PRTE_MCA_oob_* (and warns
# about the OMPI_ spelling), so set the one that fits
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,self OMPI_MCA_btl_tcp_if_include=lo \
       GLOO_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1
if mpirun --version 2>/dev/null | grep -qE 'Open MPI\)? v?([5-9]|[1-9][0-9])\.'; then
    export PRTE_MCA_oob_tcp_if_include=lo
else
    export OMPI_MCA_oob_tcp_if_include=lo
fi
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
echo "fabric.sh: namespace $NS, $MPIGC_FABRIC" >&2
ip netns exec "$NS" tc qdisc show dev lo >&2

set +e
if [ -n "$TIMEOUT" ]; then
    ip netns exec "$NS" timeout "$TIMEOUT" "$@"
else
    ip netns exec "$NS" "$@"
fi
rc=$?
set -e
if [ "$rc" -eq 124 ] && [ -n "$TIMEOUT" ]; then echo "fabric.sh: timed out after ${TIMEOUT}s" >&2; fi
ip netns exec "$NS" tc -s qdisc show dev lo | sed -n '2p' | sed 's/^/fabric.sh: lo /' >&2
exit "$rc"
