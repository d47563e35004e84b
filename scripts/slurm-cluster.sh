#!/bin/sh
# The Slurm lab cluster: slurmctld and three slurmd "nodes" (n1, n2, n3) on this one machine,
# each slurmd in its own UTS namespace so that `hostname` (and MPI) on it says n1, n2 or n3.
#
#   scripts/slurm-cluster.sh start    # idempotent; prints the SLURM_CONF to export
#   scripts/slurm-cluster.sh status   # exit 0 when every daemon runs and the nodes answer
#   scripts/slurm-cluster.sh stop     # cancels its jobs, stops what it started (by PID), restores /etc/hosts
#   scripts/slurm-cluster.sh env      # the line to eval: export SLURM_CONF=...
#
# Runs as root; installs nothing (scripts/system-deps.sh installs slurmctld, slurmd, slurm-client, munge).
# Everything it writes -- slurm.conf, cgroup.conf, the munge key, PID files, logs, spool -- lives in
# its state directory, $HETFLOW_SLURM_LAB (default /tmp/hetflow-slurm-lab); the one change outside it
# is a marked line `127.0.0.1 n1 n2 n3` in /etc/hosts (MPICH's Hydra hangs without name resolution),
# removed again by `stop`.  Clients find the cluster through SLURM_CONF=$STATE/slurm.conf.
#
# A second, independent instance runs beside the default one when these differ from the defaults:
#   HETFLOW_SLURM_LAB         state directory                           (default /tmp/hetflow-slurm-lab)
#   HETFLOW_SLURM_PORT        slurmctld's port                          (default 16817)
#   HETFLOW_SLURM_NODES       node names, space-separated               (default "n1 n2 n3")
#   HETFLOW_SLURM_NODE_PORT   the first node's slurmd port, +1 per node (default 17001)
#   HETFLOW_SLURM_FIRST_JOB   FirstJobId, so that job ids (and what is named after them) never collide
#                             (default: Slurm's own)
# e.g. HETFLOW_SLURM_LAB=/tmp/hetflow-slurm-engines HETFLOW_SLURM_PORT=16917 HETFLOW_SLURM_NODES="e1 e2 e3" \
#      HETFLOW_SLURM_NODE_PORT=17101 HETFLOW_SLURM_FIRST_JOB=100000 scripts/slurm-cluster.sh start
# Each instance marks its /etc/hosts line with its state directory (the default instance keeps the
# mark it always had); `stop` removes only the line that ends with its own mark.
set -eu

DEFAULT_STATE=/tmp/hetflow-slurm-lab
STATE=${HETFLOW_SLURM_LAB:-$DEFAULT_STATE}
NODES=${HETFLOW_SLURM_NODES:-n1 n2 n3}
CTLD_PORT=${HETFLOW_SLURM_PORT:-16817}
NODE_PORT=${HETFLOW_SLURM_NODE_PORT:-17001}
FIRST_JOB=${HETFLOW_SLURM_FIRST_JOB:-}
if [ "$STATE" = "$DEFAULT_STATE" ]; then
    HOSTS_MARK="# hetflow slurm lab cluster"
else
    # never containing the default mark: an older script's `stop` drops every line that contains it
    HOSTS_MARK="# hetflow slurm lab instance $STATE"
fi
export SLURM_CONF="$STATE/etc/slurm.conf"

say() { printf 'slurm-cluster: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# the PID in pid file (munged's lives with its key: it runs as the munge user)
# the PID in pid file $1 if that process runs the program $2 (so a recycled PID is never ours)
live_pid() {
    [ -s "$1" ] || return 1
    pid=$(cat "$1")
    case $pid in ''|*[!0-9]*) return 1 ;; esac
    [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q -- "$2" || return 1
    echo "$pid"
}

pidfiles() {
    echo "$STATE/munge/munged.pid munged"
    echo "$STATE/run/slurmctld.pid slurmctld"
    for n in $NODES; do echo "$STATE/run/slurmd-$n.pid slurmd"; done
}

all_running() {
    pidfiles | while read -r file prog; do
        live_pid "$file" "$prog" >/dev/null || exit 1
    done
}

nodes_answer() {
    out=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    for n in $NODES; do
        echo "$out" | grep -Eq "^$n (idle|mix|alloc)" || return 1
    done
}

check_settings() {
    [ -n "$(echo $NODES)" ] || die "HETFLOW_SLURM_NODES is empty (expected node names, e.g. \"e1 e2 e3\")"
    for n in $NODES; do
        case $n in
            [a-z]*) ;;
            *) die "HETFLOW_SLURM_NODES: node name '$n' must start with a lower-case letter" ;;
        esac
        case $n in
            *[!a-z0-9-]*) die "HETFLOW_SLURM_NODES: node name '$n' may hold only a-z, 0-9 and '-'" ;;
        esac
    done
    for setting in "HETFLOW_SLURM_PORT=$CTLD_PORT" "HETFLOW_SLURM_NODE_PORT=$NODE_PORT" \
                   "HETFLOW_SLURM_FIRST_JOB=${FIRST_JOB:-1}"; do
        case ${setting#*=} in
            ''|*[!0-9]*) die "$setting: expected a positive integer" ;;
        esac
    done
    case $STATE in
        /*) ;;
        *) die "HETFLOW_SLURM_LAB=$STATE: expected an absolute path" ;;
    esac
    case $STATE in
        *[!A-Za-z0-9/._-]*) die "HETFLOW_SLURM_LAB=$STATE: expected only letters, digits and / . _ -" ;;
    esac
}

# the node names as one Slurm list: n1,n2,n3
node_list() { echo $NODES | tr ' ' ','; }

# one NodeName line per node, each with its own slurmd port
node_lines() {
    port=$NODE_PORT
    for n in $NODES; do
        echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$port CPUs=$cpus State=UNKNOWN"
        port=$((port + 1))
    done
}

check_tools() {
    [ "$(id -u)" = 0 ] || die "must run as root (the Slurm daemons run as root, munged as the munge user)"
    for tool in munged slurmctld slurmd sinfo srun unshare runuser; do
        command -v "$tool" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null 2>&1 \
            || die "$tool is not installed; run scripts/system-deps.sh (as root) first"
    done
    id munge >/dev/null 2>&1 || die "there is no munge user; install munge (scripts/system-deps.sh)"
}

write_config() {
    host=$(hostname)
    cpus=$(nproc)
    mkdir -p "$STATE/etc" "$STATE/run" "$STATE/log" "$STATE/spool" "$STATE/ctld" "$STATE/munge"
    cat > "$STATE/etc/slurm.conf" <<EOF
# written by scripts/slurm-cluster.sh: the hetflow lab cluster (nodes $(node_list) on one host)
ClusterName=hetflowlab
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
EnforcePartLimits=ALL
MailProg=/bin/true
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
InactiveLimit=0
KillWait=5
MinJobAge=60
$(if [ -n "$FIRST_JOB" ]; then echo "FirstJobId=$FIRST_JOB"; fi)
$(node_lines)
PartitionName=lab Nodes=$(node_list) Default=YES MaxTime=INFINITE State=UP
EOF
    cat > "$STATE/etc/cgroup.conf" <<EOF
# written by scripts/slurm-cluster.sh; the lab cluster tracks processes with proctrack/linuxproc
# and binds with task/affinity, so no cgroup is constrained
CgroupPlugin=cgroup/v1
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
    if [ ! -s "$STATE/munge/munge.key" ]; then
        dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 2>/dev/null
    fi
    chown -R munge:munge "$STATE/munge"
    chmod 0700 "$STATE/munge"
    chmod 0400 "$STATE/munge/munge.key"
}

# whether /etc/hosts has a line that ends with this instance's mark (another instance's never does)
has_hosts_line() {
    awk -v m="$HOSTS_MARK" 'substr($0, length($0) - length(m) + 1) == m { f = 1 } END { exit !f }' /etc/hosts
}

add_hosts() {
    has_hosts_line && return 0
    # rewritten in place (not renamed over): /etc/hosts may be a bind mount
    printf '127.0.0.1 %s %s\n' "$NODES" "$HOSTS_MARK" >> /etc/hosts
}

remove_hosts() {
    has_hosts_line || return 0
    kept=$(awk -v m="$HOSTS_MARK" 'substr($0, length($0) - length(m) + 1) != m' /etc/hosts)
    printf '%s\n' "$kept" > /etc/hosts
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    limit=$1; what=$2; shift 2
    i=0
    while ! "$@"; do
        i=$((i + 1))
        [ "$i" -le $((limit * 10)) ] || return 1
        sleep 0.1
    done
}

start() {
    check_settings
    check_tools
    if all_running && nodes_answer; then
        say "already running ($STATE)"
        echo "export SLURM_CONF=$SLURM_CONF"
        return 0
    fi
    stop_daemons   # a partial cluster: stop what is ours and start afresh
    write_config
    add_hosts
    runuser -u munge -- munged --force --socket="$STATE/munge/munge.socket" \
        --key-file="$STATE/munge/munge.key" --pid-file="$STATE/munge/munged.pid" \
        --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed"
    wait_for 10 munged test -S "$STATE/munge/munge.socket" || die "munged did not start; see $STATE/munge/munged.log"
    slurmctld -i -f "$SLURM_CONF"
    for n in $NODES; do
        # own UTS namespace: the node's name is the hostname of every process on it (srun hostname, MPI)
        unshare --uts sh -c 'hostname "$1" && exec slurmd -f "$2" -N "$1"' sh "$n" "$SLURM_CONF"
    done
    if ! wait_for 60 nodes nodes_answer; then
        sinfo -N >&2 || true
        die "the nodes did not come up; see $STATE/log/"
    fi
    # a node that was DOWN in a saved state comes back with ReturnToService=2; make sure
    scontrol update NodeName="$(node_list)" State=RESUME >/dev/null 2>&1 || true
    say "running: $(sinfo -h -o '%D nodes %t' | tr '\n' ' ')($STATE)"
    echo "export SLURM_CONF=$SLURM_CONF"
}

stop_pid() {  # stop_pid PIDFILE PROGRAM
    pid=$(live_pid "$1" "$2") || { rm -f "$1"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    i=0
    while [ -d "/proc/$pid" ] && [ "$i" -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    if [ -d "/proc/$pid" ]; then
        say "$2 (pid $pid) did not stop on SIGTERM; SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

stop_daemons() {
    if live_pid "$STATE/run/slurmctld.pid" slurmctld >/dev/null; then
        # the jobs and steps this cluster runs end first (their slurmstepd and tasks with them)
        scancel --full --quiet --user=root 2>/dev/null || true
        wait_for 15 jobs sh -c '[ -z "$(squeue -h -o %i 2>/dev/null)" ]' || say "jobs still listed after scancel"
    fi
    for n in $NODES; do stop_pid "$STATE/run/slurmd-$n.pid" slurmd; done
    stop_pid "$STATE/run/slurmctld.pid" slurmctld
    stop_pid "$STATE/munge/munged.pid" munged
}

stop() {
    [ "$(id -u)" = 0 ] || die "must run as root"
    check_settings
    stop_daemons
    remove_hosts
    say "stopped"
}

status() {
    rc=0
    pidfiles | while read -r file prog; do
        if pid=$(live_pid "$file" "$prog"); then
            echo "$(basename "$file" .pid): running (pid $pid)"
        else
            echo "$(basename "$file" .pid): not running"
        fi
    done
    all_running || rc=1
    if [ "$rc" = 0 ]; then
        sinfo -N -o '%N %t %c' || rc=1
    fi
    return "$rc"
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$SLURM_CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
