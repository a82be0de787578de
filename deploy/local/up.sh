#!/usr/bin/env bash
# A Ray cluster of several nodes on this one machine, started with `ray start` as on real
# machines: a head (with the dashboard, for job submission) and N-1 worker nodes, each with
# its own CPUs and its own ports, with Ray's token authentication. Stop it with down.sh.
#
#   deploy/local/up.sh [--nodes N] [--cpus-per-node C] [--port P] [--dashboard-port D]
#                      [--state-dir DIR] [--object-store-mb M] [--timeout S]
#
# Each node is `setsid ray start ... --block` in the background: a session (and process
# group) of its own, so down.sh stops exactly these nodes and nothing else on a shared
# machine (never `ray stop`, which stops every Ray of this user). DIR receives:
#   env         `. DIR/env`: RAY_ADDRESS, RAY_API_SERVER_ADDRESS, STALWART_DASHBOARD, the token
#   auth_token  the cluster's token (mode 600), generated here; ~/.ray/auth_token is untouched
#   pids        one `node-I PID` line per node (PID = its session and process group id)
#   logs/       each `ray start`'s output
#   .rayignore, .gitignore  `*`: no job upload (nor git) takes DIR, wherever it is
#   ray_temp_dir  the path of the cluster's own Ray temp dir (/tmp/stalwart-ray-XXXXXX/ray:
#               Ray's sessions, sockets and logs, in a directory of mode 0700), removed by down.sh
#
# Ports: P (the head's GCS), P+1 (Ray Client server), D (dashboard); node I uses
# P+10(I+1) .. P+10(I+1)+5 for its raylet, object manager, agents and metrics, and
# P+200+200I .. P+399+200I for its worker processes. Everything below P+200+200N must be free.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

NODES=2
CPUS=2
PORT=6390
DASHBOARD_PORT=8265
STATE_DIR=.local-cluster
OBJECT_STORE_MB=512
TIMEOUT=120

die() { echo "up.sh: error: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES=${2:?--nodes needs a value}; shift 2 ;;
        --cpus-per-node) CPUS=${2:?--cpus-per-node needs a value}; shift 2 ;;
        --port) PORT=${2:?--port needs a value}; shift 2 ;;
        --dashboard-port) DASHBOARD_PORT=${2:?--dashboard-port needs a value}; shift 2 ;;
        --state-dir) STATE_DIR=${2:?--state-dir needs a value}; shift 2 ;;
        --object-store-mb) OBJECT_STORE_MB=${2:?--object-store-mb needs a value}; shift 2 ;;
        --timeout) TIMEOUT=${2:?--timeout needs a value}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

for pair in "--nodes:$NODES" "--cpus-per-node:$CPUS" "--port:$PORT" \
            "--dashboard-port:$DASHBOARD_PORT" "--object-store-mb:$OBJECT_STORE_MB" \
            "--timeout:$TIMEOUT"; do
    value=${pair#*:}
    [[ $value =~ ^[1-9][0-9]*$ ]] || die "${pair%%:*} must be a positive integer, got '$value'"
done
# Node I's fixed ports P+10(I+1)+k must stay below the worker ports at P+200.
[ "$NODES" -le 18 ] || die "--nodes $NODES: at most 18 nodes on one machine"
# Ray's own floor for a node's object store (75 MiB).
[ "$OBJECT_STORE_MB" -ge 75 ] || die "--object-store-mb must be at least 75, got $OBJECT_STORE_MB"
LAST_PORT=$((PORT + 199 + 200 * NODES))
[ "$LAST_PORT" -le 65535 ] || die "--port $PORT with $NODES nodes needs ports up to $LAST_PORT"
if [ "$DASHBOARD_PORT" -ge "$PORT" ] && [ "$DASHBOARD_PORT" -le "$LAST_PORT" ]; then
    die "--dashboard-port $DASHBOARD_PORT lies in the cluster's ports $PORT..$LAST_PORT"
fi
command -v ray >/dev/null || die "no 'ray' on PATH: activate stalwart's virtual environment"
# The interpreter next to `ray`, so the checks below import the same Ray the nodes run.
PYTHON=$(dirname "$(command -v ray)")/python
[ -x "$PYTHON" ] || PYTHON=python3

# A cluster already recorded in DIR: refuse while any of its nodes lives; forget a dead one.
if [ -f "$STATE_DIR/pids" ]; then
    while read -r _ pid; do
        if kill -0 "$pid" 2>/dev/null; then
            die "$STATE_DIR already holds a running cluster (node pid $pid); stop it with" \
                "deploy/local/down.sh --state-dir $STATE_DIR, or choose another --state-dir"
        fi
    done <"$STATE_DIR/pids"
    echo "up.sh: $STATE_DIR/pids lists no live node (a cluster that died); starting anew"
    rm -f "$STATE_DIR/pids" "$STATE_DIR/env"
fi

# Every port this cluster will bind must be free now: Ray would otherwise fail late, in a
# daemon's log, or (for worker ports) only when a worker happens to draw a taken one.
"$PYTHON" - "$PORT" "$LAST_PORT" "$DASHBOARD_PORT" <<'PY' || exit 2
import socket
import sys

first, last, dashboard = map(int, sys.argv[1:])
taken = []
for port in [dashboard, *range(first, last + 1)]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "taken"
    try:
        s.bind(("", port))
    except OSError:
        taken.append(port)
    finally:
        s.close()
if taken:
    which = "--dashboard-port" if taken[0] == dashboard else "--port"
    sys.exit(f"up.sh: error: port {taken[0]} is taken ({len(taken)} taken in all among "
             f"{dashboard} and {first}..{last}); choose another {which}")
PY

# Only now, with every check passed, does DIR receive anything.
mkdir -p "$STATE_DIR/logs"
STATE_DIR=$(cd "$STATE_DIR" && pwd)
# DIR holds the token: Ray leaves a directory with a `.rayignore` of `*` out of every job's
# working_dir (`stalwart submit`, `ray job submit --working-dir`), git one with a `.gitignore`.
for ignore in .rayignore .gitignore; do
    printf '# deploy/local state (the cluster token): never uploaded, never committed\n*\n' \
        >"$STATE_DIR/$ignore"
done
PIDS_FILE=$STATE_DIR/pids

# Token authentication with a token of this cluster's own, passed by environment, so the
# user's ~/.ray/auth_token (another cluster's token, perhaps) is neither read nor replaced.
TOKEN_FILE=$STATE_DIR/auth_token
(umask 077 && "$PYTHON" -c "import secrets; print(secrets.token_hex(32))" >"$TOKEN_FILE")
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=$(cat "$TOKEN_FILE")
export RAY_AUTH_TOKEN
# A RAY_ADDRESS left in this shell (another cluster's env) must not steer `ray start`.
unset RAY_ADDRESS RAY_API_SERVER_ADDRESS
# A Ray temp dir of this cluster's own: Ray's job supervisor finds the cluster a job's driver
# joins through <temp dir>/ray_current_cluster, which in the shared /tmp/ray names whichever
# Ray started last on this machine (a `stalwart run` of its own Ray, another test's).
# Short, under /tmp: Ray's socket paths inside it must stay under 108 bytes. Inside a directory
# of mode 0700 (mktemp -d): Ray makes its temp dir itself world-writable (mode 0777), and only
# the private parent keeps other users from its sockets and logs.
RAY_TMP=$(mktemp -d /tmp/stalwart-ray-XXXXXX)/ray
echo "$RAY_TMP" >"$STATE_DIR/ray_temp_dir"

pids=()
started_ok=0
cleanup_on_failure() {
    # Stop what this script started if it did not get to the end (the same steps as down.sh).
    if [ "$started_ok" = 0 ] && [ ${#pids[@]} -gt 0 ]; then
        echo "up.sh: stopping the nodes started so far" >&2
        # (a `ray start` still connecting to a head that died ignores SIGTERM: not long)
        "$(dirname "$0")/down.sh" --state-dir "$STATE_DIR" --timeout 10 >&2 || true
    fi
}
trap cleanup_on_failure EXIT

# start_node I ARGS...: node I as `ray start --block` in a new session; its PID recorded.
start_node() {
    local i=$1
    shift
    local base=$((PORT + 10 * (i + 1)))
    local workers=$((PORT + 200 + 200 * i))
    setsid ray start "$@" --num-cpus="$CPUS" --num-gpus=0 \
        --object-store-memory=$((OBJECT_STORE_MB * 1024 * 1024)) \
        --node-manager-port=$base --object-manager-port=$((base + 1)) \
        --dashboard-agent-listen-port=$((base + 2)) --dashboard-agent-grpc-port=$((base + 3)) \
        --runtime-env-agent-port=$((base + 4)) --metrics-export-port=$((base + 5)) \
        --min-worker-port=$workers --max-worker-port=$((workers + 199)) \
        --temp-dir="$RAY_TMP" --disable-usage-stats --log-style=record --block \
        </dev/null >"$STATE_DIR/logs/node-$i.log" 2>&1 &
    local pid=$!
    pids+=("$pid")
    echo "node-$i $pid" >>"$PIDS_FILE"
}

start_node 0 --head --port="$PORT" --ray-client-server-port=$((PORT + 1)) \
    --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT"
# Worker nodes on one machine share the head's session directory; one log monitor (the
# head's) already forwards every worker's output to drivers (`ray start --help`).
for ((i = 1; i < NODES; i++)); do
    start_node "$i" --address="127.0.0.1:$PORT" --include-log-monitor=false
done

# Wait for every node to be alive and the dashboard's job API to answer with the token.
"$PYTHON" - "$PORT" "$DASHBOARD_PORT" "$NODES" "$TIMEOUT" "$STATE_DIR" "${pids[@]}" <<'PY'
import os
import sys
import time
import urllib.request

port, dashboard, want, timeout = map(int, sys.argv[1:5])
state_dir, pids = sys.argv[5], [int(p) for p in sys.argv[6:]]
deadline = time.monotonic() + timeout


def check_nodes_running() -> None:
    for i, pid in enumerate(pids):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log = open(f"{state_dir}/logs/node-{i}.log").read().splitlines()[-15:]
            sys.exit(f"up.sh: error: node-{i} (`ray start`, pid {pid}) exited:\n  "
                     + "\n  ".join(log))


def wait(what: str, ready) -> None:
    while not ready():
        check_nodes_running()
        if time.monotonic() > deadline:
            sys.exit(f"up.sh: error: {what} within --timeout {timeout}s; see {state_dir}/logs")
        time.sleep(1)


def nodes_started() -> bool:
    # `ray start --block` logs this once all of its node's daemons are up.
    return all("This command will now block forever" in open(f"{state_dir}/logs/node-{i}.log")
               .read() for i in range(len(pids)))


def dashboard_answers() -> bool:
    request = urllib.request.Request(
        f"http://127.0.0.1:{dashboard}/api/version",
        headers={"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


# Only then connect: ray.init on a head that is not (or no longer) there retries for a minute.
wait("not every node started", nodes_started)
import ray  # noqa: E402

try:
    ray.init(address=f"127.0.0.1:{port}", logging_level="ERROR", log_to_driver=False)
except Exception as exc:  # ConnectionError, RuntimeError, ...: the same for the user
    sys.exit(f"up.sh: error: cannot connect to the head at 127.0.0.1:{port}: {exc}")
wait(f"{want} nodes did not join", lambda: sum(n["Alive"] for n in ray.nodes()) >= want)
ray.shutdown()
wait("the dashboard did not answer", dashboard_answers)
# down.sh finds a node's processes by its session id, which must be the recorded pid.
for i, pid in enumerate(pids):
    if os.getsid(pid) != pid:
        sys.exit(f"up.sh: error: node-{i} (pid {pid}) does not lead its own session")
PY

umask 077
{
    echo "# deploy/local cluster in $STATE_DIR ($NODES nodes x $CPUS CPUs): . $STATE_DIR/env"
    echo "export RAY_ADDRESS=127.0.0.1:$PORT"
    echo "export RAY_API_SERVER_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT"
    echo "export STALWART_DASHBOARD=http://127.0.0.1:$DASHBOARD_PORT"
    echo "export RAY_AUTH_MODE=token"
    # Read from its file when sourced: the token is written down in one place only.
    # shellcheck disable=SC2016
    printf 'export RAY_AUTH_TOKEN="$(cat %q)"\n' "$TOKEN_FILE"
} >"$STATE_DIR/env"
started_ok=1

cat <<EOF
Ray cluster up: $NODES nodes x $CPUS CPUs, GCS 127.0.0.1:$PORT, dashboard http://127.0.0.1:$DASHBOARD_PORT
Use it from this machine:
  . $STATE_DIR/env
  stalwart run examples/gpt/config.toml --address \$RAY_ADDRESS
  stalwart submit examples/gpt/config.toml --address \$STALWART_DASHBOARD --follow
Stop it:
  deploy/local/down.sh --state-dir $STATE_DIR
EOF
