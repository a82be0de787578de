#!/usr/bin/env bash
# Stop the cluster deploy/local/up.sh started in DIR, and only it:
#
#   deploy/local/down.sh [--state-dir DIR] [--timeout S]
#
# Each node is a `ray start --block` that up.sh started as the leader of a session of its own
# (DIR/pids). SIGTERM makes it stop its node's daemons; what is left of the session after
# --timeout seconds (default 30) is killed with SIGKILL. Processes are found by the recorded
# session ids alone, never by name: other Rays on this machine are not touched (which is
# why this is not `ray stop`). A recorded pid is signalled only while it is still that node:
# it leads its own session and its command line is `ray start ... --temp-dir=T`, with T the
# cluster's own Ray temp dir (DIR/ray_temp_dir, a random name); a pid the system gave to
# another process since is left alone. Then the cluster's private temp directory is removed,
# but only a /tmp/stalwart-ray-XXXXXX directory of this user's own (no `..`, no symlink), and
# DIR's pids, env and auth_token; logs/ stays.
set -euo pipefail

STATE_DIR=.local-cluster
TIMEOUT=30

die() { echo "down.sh: error: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --state-dir) STATE_DIR=${2:?--state-dir needs a value}; shift 2 ;;
        --timeout) TIMEOUT=${2:?--timeout needs a value}; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "--timeout must be a number of seconds, got '$TIMEOUT'"
PIDS_FILE=$STATE_DIR/pids
[ -f "$PIDS_FILE" ] || die "no cluster recorded in $STATE_DIR (no $PIDS_FILE)"

# members SID: the pids of the live processes in session SID (workers get process groups of
# their own inside the node's session, so the session, not the group, holds them all).
members() { ps -e -o pid=,sid= | awk -v sid="$1" '$2 == sid { print $1 }'; }

# The cluster's Ray temp dir, as up.sh passed it to every node's `ray start --temp-dir`.
RAY_TEMP=
[ ! -f "$STATE_DIR/ray_temp_dir" ] || RAY_TEMP=$(cat "$STATE_DIR/ray_temp_dir")
[ -n "$RAY_TEMP" ] || echo "down.sh: no $STATE_DIR/ray_temp_dir: no recorded pid can be" \
    "told from another process, so none is signalled" >&2

# is_node PID: PID is still the node up.sh started: it leads its own session, and its command
# line (the interpreter, then the `ray` script and its arguments) is this cluster's
# `ray start`, named by the cluster's own --temp-dir.
is_node() {
    local args
    [ -n "$RAY_TEMP" ] || return 1
    [ "$(ps -o sid= -p "$1" 2>/dev/null | tr -d ' ')" = "$1" ] || return 1
    args=$(tr '\0' '\n' <"/proc/$1/cmdline" 2>/dev/null) || return 1
    grep -qxF start <<<"$args" && grep -qxF -- "--temp-dir=$RAY_TEMP" <<<"$args"
}

sessions=()
while read -r name pid _; do
    [ -n "$name" ] || continue
    [[ $pid =~ ^[1-9][0-9]*$ ]] || { echo "$name: '$pid' is not a pid: skipped" >&2; continue; }
    if is_node "$pid"; then
        echo "stopping $name (ray start, pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        sessions+=("$pid")
    elif ps -p "$pid" >/dev/null 2>&1; then
        # The pid was reused by another process since (the node died): not ours to stop.
        echo "$name (pid $pid) is not running; pid $pid is now another process: left alone"
    else
        echo "$name (pid $pid) is not running"
        # Its daemons may outlive it (a `ray start` killed with SIGKILL): same session id,
        # which the kernel gives no new process while any member of the session lives.
        if [ -n "$(members "$pid")" ]; then sessions+=("$pid"); fi
    fi
done < <(tac "$PIDS_FILE") # worker nodes first, the head last

deadline=$((SECONDS + TIMEOUT))
left() { for sid in "${sessions[@]}"; do members "$sid"; done; }
if [ ${#sessions[@]} -gt 0 ]; then
    while [ -n "$(left)" ] && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.5
    done
    stragglers=$(left)
    if [ -n "$stragglers" ]; then
        # shellcheck disable=SC2086 # split on purpose: the PIDs on one line
        echo "after ${TIMEOUT}s, killing what is left:" $stragglers
        for sid in "${sessions[@]}"; do
            kill -KILL -- "-$sid" 2>/dev/null || true # the node's own process group
        done
        # shellcheck disable=SC2086
        kill -KILL $stragglers 2>/dev/null || true # workers' groups in the same sessions
        sleep 0.5
    fi
fi

# private_dir PATH: the directory up.sh made with mktemp for the Ray temp dir PATH (PATH's
# parent; or PATH itself, as an earlier up.sh recorded it), if it is one: named
# stalwart-ray-XXXXXX directly under /tmp (no `..`, no symlink on the way), a directory of
# this user's own. Anything else is not removed.
private_dir() {
    [[ $1 =~ ^(/tmp/stalwart-ray-[A-Za-z0-9_]+)(/ray)?$ ]] || return 1
    local dir=${BASH_REMATCH[1]}
    [ -d "$dir" ] && [ ! -L "$dir" ] && [ -O "$dir" ] || return 1
    [ "$(realpath -e -- "$dir")" = "$dir" ] || return 1
    echo "$dir"
}

if [ -f "$STATE_DIR/ray_temp_dir" ]; then
    if private_dir=$(private_dir "$RAY_TEMP"); then
        rm -rf -- "$private_dir"
    else
        echo "down.sh: $STATE_DIR/ray_temp_dir names '$RAY_TEMP', not a" \
            "/tmp/stalwart-ray-XXXXXX directory of this user's own: not removed" >&2
    fi
    rm -f "$STATE_DIR/ray_temp_dir"
fi
rm -f "$PIDS_FILE" "$STATE_DIR/env" "$STATE_DIR/auth_token"
echo "cluster in $STATE_DIR stopped (logs kept in $STATE_DIR/logs)"
