#!/usr/bin/env bash
# Start or stop a Slurm cluster of N nodes on this one machine: munged, slurmctld, and a
# slurmd per node, each node a host of its own (docs/cluster.md says how it is built).
#
#   scripts/slurm/local_cluster.sh start [--nodes N] [--cpus C] DIR
#       # prints: export SLURM_CONF=DIR/slurm.conf PATH=DIR/bin:$PATH (eval it)
#   sbatch --wait --nodes=2 scripts/slurm/study.sbatch ...   # its clients on that PATH
#   scripts/slurm/local_cluster.sh stop DIR    # cancels its jobs, stops its daemons, ends
#                                              # every process on its nodes, removes its
#                                              # namespaces
#   scripts/slurm/local_cluster.sh start-node DIR NODE  # NODE's slurmd again, after it died
#   scripts/slurm/local_cluster.sh check       # can this machine run one? (the reason if not)
#
# Each node (node1..nodeN) runs in a network, hostname and mount namespace of its own; a
# veth pair joins it to a bridge in the controller's namespace (slurmctld, host
# `controller`). Addresses come from 198.18.0.0/15 (reserved for benchmarking: no real
# network uses it), the namespaces have no default route, and the hosts file and
# resolv.conf every daemon sees are the cluster's own (bind-mounted in its private mount
# namespace). The clients in DIR/bin enter the controller's network namespace to reach
# it. Everything the cluster owns (config, munge key and socket, state, logs, pid files,
# its namespaces, bound at DIR/ns/*) lives in DIR, so it leaves /etc, /run and the
# machine's network alone, and several clusters run side by side (parallel test runs).
# It must run as root: slurmd starts job steps through setuid, and namespaces need
# CAP_SYS_ADMIN and CAP_NET_ADMIN. Debian's slurmctld, slurmd, slurm-client, munge and
# iproute2 packages provide the tools.
set -euo pipefail

readonly PROG=local_cluster.sh
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly TEMPLATE="$HERE/local/slurm.conf"
readonly TOOLS=(munged slurmctld slurmd sinfo sbatch srun squeue scontrol scancel ip nsenter
                unshare mount umount stat)
# The Slurm clients DIR/bin wraps.
readonly CLIENTS=(sbatch srun salloc squeue sinfo scontrol scancel sacct sstat sattach)
readonly MAX_NODES=64
readonly CONTROLLER=controller
readonly CONTROLLER_ADDR=198.18.0.1
readonly PREFIX=15
# Seconds to wait for the nodes to become idle, and for jobs or a daemon to end.
readonly START_TIMEOUT=60
readonly STOP_TIMEOUT=20
# Seconds slurmctld waits for a silent slurmd before it calls the node DOWN.
readonly SLURMD_TIMEOUT=10

die() {
    echo "$PROG: error: $*" >&2
    exit 1
}

usage() {
    echo "usage: $PROG start [--nodes N] [--cpus C] DIR | stop DIR | start-node DIR NODE |" \
        "check" >&2
    exit 2
}

node_name() { echo "node$1"; }
node_addr() { echo "198.18.1.$1"; }

# ------------------------------------------------------------------ can this machine?
# One line saying why this machine cannot run a cluster; nothing where it can.
missing_capability() {
    local tool
    if [[ $EUID -ne 0 ]]; then
        echo "the local Slurm cluster needs root: slurmd starts job steps through setuid"
        return
    fi
    for tool in "${TOOLS[@]}"; do
        if ! command -v "$tool" > /dev/null; then
            echo "$tool not found; install: apt-get install slurmctld slurmd slurm-client" \
                "munge iproute2"
            return
        fi
    done
    # What start does, in a namespace that vanishes with the probe.
    if ! unshare --net --uts --mount --propagation private \
            sh -c 'ip link add probe0 type veth peer name probe1' > /dev/null 2>&1; then
        echo "this machine cannot create network namespaces with veth pairs" \
            "(needs CAP_SYS_ADMIN and CAP_NET_ADMIN; a container started without them?)"
    fi
}

check() {
    local reason
    reason="$(missing_capability)"
    [[ -z "$reason" ]] || { echo "$reason"; exit 1; }
    echo "ok"
}

# ------------------------------------------------------------------------ namespaces
# A network namespace of the cluster, kept alive by a bind mount at DIR/ns/NAME.
new_namespace() {
    local dir="$1" name="$2"
    touch "$dir/ns/$name"
    unshare --net="$dir/ns/$name" ip link set lo up
}

in_net() {
    local dir="$1" name="$2"
    shift 2
    nsenter --net="$dir/ns/$name" "$@"
}

build_network() {
    local dir="$1" nodes="$2" i
    new_namespace "$dir" "$CONTROLLER"
    in_net "$dir" "$CONTROLLER" ip link add br0 type bridge
    in_net "$dir" "$CONTROLLER" ip addr add "$CONTROLLER_ADDR/$PREFIX" dev br0
    in_net "$dir" "$CONTROLLER" ip link set br0 up
    for (( i = 1; i <= nodes; i++ )); do
        new_namespace "$dir" "$(node_name "$i")"
        # The node's end is created inside its namespace: it never appears in this one's.
        in_net "$dir" "$CONTROLLER" ip link add "veth$i" type veth peer name eth0 \
            netns "$dir/ns/$(node_name "$i")"
        in_net "$dir" "$CONTROLLER" ip link set "veth$i" master br0 up
        in_net "$dir" "$(node_name "$i")" ip addr add "$(node_addr "$i")/$PREFIX" dev eth0
        in_net "$dir" "$(node_name "$i")" ip link set eth0 up
    done
}

write_name_files() {
    local dir="$1" nodes="$2" i
    mkdir "$dir/etc"
    # Each address twice: as IPv4, and as the IPv6-mapped form a dual-stack socket reports
    # its IPv4 peers in (c10d's store looks its clients' names up in it, and without it
    # prints "The hostname of the client socket cannot be retrieved" for each).
    {
        echo "127.0.0.1 localhost"
        echo "::1 localhost"
        echo "::ffff:127.0.0.1 localhost"
        echo "$CONTROLLER_ADDR $CONTROLLER"
        echo "::ffff:$CONTROLLER_ADDR $CONTROLLER"
        for (( i = 1; i <= nodes; i++ )); do
            echo "$(node_addr "$i") $(node_name "$i")"
            echo "::ffff:$(node_addr "$i") $(node_name "$i")"
        done
    } > "$dir/etc/hosts"
    # No name server: a name the hosts file lacks fails at once, on loopback, rather than
    # after a query that could leave the cluster.
    echo "nameserver 127.0.0.1" > "$dir/etc/resolv.conf"
}

# Run a command as host NAME: in its network namespace, and in a hostname and mount
# namespace of its own where the cluster's hosts file and resolv.conf are bound over
# /etc's (nsenter, not `ip netns exec`, which remounts /sys: slurmd then finds no
# /sys/fs/cgroup). The command's children, job steps included, inherit all three.
as_host() {
    local dir="$1" name="$2"
    shift 2
    in_net "$dir" "$name" unshare --uts --mount --propagation private -- sh -c '
        echo "$1" > /proc/sys/kernel/hostname &&
        mount --bind "$2/etc/hosts" /etc/hosts &&
        mount --bind "$2/etc/resolv.conf" /etc/resolv.conf &&
        shift 2 && exec "$@"' sh "$name" "$dir" "$@"
}

# Which network namespace (device:inode) a file or a process's link names.
namespace_id() {
    stat -L -c %d:%i "$1" 2> /dev/null || true
}

cluster_namespaces() {
    local file
    for file in "$1"/ns/*; do
        [[ -e "$file" ]] || continue
        namespace_id "$file"
    done
}

# Every process whose network namespace is one of the cluster's.
processes_in_cluster() {
    local dir="$1" entry pid id
    local -A ours=()
    while read -r id; do
        [[ -n "$id" ]] && ours[$id]=1
    done < <(cluster_namespaces "$dir")
    (( ${#ours[@]} )) || return 0
    for entry in /proc/[0-9]*; do
        pid="${entry#/proc/}"
        id="$(namespace_id "$entry/ns/net")"
        if [[ -n "$id" && -n "${ours[$id]:-}" ]] && running "$pid"; then
            echo "$pid"
        fi
    done
}

remove_namespaces() {
    local dir="$1" file
    for file in "$dir"/ns/*; do
        [[ -e "$file" ]] || continue
        # A namespace ends with its last process and its last mount.
        if mountpoint -q "$file" 2> /dev/null || grep -qF " $file " /proc/self/mountinfo; then
            umount "$file" 2> /dev/null || umount --lazy "$file" || true
        fi
        rm -f "$file"
    done
}

# ------------------------------------------------------------------------ the daemons
write_config() {
    local dir="$1" nodes="$2" cpus="$3" i lines="" list
    for (( i = 1; i <= nodes; i++ )); do
        lines+="NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") CPUs=$cpus State=UNKNOWN"
        (( i < nodes )) && lines+=$'\n'
    done
    list="$(node_name 1)"
    (( nodes == 1 )) || list="node[1-$nodes]"
    local template
    template="$(< "$TEMPLATE")"
    template="${template//@NODE_LINES@/$lines}"
    sed -e "s|@DIR@|$dir|g" \
        -e "s|@NODES@|$nodes|g" \
        -e "s|@NODE_LIST@|$list|g" \
        -e "s|@CTLD_HOST@|$CONTROLLER|g" \
        -e "s|@CTLD_ADDR@|$CONTROLLER_ADDR|g" \
        -e "s|@SLURMD_TIMEOUT@|$SLURMD_TIMEOUT|g" \
        -e "s|@USER@|$(id -un)|g" \
        <<< "$template" > "$dir/slurm.conf"
}

# DIR/bin/NAME for each Slurm client: the real one, in the controller's network namespace
# (the only one that reaches it) unless already inside one of the cluster's (a job on a
# node), with the cluster's SLURM_CONF.
write_clients() {
    local dir="$1" client real
    mkdir "$dir/bin"
    for client in "${CLIENTS[@]}"; do
        real="$(command -v "$client" || true)"
        [[ -n "$real" ]] || continue
        cat > "$dir/bin/$client" << EOF
#!/bin/sh
# $client of the local Slurm cluster in $dir (scripts/slurm/local_cluster.sh).
SLURM_CONF='$dir/slurm.conf'; export SLURM_CONF
here=\$(stat -L -c %d:%i /proc/self/ns/net)
for ns in '$dir'/ns/*; do
    [ "\$(stat -L -c %d:%i "\$ns" 2> /dev/null)" = "\$here" ] && exec '$real' "\$@"
done
exec nsenter --net='$dir/ns/$CONTROLLER' '$real' "\$@"
EOF
        chmod 755 "$dir/bin/$client"
    done
}

start_munge() {
    local dir="$1"
    # The key stays private; the socket folder must be searchable by every user
    # (any user's client connects) and writable by its owner alone. --force lets
    # munged accept a parent folder others cannot enter (pytest's temporary folders).
    # A Unix socket is reached through the filesystem, from every namespace.
    mkdir -m 700 "$dir/munge-key"
    mkdir -m 755 "$dir/munge"
    head -c 1024 /dev/urandom > "$dir/munge-key/munge.key"
    chmod 400 "$dir/munge-key/munge.key"
    as_host "$dir" "$CONTROLLER" munged --force --socket="$dir/munge/munge.socket" \
        --key-file="$dir/munge-key/munge.key" --seed-file="$dir/munge-key/munged.seed" \
        --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log"
}

# Whether PID runs: it exists and is not a zombie (a daemon detaches from its parent, so
# it is reaped by the machine's init, which may take its time).
running() {
    local stat
    stat="$(cat "/proc/$1/stat" 2> /dev/null)" || return 1
    stat="${stat##*) }"
    [[ -n "$stat" && "${stat:0:1}" != Z ]]
}

# The pid in FILE if that process is still the daemon NAME (a stale pid file may name an
# unrelated process by now); nothing otherwise.
daemon_pid() {
    local file="$1" name="$2" pid
    [[ -f "$file" ]] || return 0
    pid="$(< "$file")"
    if [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2> /dev/null)" == "$name" ]] \
            && running "$pid"; then
        echo "$pid"
    fi
}

# "FILE NAME" of every daemon of the cluster, one a line.
daemons() {
    local dir="$1" file
    echo "$dir/munged.pid munged"
    echo "$dir/slurmctld.pid slurmctld"
    for file in "$dir"/slurmd.*.pid; do
        [[ -e "$file" ]] && echo "$file slurmd"
    done
    return 0
}

show_logs() {
    local log
    for log in "$1"/log/*; do
        [[ -f "$log" ]] || continue
        echo "--- $log (last lines)" >&2
        tail -n 15 "$log" >&2
    done
}

idle_nodes() {
    "$1/bin/sinfo" --noheader --Node --states=idle --format=%N 2> /dev/null | sort -u \
        | grep -c . || true
}

# Asked every 0.2 s: the nodes are idle within a second or two of slurmd's start.
wait_until_idle() {
    local dir="$1" nodes="$2" tenths=0 file name
    until (( $(idle_nodes "$dir") == nodes )); do
        # A daemon that died (a bad config, a missing tool) fails the start now rather
        # than after the whole timeout.
        if (( tenths >= 30 )); then
            while read -r file name; do
                if [[ -z "$(daemon_pid "$file" "$name")" ]]; then
                    show_logs "$dir"
                    die "$name ($(basename "$file")) is not running; its log is above"
                fi
            done < <(daemons "$dir")
        fi
        if (( tenths >= START_TIMEOUT * 10 )); then
            show_logs "$dir"
            die "$(idle_nodes "$dir") of $nodes node(s) idle after ${START_TIMEOUT}s; logs above"
        fi
        sleep 0.2
        tenths=$((tenths + 2))
    done
}

positive() {
    [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 '$2' is not a positive integer"
}

start() {
    local nodes=1 cpus dir="" reason i
    cpus="$(nproc)"
    while (( $# )); do
        case "$1" in
            --nodes) [[ $# -ge 2 ]] || usage; nodes="$2"; shift 2 ;;
            --nodes=*) nodes="${1#*=}"; shift ;;
            --cpus) [[ $# -ge 2 ]] || usage; cpus="$2"; shift 2 ;;
            --cpus=*) cpus="${1#*=}"; shift ;;
            -*) usage ;;
            *) [[ -z "$dir" ]] || usage; dir="$1"; shift ;;
        esac
    done
    [[ -n "$dir" ]] || usage
    positive --nodes "$nodes"
    positive --cpus "$cpus"
    (( nodes <= MAX_NODES )) || die "--nodes $nodes is more than this script's $MAX_NODES"
    reason="$(missing_capability)"
    [[ -z "$reason" ]] || die "$reason"
    [[ -f "$TEMPLATE" ]] || die "config template $TEMPLATE is missing"
    # slurm.conf has no quoting: a path it names must be plain.
    [[ "$dir" =~ ^[A-Za-z0-9_./+-]+$ ]] \
        || die "DIR '$dir' has characters slurm.conf cannot hold;" \
            "allowed: letters, digits, _ . / + -"
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    [[ "$dir" =~ ^[A-Za-z0-9_./+-]+$ ]] || die "DIR '$dir' has characters slurm.conf cannot hold"
    # A job step's Unix socket is DIR/spool/NODE/NODE_JOB.STEP (a batch step's id has 10
    # digits, a job's up to 7 here): a socket's path holds at most 107 bytes, and slurmd
    # would requeue every job it cannot launch, silently.
    local room=$(( 107 - 35 - 2 * ${#nodes} ))
    (( ${#dir} <= room )) || die "DIR '$dir' is too long: its job steps' sockets would" \
        "take $(( ${#dir} + 107 - room )) characters, a Unix socket's path at most 107;" \
        "allowed: a DIR of at most $room characters (a link to it will do)"
    [[ ! -e "$dir/slurm.conf" ]] || die "$dir holds a cluster already; stop it first"
    mkdir "$dir/log" "$dir/state" "$dir/spool" "$dir/ns"
    for (( i = 1; i <= nodes; i++ )); do
        mkdir "$dir/spool/$(node_name "$i")"
    done
    write_config "$dir" "$nodes" "$cpus"
    write_name_files "$dir" "$nodes"
    write_clients "$dir"
    # A half-started cluster is stopped again: a failed start leaves nothing behind.
    trap 'stop "$dir"' EXIT
    build_network "$dir" "$nodes"
    # The daemons detach; their stdio goes to a file, so that no caller waits for the end
    # of a pipe a daemon inherited.
    {
        start_munge "$dir"
        as_host "$dir" "$CONTROLLER" slurmctld -f "$dir/slurm.conf"
        for (( i = 1; i <= nodes; i++ )); do
            as_host "$dir" "$(node_name "$i")" slurmd -f "$dir/slurm.conf" -N "$(node_name "$i")"
        done
    } < /dev/null >> "$dir/log/daemons.out" 2>&1
    wait_until_idle "$dir" "$nodes"
    trap - EXIT
    echo "export SLURM_CONF='$dir/slurm.conf' PATH='$dir/bin':\"\$PATH\""
}

# ------------------------------------------------------------------------------ stop
# Jobs still running (a test that failed half-way) are cancelled, and waited for while
# they end as Slurm ends them (SIGTERM, then SIGKILL after KillWait); where a node's
# slurmd is gone, its steps cannot end that way, and end_leftovers kills them.
cancel_jobs() {
    local dir="$1" tenths=0 file
    [[ -n "$(daemon_pid "$dir/slurmctld.pid" slurmctld)" && -x "$dir/bin/scancel" ]] \
        || return 0
    "$dir/bin/scancel" --quiet --user="$(id -un)" 2> /dev/null || true
    for file in "$dir"/slurmd.*.pid; do
        [[ -e "$file" && -z "$(daemon_pid "$file" slurmd)" ]] && return 0
    done
    while [[ -n "$("$dir/bin/squeue" --noheader --format=%i 2> /dev/null)" ]]; do
        if (( tenths >= STOP_TIMEOUT * 10 )); then
            echo "$PROG: jobs still listed after ${STOP_TIMEOUT}s; stopping anyway" >&2
            return 0
        fi
        sleep 0.2
        tenths=$((tenths + 2))
    done
}

# Wait for PID to exit; SIGKILL it if it outlives the stop timeout.
wait_for_exit() {
    local pid="$1" name="$2" tenths=0
    while running "$pid"; do
        if (( tenths >= STOP_TIMEOUT * 10 )); then
            echo "$PROG: $name (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT}s; killing it" >&2
            kill -KILL "$pid" 2> /dev/null || true
            return 0
        fi
        sleep 0.1
        tenths=$((tenths + 1))
    done
}

stop_daemons() {
    local dir="$1" file name pid
    local -A signalled=()
    # Each daemon takes a second or two to shut down: signal all, then wait for all.
    while read -r file name; do
        pid="$(daemon_pid "$file" "$name")"
        if [[ -n "$pid" ]] && kill -TERM "$pid" 2> /dev/null; then
            signalled[$pid]="$name"
        fi
    done < <(daemons "$dir")
    for pid in "${!signalled[@]}"; do
        wait_for_exit "$pid" "${signalled[$pid]}"
    done
}

# What outlived its daemons on the nodes (a job step whose slurmd was killed): killed,
# and waited for.
end_leftovers() {
    local dir="$1" pid tenths=0
    local -a left
    mapfile -t left < <(processes_in_cluster "$dir")
    (( ${#left[@]} )) || return 0
    echo "$PROG: killing ${#left[@]} process(es) left on the nodes: $(
        for pid in "${left[@]}"; do printf '%s ' "$pid:$(cat "/proc/$pid/comm" 2> /dev/null)"
        done)" >&2
    kill -KILL "${left[@]}" 2> /dev/null || true
    while [[ -n "$(processes_in_cluster "$dir")" ]] && (( tenths < STOP_TIMEOUT * 10 )); do
        sleep 0.1
        tenths=$((tenths + 1))
    done
}

stop() {
    local dir="$1"
    [[ -d "$dir" ]] || return 0
    dir="$(cd "$dir" && pwd)"
    cancel_jobs "$dir"
    stop_daemons "$dir"
    end_leftovers "$dir"
    remove_namespaces "$dir"
}

# ---------------------------------------------------------------------- start-node
# NODE's slurmd started again (after it died): it rejoins, and ends what its jobs left
# running while it was gone, as a restarted slurmd does.
start_node() {
    local dir="$1" name="$2"
    [[ -e "$dir/ns/$name" && "$name" != "$CONTROLLER" ]] || die "no node '$name' in $dir"
    dir="$(cd "$dir" && pwd)"
    [[ -z "$(daemon_pid "$dir/slurmd.$name.pid" slurmd)" ]] || die "$name's slurmd is running"
    as_host "$dir" "$name" slurmd -f "$dir/slurm.conf" -N "$name" \
        < /dev/null >> "$dir/log/daemons.out" 2>&1
}

case "${1:-}" in
    start) shift; start "$@" ;;
    stop) [[ $# -eq 2 ]] || usage; stop "$2" ;;
    start-node) [[ $# -eq 3 ]] || usage; start_node "$2" "$3" ;;
    check) [[ $# -eq 1 ]] || usage; check ;;
    *) usage ;;
esac
