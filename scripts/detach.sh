#!/usr/bin/env bash
# Device work longer than one call (10 minutes at most, and the machine goes back after 30 s idle)
# as one detached driver that back-to-back calls poll. fp8's tau proof ran this way: one call
# started it and waited, two more polled, 1,400 s of device time for four stages (docs/benchmarks.md, F12).
#
#     bash scripts/detach.sh start DIR CMD...   # the tree (but .venv, .git) copied to DIR/src; CMD runs there,
#                                               # detached, with OUT=DIR/out; its output in DIR/driver.log
#     bash scripts/detach.sh poll DIR SECONDS   # wait up to SECONDS for CMD to end, show where it is,
#                                               # pack DIR/out into $OUT/detached.tgz (what came back)
#
# e.g. (carry .scratch/wheels):
#     bash scripts/detach.sh start /tmp/d bash -c 'STAGES=tests bash scripts/fp8_check.sh; ...'; \
#         bash scripts/detach.sh poll /tmp/d 540
#     bash scripts/detach.sh poll /tmp/d 560      # the next call, at once
set -uo pipefail
cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: detach.sh start DIR CMD... | poll DIR SECONDS" >&2; exit 2; }
shift 2
case $dir in
/*) case "$dir/" in "$PWD"/*) echo "detach.sh: DIR must lie outside the tree it copies" >&2; exit 2 ;; esac ;;
*) echo "detach.sh: DIR must be an absolute path, got '$dir'" >&2; exit 2 ;;
esac
case $cmd in
start)
    [ $# -gt 0 ] || { echo "detach.sh start: no command" >&2; exit 2; }
    [ -e "$dir/src" ] && { echo "detach.sh: $dir/src exists: a driver started there already" >&2; exit 2; }
    mkdir -p "$dir/out" "$dir/src" || exit 2
    tar -cf - --exclude=./.venv --exclude=./.git . | tar -xf - -C "$dir/src" || exit 2   # the tree, not the venv
    # setsid: the driver outlives the call that started it; rc in DIR/rc once it ends
    (cd "$dir/src" && OUT="$dir/out" setsid nohup bash -c '"$@"; echo $? > "$0/rc"' "$dir" "$@") \
        > "$dir/driver.log" 2>&1 < /dev/null &
    echo "detach.sh: started in $dir"
    ;;
poll)
    secs=${1:-}
    [[ "$secs" =~ ^[0-9]+$ ]] || { echo "detach.sh poll: SECONDS must be a whole number, got '$secs'" >&2; exit 2; }
    # a fresh machine (the last one went back, and its driver with it) has no DIR: say so at once rather
    # than wait out SECONDS of device time for a driver that is not there
    [ -d "$dir/src" ] || { echo "detach.sh: no driver was started in $dir on this machine" >&2; exit 3; }
    end=$(( $(date +%s) + secs ))
    # checked every second: a driver that ends is reported within a second, not up to five later
    while [ ! -f "$dir/rc" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 1; done
    tail -n 20 "$dir/driver.log" 2>/dev/null
    if [ -f "$dir/rc" ]; then echo "detach.sh: ended, rc $(cat "$dir/rc")"; else echo "detach.sh: still running"; fi
    tar czf "${OUT:-.}/detached.tgz" -C "$dir" out driver.log 2>/dev/null
    [ -f "$dir/rc" ] && exit "$(cat "$dir/rc")"
    exit 0
    ;;
*) echo "detach.sh: unknown command '$cmd' (start, poll)" >&2; exit 2 ;;
esac
