# probe.sh WORKDIR PYTHON [PROBE ARGS...]: run the probe program in the live release.
# Exit 86: no release deployed. Otherwise the probe's own exit status; its JSON is on stdout,
# one progress line per case on stderr.
set -u
workdir=$1 python=$2
shift 2
# `pct exec --keep-env 0` leaves no HOME; torch's compile caches want one.
export HOME="${HOME:-/root}" PYTHONUNBUFFERED=1
cd "$workdir/current" 2>/dev/null || { echo "no release deployed in $workdir" >&2; exit 86; }
exec "$python" -m trainer.probe --workdir "$workdir" "$@"
