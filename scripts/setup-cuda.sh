#!/usr/bin/env bash
# Installs, as root on Debian 13 ("trixie"), every Debian package the CUDA build of the project needs, from Debian's
# archive only: scripts/setup.sh's own PACKAGES (read from it, never copied here) with Debian's CPU libtorch-dev
# replaced by libtorch-cuda-dev (contrib: LibTorch 2.6 built against CUDA 12.4), plus nvidia-cuda-toolkit (non-free:
# nvcc and the CUDA headers that TorchConfig.cmake requires) and libcuda1 (the driver's user-space library, so that
# LibTorch loads on a machine without a GPU; a container gets the host's through the NVIDIA container toolkit).
# The one file and run by both deploy/docker/Dockerfile.cuda and scripts/check-cuda-build.sh, so they cannot drift.
#
# cuDNN: libtorch-cuda-2.6 depends on nvidia-cudnn, an installer package whose post-install script downloads cuDNN 9
# from NVIDIA (checking its checksum) once its license question is answered "I Agree".
#   --cudnn=nvidia  (default; the image) answers "I Agree" and lets the installer fetch the real cuDNN.
#   --cudnn=stub    (scripts/check-cuda-build.sh only, where nothing outside Debian's archive can be reached) answers
#                   "I Decline" (the installer then downloads nothing) and writes a stub libcudnn.so.9 made from
#                   libtorch_cuda.so's undefined cuDNN symbols: each one a function returning CUDNN_STATUS_NOT_INITIALIZED
#                   under the version node libcudnn.so.9, so that programs link and run on CPU. Never for production:
#                   any cuDNN call on a GPU would fail.
# Also: --print (print the package list and exit).
set -euo pipefail
cd "$(dirname "$0")/.."

CUDNN=nvidia
PRINT=0
for arg in "$@"; do
  case "$arg" in
    --cudnn=nvidia | --cudnn=stub) CUDNN=${arg#--cudnn=} ;;
    --print) PRINT=1 ;;
    *) echo "setup-cuda: unknown argument $arg (expected --cudnn=nvidia|stub, --print)" >&2; exit 2 ;;
  esac
done

# trixie has no grpc-proto package: the two .proto files the build reads (health, reflection) are put in
# /usr/share/grpc-proto by the caller (the chroot check copies Debian 12's; the image takes them from a bookworm stage).
CUDA_PACKAGES=(libtorch-cuda-dev nvidia-cuda-toolkit libcuda1 nvidia-cudnn)
mapfile -t packages < <(bash -c 'eval "$(sed -n "/^PACKAGES=(/,/^)/p" scripts/setup.sh)"; printf "%s\n" "${PACKAGES[@]}"' |
  grep -v -x -e libtorch-dev -e grpc-proto)
packages+=("${CUDA_PACKAGES[@]}")
if [ "$PRINT" = 1 ]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi

. /etc/os-release
[ "${VERSION_CODENAME:-}" = trixie ] || { echo "setup-cuda: needs Debian 13 (trixie), found ${PRETTY_NAME:-?}" >&2; exit 1; }

# contrib (libtorch-cuda, nvidia-cudnn) and non-free (CUDA toolkit, libcuda1) next to main.
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  grep -q '^Components:.*contrib' /etc/apt/sources.list.d/debian.sources ||
    sed -i 's/^Components: main.*/Components: main contrib non-free non-free-firmware/' /etc/apt/sources.list.d/debian.sources
else
  sed -i -E '/^deb /{/contrib/! s/ main$/ main contrib non-free/}' /etc/apt/sources.list
fi

answer="I Agree"
[ "$CUDNN" = stub ] && answer="I Decline"
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debconf-utils
echo "nvidia-cudnn nvidia-cudnn/question select $answer" | debconf-set-selections
echo "nvidia-cudnn nvidia-cudnn/license note" | debconf-set-selections
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}"

if [ "$CUDNN" = stub ]; then
  lib=$(find /usr/lib -name 'libtorch_cuda.so' | head -1)
  [ -n "$lib" ] || { echo "setup-cuda: libtorch_cuda.so not found" >&2; exit 1; }
  work=$(mktemp -d)
  # Undefined dynamic symbols bound to libcudnn.so.9 (objdump names the version node of each).
  objdump -T "$lib" | awk '$0 ~ /\*UND\*/ && $0 ~ /libcudnn/ {print $NF}' | sort -u >"$work/symbols"
  n=$(wc -l <"$work/symbols")
  [ "$n" -gt 0 ] || { echo "setup-cuda: no cuDNN symbols in $lib" >&2; exit 1; }
  {
    echo "/* Stub cuDNN for builds without network (scripts/setup-cuda.sh --cudnn=stub): never for a GPU. */"
    echo "static const char kStub[] = \"cuDNN stub (scripts/setup-cuda.sh --cudnn=stub): no cuDNN here\";"
    while read -r s; do
      case "$s" in
        cudnnGetErrorString) echo "const char* $s(int s) { (void)s; return kStub; }" ;;
        cudnnGetVersion | cudnnGetCudartVersion | cudnnGetMaxDeviceVersion) echo "unsigned long $s(void) { return 0; }" ;;
        *) echo "int $s(void) { return 1; /* CUDNN_STATUS_NOT_INITIALIZED */ }" ;;
      esac
    done <"$work/symbols"
  } >"$work/cudnn_stub.c"
  printf 'libcudnn.so.9 { global: *; };\n' >"$work/cudnn.map"
  # Where nvidia-cudnn's installer puts the real one, recorded in its file list as the installer records its files
  # (so `apt-get purge nvidia-cudnn` removes the stub too, and runtime-closure.sh finds its owner).
  stub=/usr/lib/$(gcc -print-multiarch)/libcudnn.so.9
  gcc -shared -fPIC -O1 -o "$stub" -Wl,-soname,libcudnn.so.9 -Wl,--version-script="$work/cudnn.map" \
    "$work/cudnn_stub.c"
  mkdir -p /var/lib/nvidia-cudnn
  grep -qxF "$stub" /var/lib/nvidia-cudnn/filelist.txt 2>/dev/null || echo "$stub" >>/var/lib/nvidia-cudnn/filelist.txt
  ldconfig
  echo "setup-cuda: stub $stub with $n cuDNN symbols (check only, never for a GPU)"
  rm -rf "$work"
fi
echo "setup-cuda: ${#packages[@]} packages (cuDNN: $CUDNN)"
