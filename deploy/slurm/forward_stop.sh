# shellcheck shell=bash
# Sourced by stalwart.sbatch: run the driver so that a stop reaches it as SIGTERM.
#
#   run_driver CMD [ARGS...]     # returns CMD's exit status; sets STOP_SIGNAL
#
# CMD runs in the background and the shell waits for it: bash runs a trap only between
# commands, so with the driver in the foreground a signal to the batch shell would wait for
# the run to end. While it waits, the shell passes these to CMD as SIGTERM, which stalwart
# answers by stopping after the step in flight and checkpointing it:
# - USR1: Slurm's warning before the time limit (#SBATCH --signal=B:USR1@SECONDS), sent to
#   the batch shell alone;
# - TERM: `scancel --batch JOBID`, also to the batch shell alone. A second one abandons that
#   checkpoint, as a second SIGTERM to stalwart does. (A plain `scancel` signals every process
#   of the job itself, Ray's nodes included, so the step in flight is lost either way.)
# INT is left alone: a Ctrl-C at a terminal reaches the driver itself (same process group).
# STOP_SIGNAL is the first signal passed on (USR1 or TERM), empty when none was; the shell
# keeps waiting until CMD has exited, however long its checkpoint takes.
# tests/unit/test_deploy_slurm.py runs this file with a fake driver.

STOP_SIGNAL=
_driver_pid=

_forward_stop() {
    STOP_SIGNAL=${STOP_SIGNAL:-$1}
    if [ -n "$_driver_pid" ]; then
        echo "stalwart.sbatch: SIG$1: the run stops after the step in flight (SIGTERM to $_driver_pid)" >&2
        kill -TERM "$_driver_pid" 2>/dev/null || true
    fi
}

run_driver() {
    local previous status=0
    previous=$(trap -p USR1 TERM)
    # Traps first: a signal between the fork and `$!` is not lost, it is sent just below.
    trap '_forward_stop USR1' USR1
    trap '_forward_stop TERM' TERM
    "$@" &
    _driver_pid=$!
    [ -z "$STOP_SIGNAL" ] || kill -TERM "$_driver_pid" 2>/dev/null || true
    # `wait` returns early (status 128+N) when a trapped signal comes: wait again while the
    # driver lives (a zombie still answers kill -0, and the next wait reaps it).
    while :; do
        wait "$_driver_pid" && status=0 || status=$?
        kill -0 "$_driver_pid" 2>/dev/null || break
    done
    # If the driver ended as a signal came, the last wait gave the trap's 128+N; bash keeps
    # the driver's own status, and this wait returns it.
    wait "$_driver_pid" && status=0 || status=$?
    _driver_pid=
    trap - USR1 TERM
    eval "$previous"
    return "$status"
}
