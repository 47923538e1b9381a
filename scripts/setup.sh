#!/usr/bin/env bash
# Installs every dependency from Debian 12's archive (as root, or through sudo), then configures and builds.
# Idempotent: packages already present are not reinstalled, and the build is incremental (ccache when present).
#   scripts/setup.sh            # deps + build into ./build
#   SKYREELS_SKIP_DEPS=1 ...    # build only
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  libtorch-dev libopenblas0-openmp
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libspdlog-dev libfmt-dev prometheus-cpp-dev nlohmann-json3-dev libsqlite3-dev
  libgtest-dev libgmock-dev libyaml-dev
  libavcodec-dev libavformat-dev libswscale-dev libavutil-dev
  openssl postgresql libpq-dev
)

install_deps() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
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
}

[ "${SKYREELS_SKIP_DEPS:-0}" = 1 ] || install_deps

BUILD_DIR=${BUILD_DIR:-build}
export CCACHE_BASEDIR="$PWD"
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
JOBS=${JOBS:-$(nproc)}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "setup: built into $BUILD_DIR/bin"
