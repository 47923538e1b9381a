#!/usr/bin/env bash
# Installs the Debian 12 packages the benches' Python side needs (diffusers' own pipeline through
# scripts/diffusers_env.py: `bench_samplers` / `bench_step_savings --diffusers-src DIR`, the tests/data/*/make_cases.py
# generators), as root or through sudo. Idempotent like scripts/setup.sh: packages already present are not
# reinstalled. The list is scripts/python_deps.py's (which the Python side checks on start); setup.sh leaves them out
# because the build and the tests never run Python.
#   scripts/bench-deps.sh
set -euo pipefail
cd "$(dirname "$0")/.."

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
updated=0
apt_install() {
  [ "$updated" = 1 ] || { $sudo apt-get update -q; updated=1; }
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "$@"
}

[ -x /usr/bin/python3 ] || apt_install python3  # the benches run /usr/bin/python3 (Debian's, with its torch 1.13)

missing=()
while read -r p; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done < <(/usr/bin/python3 scripts/python_deps.py --list)
if [ ${#missing[@]} -eq 0 ]; then
  echo "bench-deps: all Python packages present"
else
  echo "bench-deps: installing ${#missing[@]} packages: ${missing[*]}"
  apt_install "${missing[@]}"
fi
/usr/bin/python3 scripts/python_deps.py
