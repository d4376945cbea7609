# Sourced by .ci/run: a test phase with a time limit, and what the run left running.
#
#   bounded SECONDS LOG COMMAND...   COMMAND in a session of its own, its output in LOG (a file:
#                                    a process it leaves behind holds no pipe of CI's open); stopped
#                                    after SECONDS (TERM, then KILL 30 s later), with the machine's
#                                    state added to LOG. Its exit status is COMMAND's (124: stopped).
#   stop_leftovers                   kills every process this run started that still runs (Ray's
#                                    and vLLM's servers start sessions of their own): each carries
#                                    SPANRL_CI_RUN in its environment
#   machine_state                    memory, disk, load and any kernel OOM kill, for a failure's log
#
# Why: a verl test run that lost an xdist worker once waited, with no output, until CI's own limit
# (5400 s) ended it; with these, such a run fails within the phase's limit, its log printed.

export SPANRL_CI_RUN="${SPANRL_CI_RUN:-$$-$RANDOM}"

machine_state() {
    echo "[.ci/run] the machine: load $(cut -d' ' -f1-3 /proc/loadavg)"
    free -m
    df -h . /tmp | uniq
    dmesg 2>/dev/null | grep -iE "out of memory|killed process" | tail -n 5 || true
}

bounded() {
    local limit=$1 log=$2 status=0
    shift 2
    setsid --wait timeout --kill-after=30 "$limit" "$@" >"$log" 2>&1 || status=$?
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        {
            echo "[.ci/run] stopped after its limit of $limit s: $*"
            machine_state
        } >>"$log"
    fi
    return "$status"
}

stop_leftovers() {
    local environ pid
    for environ in /proc/[0-9]*/environ; do
        pid=${environ#/proc/}
        pid=${pid%/environ}
        if [ "$pid" != "$$" ] && [ "$pid" != "$BASHPID" ] &&
            grep -qzx "SPANRL_CI_RUN=$SPANRL_CI_RUN" "$environ" 2>/dev/null; then
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
}
