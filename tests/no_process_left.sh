#!/usr/bin/env bash
# The suite's last test (ctest FIXTURES_CLEANUP): no process of this build's binaries (skyreels-server, skyreels) is
# still running after every other test ended. Leftovers are listed, then killed so they do not outlive the suite
# either, and the test fails.
#   tests/no_process_left.sh BUILD_BIN_DIR
set -u
bin=$(readlink -f "$1")
left=()
for proc in /proc/[0-9]*; do
  pid=${proc#/proc/}
  [ "$pid" = "$$" ] && continue
  exe=$(readlink "$proc/exe" 2>/dev/null) || continue
  exe=${exe% (deleted)}
  case "$exe" in
    "$bin/skyreels-server" | "$bin/skyreels") left+=("$pid") ;;
  esac
done
if [ ${#left[@]} -eq 0 ]; then
  echo "no process of $bin is running"
  exit 0
fi
echo "processes of $bin still running after the suite:"
for pid in "${left[@]}"; do
  echo "  $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)"
done
kill -9 "${left[@]}" 2>/dev/null
exit 1
