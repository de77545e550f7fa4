#!/bin/bash
# Optional host tuning before a run, as AMD's flux submission does (runtime_tunables.sh) plus NVIDIA's page
# cache drop. flux_train/cluster/launch.py runs it once per node when env.runtime_tunables=true. Every step is
# optional: it prints "ok" or "skipped: <why>" (not root, tool missing, /proc/sys read-only in a container)
# and the script always exits 0, so tuning never stops a job.
# FLUX_TUNABLES_ROOT prefixes the /proc and /sys paths (the tests point it at a scratch tree).
root="${FLUX_TUNABLES_ROOT:-}"

step() {  # step DESCRIPTION COMMAND...: run one tuning step and report it
  local what=$1 out
  shift
  if out=$("$@" 2>&1); then echo "ok       $what"; else echo "skipped  $what: ${out:-failed}"; fi
}
write() {  # write PATH VALUE
  [ -w "$root$1" ] || { echo "$root$1 is missing or not writable"; return 1; }
  echo "$2" > "$root$1"
}
have() { command -v "$1" >/dev/null || { echo "$1 not found"; return 1; }; }
drop_caches() { sync && write /proc/sys/vm/drop_caches 3; }
governor() { have cpupower && cpupower frequency-set -g performance; }
idle_states() { have cpupower && cpupower idle-set -d 2; }

step "drop the page cache (vm.drop_caches=3)" drop_caches
step "CPU frequency governor performance" governor
step "no CPU idle states deeper than C1 (cpupower idle-set -d 2)" idle_states
step "kernel.numa_balancing=0" write /proc/sys/kernel/numa_balancing 0
step "kernel.nmi_watchdog=0" write /proc/sys/kernel/nmi_watchdog 0
step "kernel.randomize_va_space=0" write /proc/sys/kernel/randomize_va_space 0
step "transparent hugepages enabled=always" write /sys/kernel/mm/transparent_hugepage/enabled always
step "transparent hugepages defrag=always" write /sys/kernel/mm/transparent_hugepage/defrag always
exit 0
