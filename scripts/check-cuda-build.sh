#!/usr/bin/env bash
# Builds the whole project with CUDA on a machine without a GPU and runs the whole suite on CPU: a Debian 13
# ("trixie") chroot with main, contrib and non-free gets scripts/setup-cuda.sh's packages (the same script
# deploy/docker/Dockerfile.cuda runs): LibTorch 2.6 built against CUDA 12.4 (libtorch-cuda-dev), the CUDA toolkit, the
# driver's user-space library (libcuda1) and the project's own package list. cuDNN cannot be downloaded here, so the
# check (never the image) uses setup-cuda.sh's stub libcudnn.so.9. Configures with CUDA (TorchConfig's CUDA
# language, architecture 9.0), warnings as errors for project code, builds into build-cuda/ and runs ctest with
# torch::cuda::is_available() false; then builds the model-only tree (-DSKYREELS_MODEL_ONLY=ON) into build-cuda-model/
# and runs scripts/gpu-check.sh --cpu on it. Needs root and Debian's archive; the chroot lives outside the repository.
#   scripts/check-cuda-build.sh                     # chroot (once), packages, build, ctest
#   CUDA_TRIXIE_ROOT=/path scripts/check-cuda-build.sh
#   CTEST_ARGS='-R test_transformer' scripts/check-cuda-build.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ROOT=${CUDA_TRIXIE_ROOT:-/var/tmp/skyreels-trixie-cuda}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
JOBS=${JOBS:-$(nproc)}
start=$(date +%s)

if [ ! -x "$ROOT/usr/bin/apt-get" ]; then
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
  debootstrap --variant=minbase --components=main,contrib,non-free trixie "$ROOT" "$MIRROR"
fi

cleanup() { umount -R "$ROOT/src" "$ROOT/proc" "$ROOT/sys" "$ROOT/dev" 2>/dev/null || true; }
trap cleanup EXIT
mount -t proc proc "$ROOT/proc"
mount --rbind /sys "$ROOT/sys" && mount --make-rslave "$ROOT/sys"
mount --rbind /dev "$ROOT/dev" && mount --make-rslave "$ROOT/dev"
mkdir -p "$ROOT/src" && mount --bind "$REPO" "$ROOT/src"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# No daemon starts inside the chroot (postgresql and prometheus would start theirs on install).
printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d" && chmod +x "$ROOT/usr/sbin/policy-rc.d"
# Trixie has no grpc-proto package: the two .proto files the build needs come from this machine's (setup.sh's).
mkdir -p "$ROOT/usr/share/grpc-proto" && cp -r /usr/share/grpc-proto/. "$ROOT/usr/share/grpc-proto/"

chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root JOBS="$JOBS" CTEST_ARGS="${CTEST_ARGS:-}" bash -c '
  set -euo pipefail
  cd /src
  t0=$(date +%s)
  kib_before=$(dpkg-query -W -f="\${Installed-Size}\n" | awk "{s+=\$1} END {print s}")
  scripts/setup-cuda.sh --cudnn=stub >/tmp/setup-cuda.log 2>&1 || { tail -40 /tmp/setup-cuda.log; exit 1; }
  tail -2 /tmp/setup-cuda.log
  kib_after=$(dpkg-query -W -f="\${Installed-Size}\n" | awk "{s+=\$1} END {print s}")
  t1=$(date +%s)
  echo "check-cuda: packages in $((t1 - t0)) s; installed size $((kib_after / 1024)) MiB ($(((kib_after - kib_before) / 1024)) MiB added this run)"
  source scripts/env.sh
  export CCACHE_BASEDIR=/src CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
  export TORCH_CUDA_ARCH_LIST=9.0
  [ -f build-cuda/build.ninja ] || cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DSKYREELS_WERROR=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DTORCH_CUDA_ARCH_LIST=9.0
  grep -q "^SKYREELS_TORCH_CUDA:INTERNAL=ON" build-cuda/CMakeCache.txt ||
    { echo "check-cuda: LibTorch was configured without CUDA" >&2; exit 1; }
  cmake --build build-cuda -j "$JOBS" -- -k 0  # every error at once
  t2=$(date +%s)
  echo "check-cuda: build in $((t2 - t1)) s"
  build-cuda/bin/skyreels version | tee /tmp/version.txt
  # A CUDA LibTorch on a machine without a GPU: torch::cuda::is_available() is false, so the suite runs on the CPU.
  grep -q "^cuda: LibTorch built with CUDA, 0 device(s) available" /tmp/version.txt
  cd build-cuda && ctest -j "$JOBS" --output-on-failure $CTEST_ARGS
  t3=$(date +%s)
  echo "check-cuda: ctest in $((t3 - t2)) s"
  # The model-only build (what scripts/gpu-check.sh builds on a GPU machine) with the same CUDA LibTorch, and the
  # GPU check on its binaries, on the CPU.
  cd /src
  [ -f build-cuda-model/build.ninja ] || cmake -S . -B build-cuda-model -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DSKYREELS_MODEL_ONLY=ON -DSKYREELS_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DTORCH_CUDA_ARCH_LIST=9.0 >/dev/null
  cmake --build build-cuda-model -j "$JOBS"
  scripts/gpu-check.sh /tmp/gpu-check-model-only --cpu --bin build-cuda-model/bin >/tmp/gpu-check.out ||
    { cat /tmp/gpu-check.out; exit 1; }
  head -1 /tmp/gpu-check.out
  echo "check-cuda: model-only build and gpu-check --cpu in $(($(date +%s) - t3)) s"
'
echo "check-cuda: done in $(($(date +%s) - start)) s"
