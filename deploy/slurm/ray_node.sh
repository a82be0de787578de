#!/bin/bash
# Run by stalwart.sbatch's srun steps, once per node: one Ray node in the job's private
# directory on this node, and that directory removed when the node stops.
#
#   ray_node.sh JOB_DIR ray start ... --temp-dir=JOB_DIR/ray ... --block
#
# JOB_DIR is the directory the batch script made with mktemp -d (mode 0700, a random name).
# On the node that runs the batch script it exists already; on every other node it is made
# here, with mode 0700. A JOB_DIR that is already there and is not this user's own directory
# (a symlink, or one another user made after reading the name from `ps`) is refused: Ray's
# temp dir inside it holds the node's sockets and logs, and Ray makes that one world-writable.
# SIGTERM and SIGINT are passed on to `ray start`, which stops its node's processes; the
# directory goes once it has exited.
set -euo pipefail

die() { echo "ray_node.sh ($(hostname)): error: $*" >&2; exit 2; }

[ $# -ge 2 ] || die "usage: ray_node.sh JOB_DIR ray start ..."
job_dir=$1
shift

# The batch script's own directory (it runs on one of the nodes), or a new one made here.
if [ -e "$job_dir" ] || [ -L "$job_dir" ]; then
    [ -d "$job_dir" ] && [ ! -L "$job_dir" ] && [ -O "$job_dir" ] ||
        die "$job_dir exists and is not a directory of this user's own: refusing to run Ray in it"
    chmod 700 "$job_dir"
else
    mkdir -m 700 "$job_dir" || die "cannot make $job_dir"
fi

"$@" &
node=$!
trap 'kill -TERM "$node" 2>/dev/null || true' TERM INT
status=0
# `wait` returns early when a trapped signal comes: wait again while the node lives.
while :; do
    wait "$node" && status=0 || status=$?
    kill -0 "$node" 2>/dev/null || break
done
rm -rf -- "$job_dir" || true
exit "$status"
