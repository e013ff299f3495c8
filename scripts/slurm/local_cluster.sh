#!/usr/bin/env bash
# Start or stop a one-node Slurm cluster on this machine (munged, slurmctld, slurmd).
#
#   scripts/slurm/local_cluster.sh start DIR   # prints SLURM_CONF=DIR/slurm.conf once idle
#   SLURM_CONF=DIR/slurm.conf sbatch --wait scripts/slurm/study.sbatch ...
#   scripts/slurm/local_cluster.sh stop DIR    # cancels its jobs, stops its daemons
#
# Everything the cluster owns (config, munge key and socket, state, logs, pid files)
# lives in DIR and its ports are picked free at start, so it leaves /etc alone and
# several clusters can run side by side (parallel test runs). It must run as root:
# slurmd starts job steps through setuid. Debian's slurmctld, slurmd, slurm-client
# and munge packages provide the daemons. SLURMCTLD_PORT and SLURMD_PORT force ports.
set -euo pipefail

readonly PROG=local_cluster.sh
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly TEMPLATE="$HERE/local/slurm.conf"
readonly DAEMONS=(munged slurmctld slurmd)
# Seconds to wait for the node to become idle, and for jobs or a daemon to end.
readonly START_TIMEOUT=60
readonly STOP_TIMEOUT=20

die() {
    echo "$PROG: error: $*" >&2
    exit 1
}

usage() {
    echo "usage: $PROG start|stop DIR" >&2
    exit 2
}

free_port() {
    # The kernel picks a port nobody holds; the daemon binds it a moment later.
    python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

write_config() {
    local dir="$1"
    sed -e "s|@DIR@|$dir|g" \
        -e "s|@CTLD_HOST@|$(hostname -s)|g" \
        -e "s|@CTLD_PORT@|${SLURMCTLD_PORT:-$(free_port)}|g" \
        -e "s|@SLURMD_PORT@|${SLURMD_PORT:-$(free_port)}|g" \
        -e "s|@USER@|$(id -un)|g" \
        -e "s|@CPUS@|$(nproc)|g" \
        "$TEMPLATE" > "$dir/slurm.conf"
}

start_munge() {
    local dir="$1"
    # The key stays private; the socket folder must be searchable by every user
    # (any user's client connects) and writable by its owner alone. --force lets
    # munged accept a parent folder others cannot enter (pytest's temporary folders).
    mkdir -m 700 "$dir/munge-key"
    mkdir -m 755 "$dir/munge"
    head -c 1024 /dev/urandom > "$dir/munge-key/munge.key"
    chmod 400 "$dir/munge-key/munge.key"
    munged --force --socket="$dir/munge/munge.socket" \
        --key-file="$dir/munge-key/munge.key" --seed-file="$dir/munge-key/munged.seed" \
        --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log"
}

# The pid in DIR/NAME.pid if that process is still the daemon NAME (a stale pid
# file may name an unrelated process by now); nothing otherwise.
daemon_pid() {
    local file="$1/$2.pid" pid
    [[ -f "$file" ]] || return 0
    pid="$(< "$file")"
    if [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2> /dev/null)" == "$2" ]]; then
        echo "$pid"
    fi
}

node_state() {
    SLURM_CONF="$1/slurm.conf" sinfo --noheader --Node --nodes=localhost --format=%t \
        2> /dev/null || true
}

show_logs() {
    local log
    for log in "$1"/log/*; do
        [[ -f "$log" ]] || continue
        echo "--- $log (last lines)" >&2
        tail -n 15 "$log" >&2
    done
}

# Asked every 0.2 s: the node is idle within a second or two of slurmd's start.
wait_until_idle() {
    local dir="$1" tenths=0 name
    until [[ "$(node_state "$dir")" == "idle" ]]; do
        # A daemon that died (a port taken meanwhile, a bad config) fails the start
        # now rather than after the whole timeout.
        for name in "${DAEMONS[@]}"; do
            if (( tenths >= 30 )) && [[ -z "$(daemon_pid "$dir" "$name")" ]]; then
                show_logs "$dir"
                die "$name is not running; its log is above"
            fi
        done
        if (( tenths >= START_TIMEOUT * 10 )); then
            show_logs "$dir"
            die "node not idle after ${START_TIMEOUT}s (state '$(node_state "$dir")'); logs above"
        fi
        sleep 0.2
        tenths=$((tenths + 2))
    done
}

start() {
    local dir="$1" tool
    [[ $EUID -eq 0 ]] || die "must run as root: slurmd starts job steps through setuid"
    for tool in munged slurmctld slurmd sinfo sbatch scontrol python3; do
        command -v "$tool" > /dev/null \
            || die "$tool not found; install: apt-get install slurmctld slurmd slurm-client munge"
    done
    [[ -f "$TEMPLATE" ]] || die "config template $TEMPLATE is missing"
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    [[ ! -e "$dir/slurm.conf" ]] || die "$dir holds a cluster already; stop it first"
    mkdir "$dir/log" "$dir/state" "$dir/spool"
    write_config "$dir"
    # A half-started cluster is stopped again: a failed start leaves no daemon behind.
    trap 'stop "$dir"' EXIT
    # The daemons detach; their stdio goes to a file, so that no caller waits for
    # the end of a pipe a daemon inherited.
    {
        start_munge "$dir"
        slurmctld -f "$dir/slurm.conf"
        slurmd -f "$dir/slurm.conf" -N localhost
    } < /dev/null >> "$dir/log/daemons.out" 2>&1
    wait_until_idle "$dir"
    trap - EXIT
    echo "SLURM_CONF=$dir/slurm.conf"
}

# Jobs still running (a test that failed half-way) would leave slurmstepd and its
# torchrun processes behind once slurmd is gone: cancel them and wait.
cancel_jobs() {
    local dir="$1" tenths=0
    [[ -n "$(daemon_pid "$dir" slurmctld)" ]] || return 0
    export SLURM_CONF="$dir/slurm.conf"
    scancel --quiet --user="$(id -un)" 2> /dev/null || true
    while [[ -n "$(squeue --noheader --format=%i 2> /dev/null)" ]]; do
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
    while kill -0 "$pid" 2> /dev/null; do
        if (( tenths >= STOP_TIMEOUT * 10 )); then
            echo "$PROG: $name (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT}s; killing it" >&2
            kill -KILL "$pid" 2> /dev/null || true
            return 0
        fi
        sleep 0.1
        tenths=$((tenths + 1))
    done
}

stop() {
    local dir="$1" name pid
    local -A signalled=()
    [[ -d "$dir" ]] || return 0
    cancel_jobs "$dir"
    # Each daemon takes a second or two to shut down: signal all, then wait for all.
    for name in "${DAEMONS[@]}"; do
        pid="$(daemon_pid "$dir" "$name")"
        if [[ -n "$pid" ]] && kill -TERM "$pid" 2> /dev/null; then
            signalled[$name]="$pid"
        fi
    done
    for name in "${!signalled[@]}"; do
        wait_for_exit "${signalled[$name]}" "$name"
    done
}

[[ $# -eq 2 ]] || usage
case "$1" in
    start) start "$2" ;;
    stop) stop "$2" ;;
    *) usage ;;
esac
