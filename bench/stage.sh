# Sourced by the GPU scripts (bench/gpu_run.sh, bench/gpu_campaign.sh): `stage NAME LIMIT_S CMD...` runs CMD under a
# time limit with its output in $LOG/NAME.log, prints its exit status, time and last $TAIL lines, returns its status.
stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  tail -n "${TAIL:-25}" "$LOG/$name.log"
  return $rc
}
