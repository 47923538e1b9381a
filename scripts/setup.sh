#!/usr/bin/env bash
# Installs every dependency from Debian 12's archive (as root, or through sudo), then configures and builds.
# Idempotent: packages already present are not reinstalled, and the build is incremental (ccache when present).
#   scripts/setup.sh            # deps + build into ./build
#   SKYREELS_SKIP_DEPS=1 ...    # build only
#   SKYREELS_TARGETS="skyreels-server skyreels" scripts/setup.sh   # build only these targets (scripts/demo.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  libtorch-dev libopenblas0-openmp libgloo-dev
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libspdlog-dev libfmt-dev prometheus-cpp-dev nlohmann-json3-dev libsqlite3-dev
  libgtest-dev libgmock-dev libyaml-dev
  libavcodec-dev libavformat-dev libswscale-dev libavutil-dev
  openssl postgresql libpq-dev libmicrohttpd-dev curl faketime
  prometheus kubernetes-client nodejs npm chromium
)

# Packages wanted only for a command (tests run promtool, kubectl kustomize, node + npm for the openai SDK, and
# chromium for the page): a machine that already has the command from elsewhere keeps it (Google's `kubectl` package,
# for one, owns /usr/bin/kubectl as well; so does a newer Node.js than Debian 12's 18, which tests/http runs on too).
declare -A COMMAND_OF=([prometheus]=promtool [kubernetes-client]=kubectl [nodejs]=node [npm]=npm [chromium]=chromium)

install_deps() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    [ -n "${COMMAND_OF[$p]:-}" ] && command -v "${COMMAND_OF[$p]}" >/dev/null && continue
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    echo "setup: all ${#PACKAGES[@]} packages present"
    return
  fi
  echo "setup: installing ${#missing[@]} packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
  [[ " ${missing[*]} " == *" prometheus "* ]] && stop_prometheus_daemon "$sudo"
  return 0
}

# Only promtool is wanted from `prometheus`; where an init system runs (no policy-rc.d denying it), the package also
# starts a Prometheus server on :9090, the port skyreels-server's --metrics-listen defaults to.
stop_prometheus_daemon() {
  local sudo=$1
  if [ -d /run/systemd/system ]; then
    $sudo systemctl disable --now prometheus.service
  elif [ -x /etc/init.d/prometheus ]; then
    $sudo /etc/init.d/prometheus stop || true
    $sudo update-rc.d prometheus disable
  fi
}

[ "${SKYREELS_SKIP_DEPS:-0}" = 1 ] || install_deps

BUILD_DIR=${BUILD_DIR:-build}
export CCACHE_BASEDIR="$PWD"
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
JOBS=${JOBS:-$(nproc)}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
# All targets by default (the test binaries, bench_*); SKYREELS_TARGETS names a subset.
TARGETS=()
for t in ${SKYREELS_TARGETS:-}; do TARGETS+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "$JOBS" "${TARGETS[@]}"
echo "setup: built ${SKYREELS_TARGETS:-all targets} into $BUILD_DIR/bin"
