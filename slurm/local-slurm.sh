#!/usr/bin/env bash
# A throw-away single-node Slurm for tests and trying the templates (Debian/Ubuntu,
# as root, no systemd needed). Not for production clusters.
#
#   bash slurm/local-slurm.sh install   # apt-get the packages if missing (~20 s)
#   bash slurm/local-slurm.sh up        # start munged (if none answers), slurmctld, slurmd
#   eval "$(bash slurm/local-slurm.sh env)"   # SLURM_CONF=... for sbatch/squeue/scontrol
#   bash slurm/local-slurm.sh status
#   bash slurm/local-slurm.sh down      # stop what `up` started (by PID), keep nothing
#
# Everything lives in $MPIGC_SLURM_DIR (default /tmp/mpigc-slurm): slurm.conf,
# state, spool, logs, PID files. `up` is idempotent: it returns at once when the
# daemons recorded there still run, and replaces what a previous run left behind.
# The node advertises $MPIGC_SLURM_CPUS CPUs (default 4, whatever the machine
# has: SlurmdParameters=config_overrides) and 2 fake GPUs (GRES without device
# files), so 4-rank jobs and GPU requests can be scheduled on a 2-core machine.
# Ports: 6817/6818 unless taken, then the next free ones.
set -euo pipefail

DIR=${MPIGC_SLURM_DIR:-/tmp/mpigc-slurm}
CPUS=${MPIGC_SLURM_CPUS:-4}
HOST=$(hostname -s)
PACKAGES=(slurmctld slurmd slurm-client munge libpmix-dev)

log() { echo "local-slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }

alive() {  # PID file $1 names a live process
    [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

port_busy() {  # something listens on 127.0.0.1:$1
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_port() {  # first port >= $1 that nothing listens on and $2 is not
    local p=$1
    while port_busy "$p" || [ "$p" = "${2:-}" ]; do p=$((p + 1)); done
    echo "$p"
}

cmd_install() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    # srun --mpi=pmix loads libpmix.so at run time: without the -dev package's
    # symlink it fails with "can not load PMIx library"
    ls /usr/lib/*/libpmix.so >/dev/null 2>&1 || missing+=(libpmix-dev)
    if [ ${#missing[@]} -eq 0 ]; then
        log "packages present"
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "missing ${missing[*]}; run as root: apt-get install ${PACKAGES[*]}"
    log "installing ${PACKAGES[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

munge_ok() {
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1
}

start_munge() {
    if munge_ok; then
        log "munged answers already; using it"
        return 0
    fi
    [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key missing (is munge installed?)"
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    runuser -u munge -- munged -F >"$DIR/munged.log" 2>&1 &
    echo $! >"$DIR/munged.pid"
    for _ in $(seq 50); do
        munge_ok && return 0
        sleep 0.1
    done
    die "munged did not come up: $(tail -n 5 "$DIR/munged.log")"
}

write_conf() {
    local ctld_port slurmd_port mem
    ctld_port=$(free_port 6817)
    slurmd_port=$(free_port $((ctld_port + 1)) "$ctld_port")
    mem=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)
    rm -rf "$DIR/state" "$DIR/spool" "$DIR/log"  # a fresh cluster: no old jobs or node state
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    cat >"$DIR/slurm.conf" <<EOF
# written by slurm/local-slurm.sh
ClusterName=mpigc-local
SlurmctldHost=$HOST
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# short credential lifetime: a requeued job starts again after ~15 s, not minutes
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pidfile
SlurmdPidFile=$DIR/slurmd.pidfile
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
DependencyParameters=kill_invalid_depend
SchedulerParameters=sched_interval=5,bf_interval=5
MinJobAge=600
KillWait=5
InactiveLimit=0
JobRequeue=1
GresTypes=gpu
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    # fake GPUs: Slurm schedules and binds them, jobs see no CUDA device (a count
    # without File= is reported as 0 by slurmd 22.05, so two harmless devices)
    printf 'AutoDetect=off\nNodeName=%s Name=gpu File=/dev/null\nNodeName=%s Name=gpu File=/dev/zero\n' \
        "$HOST" "$HOST" >"$DIR/gres.conf"
}

cmd_up() {
    mkdir -p "$DIR"
    if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid"; then
        log "already up ($DIR)"
        return 0
    fi
    cmd_down quiet
    command -v slurmctld >/dev/null || die "slurmctld not found: run '$0 install' first"
    getent hosts "$HOST" >/dev/null || {
        [ -w /etc/hosts ] || die "hostname $HOST does not resolve; add it to /etc/hosts"
        log "adding $HOST to /etc/hosts"
        echo "127.0.0.1 $HOST" >>/etc/hosts
    }
    # on failure from here on, stop what this call started
    trap 'rc=$?; [ $rc -eq 0 ] || cmd_down quiet; exit $rc' EXIT
    start_munge
    write_conf
    export SLURM_CONF=$DIR/slurm.conf
    slurmctld -D -i -f "$SLURM_CONF" >"$DIR/log/slurmctld.out" 2>&1 &
    echo $! >"$DIR/slurmctld.pid"
    slurmd -D -f "$SLURM_CONF" >"$DIR/log/slurmd.out" 2>&1 &
    echo $! >"$DIR/slurmd.pid"
    local state=""
    for _ in $(seq 150); do
        alive "$DIR/slurmctld.pid" || die "slurmctld exited: $(tail -n 20 "$DIR/log/slurmctld.out" "$DIR/log/slurmctld.log" 2>/dev/null)"
        alive "$DIR/slurmd.pid" || die "slurmd exited: $(tail -n 20 "$DIR/log/slurmd.out" "$DIR/log/slurmd.log" 2>/dev/null)"
        state=$(sinfo -h -N -o %t 2>/dev/null | head -n 1 || true)
        case "$state" in idle|mix|alloc) break ;; esac
        sleep 0.2
    done
    case "$state" in
        idle|mix|alloc) ;;
        *) die "node not ready (state '${state:-none}'): $(tail -n 20 "$DIR/log/slurmctld.log")" ;;
    esac
    trap - EXIT
    log "up: $HOST, $CPUS CPUs, ports $(awk -F= '/^SlurmctldPort|^SlurmdPort/ {printf "%s ", $2}' "$SLURM_CONF")(SLURM_CONF=$SLURM_CONF)"
}

stop_pid() {  # stop the process in PID file $1, wait for it, remove the file
    local f=$1 pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

cmd_down() {
    [ -d "$DIR" ] || return 0
    # running jobs first, so no slurmstepd outlives the daemons
    if alive "$DIR/slurmctld.pid"; then
        SLURM_CONF=$DIR/slurm.conf scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
        sleep 0.5
    fi
    stop_pid "$DIR/slurmd.pid"
    stop_pid "$DIR/slurmctld.pid"
    stop_pid "$DIR/munged.pid"  # only if `up` started it
    [ "${1:-}" = quiet ] || log "down"
}

cmd_status() {
    local p
    for p in munged slurmctld slurmd; do
        if alive "$DIR/$p.pid"; then echo "$p: running (pid $(cat "$DIR/$p.pid"))"
        else echo "$p: not started here"; fi
    done
    [ -f "$DIR/slurm.conf" ] && SLURM_CONF=$DIR/slurm.conf sinfo -N -l 2>/dev/null || true
}

case "${1:-}" in
    install) cmd_install ;;
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$DIR/slurm.conf" ;;
    *) echo "usage: $0 install|up|env|status|down" >&2; exit 2 ;;
esac
