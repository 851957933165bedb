#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for `make test-slurm`: Debian's slurm-wlm and munge (installed
# with apt-get if missing; needs root), slurmctld + slurmd configured for localhost from a slurm.conf
# written under $STATE (the system's /etc/slurm is left alone; clients find it through SLURM_CONF).
#
#   scripts/slurm-local.sh up     install if needed, write the config, start munged, slurmctld, slurmd
#   scripts/slurm-local.sh down   stop the daemons this script started
#   scripts/slurm-local.sh conf   print the slurm.conf path (clients need SLURM_CONF=<it>)
set -euo pipefail
STATE=${EVICTLAB_SLURM_STATE:-/tmp/evictlab-slurm}
CONF=$STATE/slurm.conf

die() { echo "slurm-local: $*" >&2; exit 1; }

install() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
    [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are not installed and installing them needs root"
    echo "slurm-local: installing slurm-wlm and munge (apt-get, without their manual pages)"
    # no manual pages: dataset=man_pages reads the installed ones, and 50 more would change its text
    local apt=(apt-get install -y -q -o 'Dpkg::Options::=--path-exclude=/usr/share/man/*' slurm-wlm munge)
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive "${apt[@]}" >/dev/null; } \
        || die "apt-get install slurm-wlm munge failed"
}

write_conf() {
    mkdir -p "$STATE/ctld" "$STATE/d" "$STATE/log"
    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))  # MB, 1 GiB left to the system
    cat > "$CONF" <<CONF
ClusterName=evictlab
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

up() {
    install
    write_conf
    export SLURM_CONF=$CONF
    if ! munge_ok; then
        mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
        if id munge >/dev/null 2>&1; then su -s /bin/sh munge -c munged 2>/dev/null || munged --force
        else munged --force; fi
        touch "$STATE/started-munged"
        munge_ok || die "munged does not answer (munge -n | unmunge fails)"
    fi
    stop "slurmctld -f $CONF"
    stop "slurmd -f $CONF"
    slurmctld -f "$CONF" -c  # -c: a clean start, no jobs from an earlier cluster
    slurmd -f "$CONF"
    for _ in $(seq 60); do  # the node registers within seconds
        if timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "slurm-local: up ($(sinfo -h -o '%D node, %c CPUs, %m MB, partition %P'))"
            return
        fi
        sleep 1
    done
    tail -n 5 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 || true
    die "the node did not come up within 60 s (logs above)"
}

stop() {  # stop every process whose command line matches $1: TERM, then KILL after 10 s
    pkill -f "$1" 2>/dev/null || return 0
    for _ in $(seq 20); do pgrep -f "$1" >/dev/null || return 0; sleep 0.5; done
    pkill -9 -f "$1" 2>/dev/null || true
}

down() {
    stop "slurmd -f $CONF"
    stop "slurmctld -f $CONF"
    if [ -e "$STATE/started-munged" ]; then
        pkill -x munged 2>/dev/null || true
        rm -f "$STATE/started-munged"
    fi
    echo "slurm-local: down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    conf) echo "$CONF" ;;
    *) die "usage: $0 up|down|conf" ;;
esac
