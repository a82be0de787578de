#!/usr/bin/env bash
# Stop the cluster deploy/local/up.sh started in DIR, and only it:
#
#   deploy/local/down.sh [--state-dir DIR] [--timeout S]
#
# Each node is a `ray start --block` that up.sh started as the leader of a session of its own
# (DIR/pids). SIGTERM makes it stop its node's daemons; what is left of the session after
# --timeout seconds (default 30) is killed with SIGKILL. Processes are found by the recorded
# session ids alone, never by name: other Rays on this machine are not touched (which is
# why this is not `ray stop`). Then DIR's pids, env and auth_token are removed; logs/ stays.
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

sessions=()
while read -r name pid; do
    # A recorded pid counts only while it still leads its own session: a pid the system
    # reused for something else since is left alone.
    if [ "$(ps -o sid= -p "$pid" 2>/dev/null | tr -d ' ')" = "$pid" ]; then
        echo "stopping $name (ray start, pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        sessions+=("$pid")
    else
        echo "$name (pid $pid) is not running"
        # Its daemons may outlive it (a `ray start` killed with SIGKILL): same session id.
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

# The cluster's own Ray temp dir (written by up.sh; only a /tmp/stalwart-ray-* path is removed)
if [ -f "$STATE_DIR/ray_temp_dir" ]; then
    ray_tmp=$(cat "$STATE_DIR/ray_temp_dir")
    case "$ray_tmp" in
        /tmp/stalwart-ray-*) rm -rf -- "$ray_tmp" ;;
    esac
    rm -f "$STATE_DIR/ray_temp_dir"
fi
rm -f "$PIDS_FILE" "$STATE_DIR/env" "$STATE_DIR/auth_token"
echo "cluster in $STATE_DIR stopped (logs kept in $STATE_DIR/logs)"
