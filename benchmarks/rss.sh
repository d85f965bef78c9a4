# shellcheck shell=bash
# Memory of a server, sourced by run_all.sh and real_shapes.sh: the resident set of its whole
# process group (vLLM runs its engine in a child process), idle once it answers, and the most
# seen while the workloads run (sampled every 0.5 s into $2.peak until the group is gone or
# the file $2.stop appears). rss_start PGID PREFIX ... rss_stop PGID PREFIX writes PREFIX.json.
rss_group() { ps -o rss= -g "$1" | awk '{s += $1} END {printf "%.0f\n", s * 1024}'; }
# cpu_group PGID: CPU seconds (user + system) the group's live processes have used, from
# /proc/PID/stat (fields 14 and 15 in clock ticks; 12 and 13 after the command's parentheses).
# On a machine shared with others, a workload's CPU seconds say what it cost where its wall
# time says how busy the others were.
cpu_group() {
  pgrep -g "$1" | while read -r p; do sed 's/.*) //' "/proc/$p/stat" 2>/dev/null; done |
    awk -v hz="$(getconf CLK_TCK)" '{s += $12 + $13} END {printf "%.2f\n", s / hz}'
}
watch_rss() {
  local max=0 v
  while kill -0 -- -"$1" 2>/dev/null && [ ! -e "$2.stop" ]; do
    v=$(rss_group "$1"); [ "$v" -gt "$max" ] && { max=$v; echo "$max" > "$2.peak"; }; sleep 0.5
  done
}
rss_start() { sleep 2; rss_group "$1" > "$2.idle"; rm -f "$2.stop" "$2.peak"; watch_rss "$1" "$2" & }
rss_stop() {
  touch "$2.stop"; sleep 1
  echo "{\"idle_rss_bytes\": $(cat "$2.idle"), \"peak_rss_bytes\": $(cat "$2.peak" 2>/dev/null || echo null)}" > "$2.json"
  rm -f "$2.idle" "$2.peak" "$2.stop"
}
