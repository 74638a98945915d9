#!/usr/bin/env bash
# Runs test jobs side by side, STREAMFLEET_TEST_LANES at a time (default 4):
# the end-to-end tests mostly wait on the control plane, Redis and the clock,
# so two cores take more than one test binary at a time (scripts/test.sh
# records how busy the cores were in its timings figure: with 3 lanes they
# were idle much of the run). Each test binary
# starts its own control plane, with addresses of its own (the test bed's
# `kubelet::Slot`), so they do not meet.
#
# Reads jobs from stdin, one per line: `<name> <command...>`, longest first
# (they start in that order); when an earlier run left its times, they start
# longest first by those instead, so no long job starts last. Each job's output goes to
# target/test-logs/<name>.log and is printed whole when it fails. Every job
# runs, whatever fails; the exit status is 1 if any failed. The jobs' times
# go to target/test-logs/times.tsv.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lanes=${STREAMFLEET_TEST_LANES:-4}
logs="$root/target/test-logs"
mkdir -p "$logs"
# The last run's seconds per job (none: the order given).
if [ -f "$logs/times.tsv" ]; then mv "$logs/times.tsv" "$logs/times-before.tsv"; else : > "$logs/times-before.tsv"; fi
: > "$logs/times.tsv"
start=$(date +%s)
run_job() {
  local name=$1 command=$2 began rc=0
  began=$(date +%s)
  bash -c "$command" > "$logs/$name.log" 2>&1 || rc=$?
  local took=$(( $(date +%s) - began ))
  printf '%s\t%s\t%s\n' "$name" "$rc" "$took" >> "$logs/times.tsv"
  if [ "$rc" -eq 0 ]; then
    printf '    %-40s ok      %4ss (done at %ss)\n' "$name" "$took" "$(( $(date +%s) - start ))" >&2
  else
    printf '    %-40s FAILED  %4ss, exit %s; its output:\n' "$name" "$took" "$rc" >&2
    sed 's/^/    | /' "$logs/$name.log" >&2
  fi
}
export -f run_job
export logs start
# Longest first by the last run's times; a job the last run did not have,
# or that failed in it (perhaps early), counts as the longest; ties keep their order; the last job given stays
# last (test.sh's images test waits for the images built beside the jobs).
# Then one line per job: the name, then the command (read whole by `read`).
# shellcheck disable=SC2016 # run_job's arguments, expanded by the inner bash
awk -v before="$logs/times-before.tsv" 'BEGIN {
  while ((getline line < before) > 0) { split(line, f, "\t"); if (f[2] == 0) took[f[1]] = f[3] }
}
NF { split($0, words, " "); job[++n] = $0; name[n] = words[1] }
END {
  for (i = 1; i <= n; i++) {
    key = (i == n) ? -1 : ((name[i] in took) ? took[name[i]] : 1000000)
    printf "%d\t%d\t%s\n", key, i, job[i]
  }
}' | sort -t$'\t' -k1,1nr -k2,2n | cut -f3- |
while read -r name command; do
  [ -n "$name" ] && printf '%s\0%s\0' "$name" "$command"
done | xargs -0 -n 2 -P "$lanes" bash -c 'run_job "$0" "$1"'
failed=$(awk -F'\t' '$2 != 0 { print $1 }' "$logs/times.tsv")
printf '    %s jobs in %ss on %s lanes\n' "$(wc -l < "$logs/times.tsv")" "$(( $(date +%s) - start ))" "$lanes" >&2
if [ -n "$failed" ]; then
  printf 'failed: %s\n' "$failed" | tr '\n' ' ' >&2
  echo >&2
  exit 1
fi
