#!/usr/bin/env bash
# Builds and tests the project against LibTorch 2.x on a Debian 12 machine without a GPU: Debian 13 ("trixie") ships
# LibTorch 2.6 (CPU), GCC 14 and FFmpeg 7, so a trixie chroot compiles the `TORCH_VERSION_MAJOR >= 2` paths
# (at::scaled_dot_product_attention) and runs the whole suite on them. CUDA code still needs a GPU machine.
# Needs root and network access to Debian's archive; the chroot lives outside the repository.
#   scripts/check-libtorch2.sh              # chroot (once), packages, build into build-trixie/, ctest
#   TRIXIE_ROOT=/path scripts/check-libtorch2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ROOT=${TRIXIE_ROOT:-/var/tmp/skyreels-trixie}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ ! -x "$ROOT/usr/bin/apt-get" ]; then
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
  debootstrap --variant=minbase trixie "$ROOT" "$MIRROR"
fi

cleanup() { umount -R "$ROOT/src" "$ROOT/proc" "$ROOT/sys" "$ROOT/dev" 2>/dev/null || true; }
trap cleanup EXIT
mount -t proc proc "$ROOT/proc"
mount --rbind /sys "$ROOT/sys" && mount --make-rslave "$ROOT/sys"
mount --rbind /dev "$ROOT/dev" && mount --make-rslave "$ROOT/dev"
mkdir -p "$ROOT/src" && mount --bind "$REPO" "$ROOT/src"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"

# setup.sh's own package list (never copied here). Trixie has no grpc-proto package: the two .proto files the build
# needs (health, reflection) come from this machine's, which setup.sh installed.
mapfile -t packages < <(bash -c 'eval "$(sed -n "/^PACKAGES=(/,/^)/p" scripts/setup.sh)"; printf "%s\n" "${PACKAGES[@]}"' |
  grep -v -x -e grpc-proto)
mkdir -p "$ROOT/usr/share/grpc-proto" && cp -r /usr/share/grpc-proto/. "$ROOT/usr/share/grpc-proto/"

chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root bash -c "
  set -euo pipefail
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends ${packages[*]} >/dev/null
  cd /src
  source scripts/env.sh
  export CCACHE_BASEDIR=/src
  [ -f build-trixie/build.ninja ] || cmake -S . -B build-trixie -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build build-trixie
  build-trixie/bin/skyreels version
  cd build-trixie && ctest -j \$(nproc) --output-on-failure
"
